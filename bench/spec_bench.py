"""Speculative decoding by prompt lookup: one stream's decode rate with and without it, on a
document-summary prompt (an answer that quotes its document), and the household mix at 8
clients with it on and off, against `edgepaged serve` (a subprocess, loopback only).

1. `tok_s_b1_plain`, `tok_s_b1_lookup`: generated tokens per second of decode (after the
   first token) for a summary of a ~700-token household document that quotes its key
   sentences, greedy, 160 tokens (and `*_edit`: the note again with one word changed);
   plain and lookup alternate request by request in one server (`speculative: false` on the
   plain ones), the median of `--reps` each; `acceptance_rate_lookup` from the server's
   /stats (accepted / drafted over the lookup requests); `lookup_ratio` their ratio.
2. `household_ratio`: generated tokens per second of 8 clients asking chat questions at once
   (each answer up to 96 tokens), with speculation on and off, alternated in phases.
3. llama.cpp's server on the same file with n-gram lookup (`--spec-type ngram-simple`,
   lookup n-gram 3, drafts of up to 8) and without, when `--llama-server PATH` is given or
   `llama-server` is on the PATH: `llama_cpp_tok_s_b1_plain`, `llama_cpp_tok_s_b1_lookup`
   (its own `timings.predicted_per_second`), else null with the reason.
4. `tok_s_b1_draft`, `acceptance_rate_draft`: a draft model's speculation on chat answers
   (`serve --draft`), beside `tok_s_b1_plain_chat` (the same questions with `speculative:
   false`, alternated in one server), greedy, `--chat-tokens` each. The pair: `--draft-target`
   drafted for by `--draft-model`; by default the embedded SmolLM2-135M drafts for a 0.9 B
   model made from it (`write_widened_gguf`: its MLP widened to 16,384 neurons, Q8_0, the new
   neurons' down projection 0.1 of the originals' size, so the two models differ as a small
   model and a large one of a family do), written once under --cache-dir. llama.cpp's server
   on the same pair (`-md`, `--spec-draft-n-max` as ours) gives `llama_cpp_tok_s_b1_draft`
   and `llama_cpp_tok_s_b1_plain_chat`.

    python bench/spec_bench.py [--json] [--model FILE.gguf | --model 1b] [--llama-server PATH]
                               [--draft-target FILE --draft-model FILE] [--no-draft]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from bench.family_bench import cpu_flags, synthetic
from bench.soak import start_llama_server, start_server

DOC = Path(__file__).resolve().parent / "data" / "coriolanus.txt"
CHORES = ("The heating runs from six to eight in the morning and from five to ten at night. The kitchen lights "
          "turn off at eleven. The garden sprinklers water the lawn every second day at dawn, except when it "
          "rained the day before. The bins go out on Tuesday evening: the green bin every week, the blue bin "
          "every other week. The car needs its insurance renewed by the first of March; the invoice arrived on "
          "the twelfth and is paid by direct debit. The children's school starts at a quarter to nine; homework "
          "is checked after dinner. The dog is walked at seven and at six. ")


def document(words: int = 520) -> str:
    text = (CHORES * 8).split()
    return " ".join(text[:words])


def summary_messages() -> list[dict]:
    """A summary that quotes its document (what a household's document assistant is asked)."""
    return [{"role": "system", "content": "You summarize household documents by quoting their key sentences "
             "verbatim."},
            {"role": "user", "content": "Document:\n" + document() + "\n\nQuote the three most important sentences "
             "of the document, word for word."}]


def edit_messages() -> list[dict]:
    """An edit: the text again with one change."""
    return [{"role": "user", "content": "Rewrite this note, replacing 'Tuesday' with 'Wednesday' and changing "
             "nothing else:\n\n" + document(300)}]


def post(url: str, body: dict, timeout: float = 900) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def decode_rate(base: str, messages: list[dict], max_tokens: int, **extra) -> tuple[float, int]:
    """(decode tokens per second after the first token, tokens generated) of one streamed answer."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, **extra}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    first = None
    n = 0
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return ((n - 1) / (end - first) if first and n > 1 else 0.0), n


def spec_counts(base: str) -> tuple[int, int]:
    s = json.loads(urllib.request.urlopen(base + "/stats", timeout=30).read()).get("speculation", {})
    return (sum(v["drafted"] for v in s.values()), sum(v["accepted"] for v in s.values()))


def household(base: str, speculative: bool, seconds: float, clients: int = 8) -> float:
    """Generated tokens per second of `clients` asking at once for `seconds`."""
    questions = ["Turn the kitchen light off and say so.", "What should I cook tonight with rice and beans?",
                 "Write a short note for the babysitter about bedtime.", "List five chores for Saturday.",
                 "Explain how a heat pump works in two sentences.", "Suggest a name for a grey cat.",
                 "What is a good stretch after running?", "Remind me what the green bin is for."]
    total, lock, stop = [0], threading.Lock(), time.perf_counter() + seconds

    def client(i: int) -> None:
        k = 0
        while time.perf_counter() < stop:
            q = questions[(i + k) % len(questions)]
            out = post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": q}],
                                                       "max_tokens": 96, "temperature": 0.7, "seed": i * 100 + k,
                                                       "speculative": speculative})
            with lock:
                total[0] += out["usage"]["completion_tokens"]
            k += 1
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total[0] / (time.perf_counter() - t0)


def llama_cpp(exe: str | None, model: str, messages: list[dict], max_tokens: int, reps: int) -> dict:
    exe = exe or shutil.which("llama-server")
    if exe is None:
        note = "llama.cpp's llama-server is not installed here (give --llama-server PATH)"
        return {"llama_cpp_tok_s_b1_plain": None, "llama_cpp_tok_s_b1_lookup": None, "llama_cpp_note": note}
    out = {}
    for name, flags in (("plain", []), ("lookup", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                                   "--spec-ngram-simple-size-m", "8"])):
        proc, base = start_llama_server(exe, model, "-t", "2", "-c", "4096", "-np", "1", *flags, wait_s=240)
        if proc is None:
            out[f"llama_cpp_tok_s_b1_{name}"], out["llama_cpp_note"] = None, "llama-server did not start"
            continue
        try:
            rates = []
            for _ in range(reps):
                r = post(base + "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                         "temperature": 0, "cache_prompt": False})
                rates.append(r["timings"]["predicted_per_second"])
                if name == "lookup":
                    t = r["timings"]
                    if t.get("draft_n"):
                        out["llama_cpp_acceptance_rate_lookup"] = round(t.get("draft_n_accepted", 0) / t["draft_n"], 3)
            out[f"llama_cpp_tok_s_b1_{name}"] = round(statistics.median(rates), 2)
        finally:
            proc.terminate()
            proc.wait(30)
    return out


CHAT = ["Write a short friendly paragraph explaining why people should drink water every day.",
        "Explain in a few sentences how to keep a sourdough starter alive.",
        "Give me some tips for sleeping better when the nights are warm.",
        "Describe a relaxing Sunday morning routine for a family with two children."]


def draft_pair(args) -> tuple[str, str]:
    from edgepaged.model.loader import default_model_path
    from edgepaged.testing.gguf_models import write_widened_gguf
    draft = args.draft_model or str(default_model_path())
    if args.draft_target:
        return args.draft_target, draft
    path = args.cache_dir / "smollm2-widened-16384-n0.1.q8_0.gguf"
    if not path.exists():
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (once)", flush=True)
        tmp = path.with_suffix(".tmp")
        write_widened_gguf(default_model_path(), tmp, inter=16384, noise=0.1, seed=1)
        tmp.rename(path)
    return str(path), draft


def draft_rates(target: str, draft: str, args) -> dict:
    """A draft model's speculation against plain decoding on chat answers, alternated."""
    proc, base, _ = start_server("--model", target, "--draft", draft, *(
        ["--spec-tokens", str(args.draft_tokens)] if args.draft_tokens else []))
    try:
        chat = lambda q: [{"role": "user", "content": q}]   # noqa: E731
        decode_rate(base, chat(CHAT[0]), 8)                                  # warm
        plain, drafted_rates, drafted, accepted = [], [], 0, 0
        for _ in range(args.reps):
            for q in CHAT:
                plain.append(decode_rate(base, chat(q), args.chat_tokens, speculative=False)[0])
                d0, a0 = spec_counts(base)
                drafted_rates.append(decode_rate(base, chat(q), args.chat_tokens)[0])
                d1, a1 = spec_counts(base)
                drafted, accepted = drafted + d1 - d0, accepted + a1 - a0
        stats = json.loads(urllib.request.urlopen(base + "/stats", timeout=30).read())
    finally:
        proc.terminate()
        proc.wait(30)
    out = {"draft_target": Path(target).name, "draft_model": Path(draft).name,
           "tok_s_b1_plain_chat": round(statistics.median(plain), 2),
           "tok_s_b1_draft": round(statistics.median(drafted_rates), 2),
           "acceptance_rate_draft": round(accepted / drafted, 3) if drafted else None,
           "draft_seconds": stats.get("draft_model", {}).get("seconds")}
    out["draft_ratio"] = round(out["tok_s_b1_draft"] / out["tok_s_b1_plain_chat"], 2)
    return out


def llama_cpp_draft(exe: str | None, target: str, draft: str, args) -> dict:
    exe = exe or shutil.which("llama-server")
    if exe is None:
        return {"llama_cpp_tok_s_b1_draft": None, "llama_cpp_tok_s_b1_plain_chat": None}
    out = {}
    n = str(args.draft_tokens or 4)
    for name, flags in (("plain_chat", []), ("draft", ["-md", draft, "--spec-draft-n-max", n, "--spec-draft-n-min",
                                                       "0", "--spec-draft-p-min", "0"])):
        proc, base = start_llama_server(exe, target, "-t", "2", "-c", "4096", "-np", "1", *flags, wait_s=240)
        if proc is None:
            out[f"llama_cpp_tok_s_b1_{name}"] = None
            continue
        try:
            rates, dn, da = [], 0, 0
            for _ in range(args.reps):
                for q in CHAT:
                    r = post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": q}],
                                                             "max_tokens": args.chat_tokens, "temperature": 0,
                                                             "cache_prompt": False})
                    rates.append(r["timings"]["predicted_per_second"])
                    dn += r["timings"].get("draft_n", 0)
                    da += r["timings"].get("draft_n_accepted", 0)
            out[f"llama_cpp_tok_s_b1_{name}"] = round(statistics.median(rates), 2)
            if name == "draft":
                out["llama_cpp_acceptance_rate_draft"] = round(da / dn, 3) if dn else None
        finally:
            proc.terminate()
            proc.wait(30)
    if out.get("llama_cpp_tok_s_b1_draft") and out.get("llama_cpp_tok_s_b1_plain_chat"):
        out["llama_cpp_draft_ratio"] = round(out["llama_cpp_tok_s_b1_draft"] / out["llama_cpp_tok_s_b1_plain_chat"], 2)
    return out


