"""Perplexity under the context policies (issue 25): the embedded model on a public-domain text
the repository ships (bench/data/coriolanus.txt, about 4,000 tokens), teacher-forced, with full
attention, with the window policy (the first `--sink` tokens and the last `--window`), and with
the window and no sinks.

    python bench/perplexity.py [--json] [--window 1024,256] [--sink 4] [--tokens N]

The real parts do the work: the Rust allocator gives the window's blocks back after each token
exactly as the engine does (`release_outside`), the step's block tables leave them out, and the
runner (the torch-free CPU runtime, the server's default) computes the logits. Full attention
reads the text in chunks of 256 tokens; the window policies one token a step, as a sequence
that generates meets it (a query then attends its sink blocks and between W and W + 15 of the
tokens before it: whole blocks of 16). The last line with --json is one object:

    {"tokens", "full": {"ppl", "nll"}, "window_W": {...}, "window_W_no_sink": {...}, "seconds", ...}
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from edgepaged.testing.perplexity import perplexity

TEXT = Path(__file__).resolve().parent / "data" / "coriolanus.txt"


def text_ids(tokenizer, limit: int | None = None) -> list[int]:
    ids = tokenizer.encode(TEXT.read_text())
    return ids[:limit] if limit else ids



def policies(windows: list[int], sink: int) -> list[tuple[str, int | None, int]]:
    out = [("full", None, 0)]
    for w in windows:
        out += [(f"window_{w}", w, sink), (f"window_{w}_no_sink", w, 0)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--window", default="1024,256", help="windows to measure (tokens), comma-separated")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=None, help="only the text's first N tokens")
    args = ap.parse_args()
    from edgepaged.model.runtime import open_runner
    runner = open_runner(None, num_blocks=512, block_size=16)
    ids = text_ids(runner.tokenizer, args.tokens)
    out = {"text": TEXT.name, "tokens": len(ids), "model": runner.model_path.name,
           "runtime": type(runner).__name__, "sink": args.sink}
    print(f"{TEXT.name}: {len(ids)} tokens, {runner.model_path.name}", flush=True)
    t0 = time.monotonic()
    for name, w, s in policies([int(x) for x in args.window.split(",") if x], args.sink):
        t = time.monotonic()
        out[name] = perplexity(runner, ids, w, s)
        print(f"  {name:22} perplexity {out[name]['ppl']:8.3f}  (KV blocks at most {out[name]['kv_blocks_max']}, "
              f"{time.monotonic() - t:.0f} s)", flush=True)
    out["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
