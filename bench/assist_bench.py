"""Home Assistant's voice command, answered at once: its long request (a system prompt listing
60 exposed entities with areas and states, 7 intent tools, a short spoken command,
temperature 0, at most 24 tokens) through the OpenAI door and the Ollama door, repeated with
other commands while a chat and a document summary run beside it, against `edgepaged serve`
on loopback (and llama.cpp's server on the same file, `--cache-reuse` as a household sets it,
when installed).

Figures (the last line with --json):
- `ttft_cold_s`: the first command ever (the whole prompt prefilled), to its first streamed
  byte of content or of a tool call; `served_prefill_tok_s`: its prompt tokens over that time.
- `served_prefill_ratio`: the same rate over `family_bench`'s `prefill_tok_s` (a 512-token
  prompt in one process, best of 2) on the file, as the median of `--cold-runs` pairs measured
  alternately in this run (each cold command on a fresh server with an empty store);
  `family_prefill_tok_s` the best of those family_bench rates, `cold_pairs` every pair.
  `same_length_vs_family` and `served_vs_same_length` split that ratio: the in-process rate
  of a prompt as long as the command's (in the server's 512-token steps) over family_bench's,
  and the served rate over it (medians of the pairs).
- `ttft_cold_ollama_s`: the Ollama door's first command (its rendering of the request is a
  prompt of its own: cold too).
- `ttft_warm_s` {p50, p90}: later commands (the prompt's prefix cached), to the first byte;
  `answer_warm_s` {p50, p90}: to the complete answer or call.
- `ttft_after_restart_s`: the first command after the server restarts (what the prefix cache
  kept across it: without a disk tier, nothing).
- `steps_interrupted`: the server's steps that stopped between layers for a command that
  arrived while they ran (a document's prefill chunk, planned again after the command).
- `llama_cpp_*`: the same from llama.cpp's `llama-server` (`-np 4 --cache-reuse 256`).
- `tool_call_stream`: on the embedded model (which calls tools), whether a streamed call's
  name came out before the answer ended and its arguments in pieces (OpenAI's stream shape).

    python bench/assist_bench.py [--json] [--model FILE.gguf | --model 1b] [--llama-server PATH]
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
from bench.spec_bench import document

AREAS = ["Kitchen", "Living Room", "Bedroom", "Bathroom", "Hallway", "Garage", "Garden", "Office", "Kids Room",
         "Basement"]
KINDS = [("light", "Light", ["on", "off"]), ("switch", "Plug", ["on", "off"]), ("cover", "Blinds", ["open", "closed"]),
         ("sensor", "Temperature", ["21.5 °C", "19.0 °C"]), ("climate", "Thermostat", ["heat", "off"]),
         ("media_player", "Speaker", ["idle", "playing"])]
INTENTS = {"HassTurnOn": "Turns on/opens a device or entity", "HassTurnOff": "Turns off/closes a device or entity",
           "HassLightSet": "Sets the brightness or color of a light", "HassClimateSetTemperature": "Sets a thermostat",
           "HassMediaPause": "Pauses a media player", "HassMediaUnpause": "Resumes a media player",
           "GetLiveContext": "Gives the live state of the exposed entities"}
COMMANDS = ["Turn off the kitchen lights.", "Open the blinds in the bedroom.", "Set the office thermostat to 21 "
            "degrees.", "Pause the speaker in the living room.", "Is the garage plug on?", "Turn on the garden "
            "light.", "Dim the hallway light to 30 percent.", "Close the blinds in the kids room.",
            "What is the temperature in the bathroom?", "Turn off everything in the basement."]


def entities(n: int = 60) -> str:
    lines = []
    for i in range(n):
        domain, label, states = KINDS[i % len(KINDS)]
        area = AREAS[(i // len(KINDS)) % len(AREAS)]
        lines.append(f"- names: {area} {label}\n  domain: {domain}\n  state: '{states[i % 2]}'\n  areas: {area}")
    return "\n".join(lines)


def tools() -> list[dict]:
    props = {"name": {"type": "string"}, "area": {"type": "string"}, "domain": {"type": "array", "items":
                                                                             {"type": "string"}}}
    out = []
    for name, desc in INTENTS.items():
        p = dict(props)
        if name == "HassLightSet":
            p["brightness"] = {"type": "integer", "minimum": 0, "maximum": 100}
        if name == "HassClimateSetTemperature":
            p["temperature"] = {"type": "number"}
        out.append({"type": "function", "function": {"name": name, "description": desc,
                                                     "parameters": {"type": "object", "properties": p}}})
    return out


def system_prompt() -> str:
    return ("You are a voice assistant for Home Assistant.\nAnswer questions about the world truthfully.\nAnswer in "
            "plain text. Keep it simple and to the point.\nWhen controlling Home Assistant always call the intent "
            "tools. Use HassTurnOn to lock and HassTurnOff to unlock a lock. When controlling a device, prefer "
            "passing just name and domain. When controlling an area, prefer passing just area name and domain.\n"
            "When a user asks to turn on all devices of a specific type, ask user to specify an area, unless "
            "there is only one device of that type.\nThis device is not able to start timers.\nYou are in area "
            "Living Room and all generic commands like 'turn on the lights' should target this area.\n"
            "Static Context: An overview of the areas and the devices in this smart home:\n" + entities())


def openai_body(command: str, max_tokens: int) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system_prompt()},
                                       {"role": "user", "content": command}],
            "tools": tools(), "tool_choice": "auto", "temperature": 0, "max_tokens": max_tokens, "stream": True}


def ollama_body(command: str, max_tokens: int, model: str = "m") -> dict:
    return {"model": model, "messages": [{"role": "system", "content": system_prompt()},
                                       {"role": "user", "content": command}],
            "tools": tools(), "stream": True, "options": {"temperature": 0, "num_predict": max_tokens}}


def timed(url: str, body: dict) -> dict:
    """One streamed command: seconds to the first byte of content or of a tool call, to the
    end; the prompt's token count; whether a call came and how it streamed."""
    t0 = time.perf_counter()
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    first = None
    prompt_tokens, call_first, call_pieces, chunks = None, None, 0, 0
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: "):
                line = line[6:]
            if not line.startswith(b"{"):
                continue
            obj = json.loads(line)
            chunks += 1
            if "choices" in obj:                 # OpenAI
                if obj.get("usage"):
                    prompt_tokens = obj["usage"]["prompt_tokens"]
                for ch in obj["choices"]:
                    d = ch.get("delta") or {}
                    calls = d.get("tool_calls") or []
                    if (d.get("content") or calls) and first is None:
                        first = time.perf_counter()
                    for tc in calls:
                        if tc.get("function", {}).get("name") and call_first is None:
                            call_first = chunks
                        if tc.get("function", {}).get("arguments"):
                            call_pieces += 1
            else:                                # Ollama
                m = obj.get("message") or {}
                if (m.get("content") or m.get("tool_calls")) and first is None:
                    first = time.perf_counter()
                if m.get("tool_calls") and call_first is None:
                    call_first = chunks
                if obj.get("done"):
                    prompt_tokens = obj.get("prompt_eval_count")
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "answer": end - t0, "prompt_tokens": prompt_tokens,
            "call_first_chunk": call_first, "call_pieces": call_pieces, "chunks": chunks}