def main() -> None:
    from edgepaged.model.loader import default_model_path
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="a GGUF file, or 1b (family_bench's Llama-3.2-1B-shaped Q4_K_M); "
                    "default: the embedded SmolLM2-135M")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--household-s", type=float, default=40.0)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "edgepaged" / "bench")
    ap.add_argument("--draft-target", default=None, help="the model a draft model drafts for (default: the embedded "
                    "model widened to 0.9 B, written once)")
    ap.add_argument("--draft-model", default=None, help="the draft model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--draft-tokens", type=int, default=None, help="--spec-tokens for the draft model's server")
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--no-draft", action="store_true", help="skip the draft model's part (its figures are null)")
    ap.add_argument("--no-lookup", action="store_true", help="skip prompt lookup and the household (null figures)")
    args = ap.parse_args()
    model = str(synthetic("q4_k_m", args.cache_dir)) if args.model == "1b" else args.model or str(default_model_path())
    from edgepaged.model import weights_cache
    weights_cache.prepare(model)      # a large file's layout cached first: no writer beside the measurement
    out = {"cpu": cpu_flags(), "model": Path(model).name, "max_tokens": args.max_tokens}
    out.update(lookup_part(model, args) if not args.no_lookup else
               {k: None for k in ("tok_s_b1_plain", "tok_s_b1_lookup", "acceptance_rate_lookup", "household_ratio")})
    if args.no_draft:
        out.update(tok_s_b1_draft=None, acceptance_rate_draft=None, draft_note="--no-draft")
    else:
        target, draft = draft_pair(args)
        out.update(draft_rates(target, draft, args))
        out.update(llama_cpp_draft(args.llama_server, target, draft, args))
    print(f"one stream: plain {out['tok_s_b1_plain']} tok/s, lookup {out['tok_s_b1_lookup']} tok/s "
          f"({out.get('lookup_ratio')}x, acceptance {out['acceptance_rate_lookup']}); household at 8: "
          f"{out['household_ratio']}x; llama.cpp plain {out.get('llama_cpp_tok_s_b1_plain')}, lookup "
          f"{out.get('llama_cpp_tok_s_b1_lookup')}")
    if out.get("tok_s_b1_draft") is not None:
        print(f"draft model {out['draft_model']} for {out['draft_target']}: chat plain {out['tok_s_b1_plain_chat']} "
              f"tok/s, drafted {out['tok_s_b1_draft']} tok/s ({out['draft_ratio']}x, acceptance "
              f"{out['acceptance_rate_draft']}); llama.cpp plain {out.get('llama_cpp_tok_s_b1_plain_chat')}, "
              f"drafted {out.get('llama_cpp_tok_s_b1_draft')} (acceptance {out.get('llama_cpp_acceptance_rate_draft')})")
    if args.json:
        print(json.dumps(out))


