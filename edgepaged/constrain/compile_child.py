"""A format checked in a process of its own, which the server kills at the compile-time limit
(llguidance's compile cannot be stopped in a thread). Started fresh for each large format, at
the lowest priority; it reads one job from stdin and writes one answer to stdout, both
pickled (the server wrote the job; nothing else reaches this process):

    job    = {"tokenizer": tokenizer.json text, "vocab": n, "stops": [...], "eos": id, "bos": id,
              "table": bool, "limits": GrammarLimits, "spec": dict | None, "grammar": str | None}
    answer = ("ok", grammar text) | ("refused", message) | ("failed", one line)

A fresh process, not a fork of the server: a forked child shares the server's memory
copy-on-write for as long as it runs, and every page the server then touches was copied
(the server's own JSON parsing ran 10-30x slower beside a compiling child: /health 230 ms).
"""
from __future__ import annotations

import os
import pickle
import sys
from types import SimpleNamespace


def main() -> None:
    job = pickle.load(sys.stdin.buffer)
    try:
        os.nice(19)                      # the box's own work first: this is a stranger's format
    except OSError:
        pass
    from tokenizers import Tokenizer as HFTokenizer

    from ..common.brief import first_line
    from .grammar import Grammars, GrammarRefused, lltokenizer
    try:
        tok = SimpleNamespace(tok=HFTokenizer.from_str(job["tokenizer"]), eos_token_id=job["eos"],
                              bos_token_id=job["bos"], stop_token_ids=frozenset(job["stops"]))
        g = Grammars(tok, job["vocab"], job["limits"])
        g._lltok = lltokenizer(tok, job["vocab"], list(job["stops"]) or None, table=job["table"])
        out = ("ok", g._checked(job["spec"], job["grammar"]))
    except GrammarRefused as e:
        out = ("refused", str(e))
    except BaseException as e:           # noqa: BLE001 - said to the server, in one line
        out = ("failed", first_line(f"{type(e).__name__}: {e}"))
    sys.stdout.buffer.write(pickle.dumps(out))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