def background(base: str, stop: threading.Event, llama: bool = False) -> threading.Thread:
    """A chat and a document summary, one after another, until `stop`."""
    def run():
        asks = [[{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
                [{"role": "user", "content": "Summarize this note:\n" + document(400)}]]
        k = 0
        while not stop.is_set():
            body = {"model": "m", "messages": asks[k % 2], "max_tokens": 64, "temperature": 0.7}
            if llama:
                body["cache_prompt"] = True
            try:
                urllib.request.urlopen(urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                                              {"Content-Type": "application/json"}), timeout=900).read()
            except OSError:
                return
            k += 1
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50": round(statistics.median(xs), 3), "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 3)}


def commands(base: str, reps: int, max_tokens: int, llama: bool = False) -> dict:
    """The cold command, then `reps` warm ones on each door (alternated), with the chat and the
    summary running beside them."""
    oa = base + "/v1/chat/completions"
    name = "m" if llama else json.loads(urllib.request.urlopen(base + "/api/tags", timeout=30).read())["models"][0]["name"]
    cold = timed(oa, {**openai_body(COMMANDS[0], max_tokens), "stream_options": {"include_usage": True}})
    # the Ollama door renders the same request as its own prompt: its first command is its cold one
    cold_ollama = None if llama else timed(base + "/api/chat", ollama_body(COMMANDS[0], max_tokens, name))
    stop = threading.Event()
    bg = [background(base, stop, llama), background(base, stop, llama)]
    ttft, answer, by_door = [], [], {"openai": [], "ollama": []}
    try:
        for i in range(reps):
            cmd = COMMANDS[1 + i % (len(COMMANDS) - 1)]
            for url, body in ((oa, openai_body(cmd, max_tokens)),
                              (base + "/api/chat", ollama_body(cmd, max_tokens, name)) if not llama else (None, None)):
                if url is None:
                    continue
                r = timed(url, body)
                by_door["ollama" if url.endswith("/api/chat") else "openai"].append(round(r["ttft"], 3))
                ttft.append(r["ttft"])
                answer.append(r["answer"])
    finally:
        stop.set()
        for t in bg:
            t.join(timeout=120)
    return {"ttft_cold_s": round(cold["ttft"], 3), "prompt_tokens": cold["prompt_tokens"],
            "served_prefill_tok_s": round(cold["prompt_tokens"] / cold["ttft"], 1) if cold["prompt_tokens"] else None,
            "ttft_warm_s": pct(ttft), "answer_warm_s": pct(answer),
            "ttft_cold_ollama_s": None if cold_ollama is None else round(cold_ollama["ttft"], 3),
            "ttft_warm_by_door_s": by_door}