def lookup_part(model: str, args) -> dict:
    messages = summary_messages()
    proc, base, _ = start_server("--model", model, "--speculate", "lookup")
    try:
        decode_rate(base, messages, 8)                                        # warm
        plain, lookup, drafted, accepted = [], [], 0, 0
        edit_plain, edit_lookup = [], []
        for _ in range(args.reps):                                            # alternated, one process
            plain.append(decode_rate(base, messages, args.max_tokens, speculative=False)[0])
            d0, a0 = spec_counts(base)
            lookup.append(decode_rate(base, messages, args.max_tokens)[0])
            d1, a1 = spec_counts(base)
            drafted, accepted = drafted + d1 - d0, accepted + a1 - a0
            edit_plain.append(decode_rate(base, edit_messages(), args.max_tokens, speculative=False)[0])
            edit_lookup.append(decode_rate(base, edit_messages(), args.max_tokens)[0])
        phases = {True: [], False: []}
        for on in (False, True, False, True):
            phases[on].append(household(base, on, args.household_s / 4))
    finally:
        proc.terminate()
        proc.wait(30)
    out = {"tok_s_b1_plain": round(statistics.median(plain), 2), "tok_s_b1_lookup": round(statistics.median(lookup), 2),
           "acceptance_rate_lookup": round(accepted / drafted, 3) if drafted else None,
           "drafted_per_answer": round(drafted / args.reps, 1),
           "tok_s_b1_plain_edit": round(statistics.median(edit_plain), 2),
           "tok_s_b1_lookup_edit": round(statistics.median(edit_lookup), 2),
           "household_tok_s_on": round(statistics.mean(phases[True]), 2),
           "household_tok_s_off": round(statistics.mean(phases[False]), 2)}
    out["lookup_ratio"] = round(out["tok_s_b1_lookup"] / out["tok_s_b1_plain"], 2) if out["tok_s_b1_plain"] else None
    out["household_ratio"] = round(out["household_tok_s_on"] / out["household_tok_s_off"], 2)
    out.update(llama_cpp(args.llama_server, model, messages, args.max_tokens, args.reps))
    if out.get("llama_cpp_tok_s_b1_plain") and out.get("llama_cpp_tok_s_b1_lookup"):
        out["llama_cpp_lookup_ratio"] = round(out["llama_cpp_tok_s_b1_lookup"] / out["llama_cpp_tok_s_b1_plain"], 2)
    return out


if __name__ == "__main__":
    main()