def restart_ttft(flags: list[str], max_tokens: int) -> float:
    proc, base, _ = start_server(*flags)
    try:
        return round(timed(base + "/v1/chat/completions", openai_body(COMMANDS[3], max_tokens))["ttft"], 3)
    finally:
        proc.terminate()
        proc.wait(30)


def tool_stream_check(max_tokens: int = 96) -> dict:
    """The embedded model, which calls tools: a streamed call's first chunk and its pieces."""
    proc, base, _ = start_server()
    try:
        body = {**openai_body(COMMANDS[0], max_tokens), "tool_choice": "required"}
        r = timed(base + "/v1/chat/completions", body)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"call_name_at_chunk": r["call_first_chunk"], "chunks": r["chunks"],
            "argument_pieces": r["call_pieces"], "ttft_s": round(r["ttft"], 3), "answer_s": round(r["answer"], 3)}


FAMILY_PREFILL = """
import sys
from bench.family_bench import prefill_chunked, prefill_only
print(prefill_only(sys.argv[1]) if len(sys.argv) == 2 else prefill_chunked(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def family_prefill(model: str, tokens: int | None = None, chunk: int = 512) -> float:
    """family_bench's `prefill_tok_s` on `model`, in a process of its own (as that benchmark
    runs it: nothing else loaded beside it); with `tokens`, the rate of a prompt that long in
    `chunk`-token steps (`family_bench.prefill_chunked`)."""
    import subprocess
    import sys
    more = [] if tokens is None else [str(tokens), str(chunk)]
    out = subprocess.run([sys.executable, "-c", FAMILY_PREFILL, model, *more],
                         capture_output=True, text=True, check=True,
                         cwd=str(Path(__file__).resolve().parent.parent))
    return float(out.stdout.strip().splitlines()[-1])


def cold_pairs(model: str, flags: list[str], runs: int, max_tokens: int, chunk: int = 512) -> dict:
    """`runs` pairs, alternated: family_bench's 512-token prefill rate on the file, then a
    fresh server (its own empty store: nothing cached) and the first command's prompt tokens
    over its TTFT, then (the split of the gap) the in-process rate of a prompt as long as the
    command's, in the server's `chunk`-token steps. The machine's speed drifts; a pair's ratio
    does not."""
    import os
    import tempfile
    served, family, ratios, same = [], [], [], []
    before = os.environ.get("EDGEPAGED_STORE")
    for _ in range(runs):
        family.append(family_prefill(model))
        with tempfile.TemporaryDirectory(prefix="assist-bench-") as store:
            os.environ["EDGEPAGED_STORE"] = store
            proc, base, _ = start_server(*flags)
            try:
                r = timed(base + "/v1/chat/completions", {**openai_body(COMMANDS[0], max_tokens),
                                                         "stream_options": {"include_usage": True}})
            finally:
                proc.terminate()
                proc.wait(30)
                if before is None:       # the caller's store again (this one is gone)
                    os.environ.pop("EDGEPAGED_STORE", None)
                else:
                    os.environ["EDGEPAGED_STORE"] = before
        served.append(r["prompt_tokens"] / r["ttft"])
        ratios.append(served[-1] / family[-1])
        same.append(family_prefill(model, r["prompt_tokens"], chunk))
    return {"family_prefill_tok_s": round(max(family), 1),
            "served_prefill_ratio": round(statistics.median(ratios), 3),
            # the gap's two parts: the long prompt itself (its attention over ~2 k positions,
            # which a 512-token prompt does not pay) and serving it
            "same_length_vs_family": round(statistics.median(m / f for m, f in zip(same, family)), 3),
            "served_vs_same_length": round(statistics.median(s / m for s, m in zip(served, same)), 3),
            "cold_pairs": [{"served_prefill_tok_s": round(s, 1), "family_prefill_tok_s": round(f, 1),
                            "same_length_prefill_tok_s": round(m, 1)}
                           for s, f, m in zip(served, family, same)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="1b", help="a GGUF file, or 1b (family_bench's Llama-3.2-1B-shaped Q4_K_M)")
    ap.add_argument("--reps", type=int, default=6, help="warm commands per door")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="the server's step budget (0: its default, 512, what a household runs; measured better "
                         "than 2048 on every figure, bench/RESULTS.md)")
    ap.add_argument("--step-time", type=float, default=None,
                    help="the server's --step-time (default: its own)")
    ap.add_argument("--cold-runs", type=int, default=3,
                    help="pairs of (family_bench's prefill rate, a fresh server's first command) for "
                         "served_prefill_ratio (0: skip)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "edgepaged" / "bench")
    args = ap.parse_args()
    model = str(synthetic("q4_k_m", args.cache_dir)) if args.model == "1b" else args.model
    from edgepaged.model import weights_cache
    weights_cache.prepare(model)      # a large file's layout cached first: no writer beside the measurement
    # a store of its own: the disk tier's blocks of an earlier run would make the cold command warm;
    # the weights cache stays where prepare() wrote it (in the new store the server would miss it and
    # write the layout again in the background, beside the cold command)
    import os
    import tempfile
    if weights_cache.cache_dir() is not None:
        os.environ["EDGEPAGED_WEIGHTS_CACHE"] = str(weights_cache.cache_dir())
    store = tempfile.TemporaryDirectory(prefix="assist-bench-")
    os.environ["EDGEPAGED_STORE"] = store.name
    flags = ["--model", model] + (["--max-batched-tokens", str(args.max_batched_tokens)] if args.max_batched_tokens else []) \
        + (["--step-time", str(args.step_time)] if args.step_time is not None else [])
    proc, base, _ = start_server(*flags)
    try:
        out = {"cpu": cpu_flags(), "model": Path(model).name, **commands(base, args.reps, args.max_tokens)}
        # the document's prefill steps stopped for a command (Engine._maybe_interrupt)
        out["steps_interrupted"] = json.loads(urllib.request.urlopen(base + "/stats", timeout=30).read()).get(
            "steps_interrupted")
    finally:
        proc.terminate()
        proc.wait(30)
    out["ttft_after_restart_s"] = restart_ttft(flags, args.max_tokens)
    if args.cold_runs > 0:
        out.update(cold_pairs(model, flags, args.cold_runs, args.max_tokens, args.max_batched_tokens or 512))
    out["tool_call_stream"] = tool_stream_check()
    exe = args.llama_server or shutil.which("llama-server")
    if exe is None:
        out["llama_cpp"] = None
        out["llama_cpp_note"] = "llama.cpp's llama-server is not installed here (give --llama-server PATH)"
    else:
        lflags = ["-t", "2", "-c", "16384", "-np", "4", "--cache-reuse", "256", "--jinja"]
        lproc, lbase = start_llama_server(exe, model, *lflags, wait_s=240)
        if lproc is None:
            out["llama_cpp"], out["llama_cpp_note"] = None, "llama-server did not start"
        else:
            try:
                out["llama_cpp"] = commands(lbase, args.reps, args.max_tokens, llama=True)
            finally:
                lproc.terminate()
                lproc.wait(30)
            lproc, lbase = start_llama_server(exe, model, *lflags, wait_s=240)
            try:
                out["llama_cpp"]["ttft_after_restart_s"] = round(timed(lbase + "/v1/chat/completions", openai_body(
                    COMMANDS[3], args.max_tokens))["ttft"], 3) if lproc else None
            finally:
                if lproc:
                    lproc.terminate()
                    lproc.wait(30)
    lc = out.get("llama_cpp") or {}
    if lc.get("answer_warm_s"):
        out["answer_warm_p90_ratio"] = round(out["answer_warm_s"]["p90"] / lc["answer_warm_s"]["p90"], 2)
    print(f"cold {out['ttft_cold_s']} s ({out['prompt_tokens']} prompt tokens, {out['served_prefill_tok_s']} tok/s); "
          f"warm first byte {out['ttft_warm_s']}, answer {out['answer_warm_s']}; after restart "
          f"{out['ttft_after_restart_s']} s; served/family_bench prefill {out.get('served_prefill_ratio')}; llama.cpp {lc or out.get('llama_cpp_note')}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
