"""Images on the box (issue 68): a camera frame described, the second turn about it, a burst of
camera snapshots beside a voice command, against `edgepaged serve` (a subprocess, loopback).

Per shape (a synthetic SmolVLM-256M: the embedded SmolLM2-135M as its text model with
SmolVLM's image tokens, a random SigLIP-B/16-512 tower + connector as llama.cpp's mmproj, F16;
a synthetic Gemma 3 4B: its text model as Q4_K_M, 34 layers, 262,208 tokens, random blocks
(`testing/vision_models.synthetic_gemma3`), beside its SigLIP-so400m-896 tower and projector
as llama.cpp's mmproj, F16) with a 1280 x 720 JPEG:

- `encode_s`: the image decoded, cut into tiles and encoded (tower + connector), in process,
  with the math `serve` uses (`--quant-math auto`: f32 products, or the integer kernels on a
  CPU with VNNI); then `encode_exact_s` with f32 products and `int8_cos_min_vs_exact` (the
  smallest cosine between the two's feature rows) when they differ.
- `ttft_first_s`: a chat with the image and a question, streamed: its first token.
- `ttft_second_turn_s`: the conversation resent whole (image, answer, a new question), as
  Open WebUI and Home Assistant do: the image is found again (no encoder), its KV in the
  prefix cache.
- `images_per_min`: `--burst` different snapshots sent at once, each described (8 tokens).
- `home_ttft_alone_s` / `home_ttft_beside_burst_s`: a smart-home command's first token (a
  system prompt and "Turn off the kitchen lights."), alone and while a burst encodes (median of 3).
- `llama_cpp_encode_s` (llama-mtmd-cli's "mtmd batch encoding done" times, one per tile, summed),
  `llama_cpp_ttft_first_s` / `llama_cpp_ttft_second_turn_s` (llama-server, its prompt cache on)
  on the same files, when `--llama-bin DIR` holds them (or they are on the PATH); null with the
  reason otherwise.

    python bench/vision_bench.py [--json] [--burst 8] [--llama-bin DIR] [--work DIR] [--skip-gemma] [--skip-smolvlm]

The top-level fields repeat the first shape's (SmolVLM-256M's, unless skipped).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.family_bench import cpu_flags
from bench.soak import start_llama_server, start_server

QUESTION = "Describe what the camera sees."
HOME = [{"role": "system", "content": "You control the lights, the heating and the blinds of the house. Answer "
                                      "with the action taken, in a few words."},
        {"role": "user", "content": "Turn off the kitchen lights."}]


def frame(seed: int, w: int = 1280, h: int = 720) -> bytes:
    """A camera-like JPEG: smooth shapes and noise, different for each seed."""
    from PIL import Image, ImageDraw
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (h // 40 + 1, w // 40 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    d = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        d.rectangle([x, y, x + int(rng.integers(20, 300)), y + int(rng.integers(20, 200))],
                    fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    noise = rng.normal(0, 6, (h, w, 3))
    arr = np.clip(np.asarray(img, np.float32) + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "JPEG", quality=85)
    return out.getvalue()


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def image_turn(jpeg: bytes, history=()) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": data_url(jpeg)}}]}, *history]


def chat(base: str, messages: list[dict], max_tokens: int = 8, model: str | None = None) -> dict:
    """One streamed chat: its first token's time, the answer, the usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter() - t0
                    text += piece
    return {"ttft": first if first is not None else time.perf_counter() - t0, "text": text, "usage": usage,
            "e2e": time.perf_counter() - t0}


def two_turns(base: str, jpeg: bytes) -> tuple[dict, dict]:
    """The photo and a question, then the conversation resent with the answer and a new question."""
    first = chat(base, image_turn(jpeg))
    return first, chat(base, image_turn(jpeg, [{"role": "assistant", "content": first["text"]},
                                               {"role": "user", "content": "And what else?"}]))


def burst(base: str, seeds: list[int]) -> tuple[float, list, list]:
    """The snapshots sent at once, each in a thread: (when they were sent, the threads, their answers)."""
    out = [None] * len(seeds)

    def one(i):
        out[i] = chat(base, image_turn(frame(seeds[i])))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(seeds))]
    for t in threads:
        t.start()
    return t0, threads, out


def encode_times(model: Path, mmproj: Path, jpeg: bytes) -> dict:
    """In process: decode + tiles + the tower and connector, with the serve math and exact,
    under serve's malloc settings (`tame_malloc`: a buffer of a megabyte or more mapped fresh)."""
    from edgepaged.model.runtime import RunnerBase
    from edgepaged.server.app import tame_malloc
    tame_malloc()
    from edgepaged.model.settings import CpuConfig
    from edgepaged.model.vision import VisionEncoder
    from edgepaged.request.images import ImageLimits, decode
    probe = RunnerBase.__new__(RunnerBase)
    probe.settings = CpuConfig.from_env()
    math = probe._tower_math()                 # what serve's tower multiplies with
    res, feats = {"encode_math": math}, {}
    for name, m in (("encode_s", math), ("encode_exact_s", "exact")):
        enc = VisionEncoder(mmproj, m)
        t0 = time.perf_counter()
        pixels, layout = enc.pixels(decode(jpeg, ImageLimits()))
        feats[name] = enc.encode(pixels)
        res[name] = round(time.perf_counter() - t0, 3)
        res["tiles"], res["image_tokens"] = int(len(pixels)), int(len(feats[name]))
        if m == "exact" or math == "exact":
            break
    # the tower's work and the rate it ran at, as a fraction of this CPU's f32 matrix product
    # measured now (numpy's BLAS on 2048 x 2048 x 2048): what bounds an f32 tower here
    t = enc.tower
    n_patch = (enc.tile // t.patch) ** 2
    layer = 2 * n_patch * (4 * t.hidden * t.hidden + 2 * t.hidden * int(enc.hp["feed_forward_length"])) \
        + 4 * n_patch * n_patch * t.hidden
    flops = res["tiles"] * (t.layers * layer + 2 * n_patch * t.hidden * 3 * t.patch * t.patch)
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    a @ a
    t0 = time.perf_counter()
    for _ in range(3):
        a @ a
    peak = 3 * 2 * 2048 ** 3 / (time.perf_counter() - t0)
    res["tower_gflop"] = round(flops / 1e9, 1)
    res["f32_matmul_gflops"] = round(peak / 1e9, 1)
    res["encode_gflops"] = round(flops / res["encode_s"] / 1e9, 1)
    res["encode_frac_of_f32_matmul"] = round(flops / res["encode_s"] / peak, 3)
    if "encode_exact_s" in feats:
        a, b = feats["encode_s"], feats["encode_exact_s"]
        cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
        res["int8_cos_min_vs_exact"] = round(float(cos.min()), 5)
    else:
        res["encode_exact_s"] = res["encode_s"]
    return res


def find_llama(bin_dir: str | None, name: str) -> str | None:
    if bin_dir:
        p = Path(bin_dir) / name
        return str(p) if p.is_file() else None
    return shutil.which(name)


def llama_cpp(bin_dir, model: Path, mmproj: Path, jpeg: bytes, work: Path, encode_only: bool = False) -> dict:
    out = {"llama_cpp_encode_s": None, "llama_cpp_ttft_first_s": None, "llama_cpp_ttft_second_turn_s": None}
    cli, server = find_llama(bin_dir, "llama-mtmd-cli"), find_llama(bin_dir, "llama-server")
    if cli is None or server is None:
        out["llama_cpp_note"] = ("llama.cpp's llama-mtmd-cli / llama-server are not installed here (build them with "
                                 "../shared/tools/build-llama-cpp.sh DIR, then --llama-bin DIR/bin)")
        return out
    img = work / "frame.jpg"
    img.write_bytes(jpeg)
    threads = str(os.cpu_count() or 2)
    r = subprocess.run([cli, "-m", str(model), "--mmproj", str(mmproj), "--image", str(img), "-p", QUESTION,
                        "-n", "1", "-t", threads, "--temp", "0"], capture_output=True, text=True, timeout=3600)
    log = r.stdout + r.stderr
    slices = [float(x) for x in re.findall(r"(?:mtmd batch encoding done|image slice encoded) in (\d+) ms", log)]
    if slices:
        out["llama_cpp_encode_s"] = round(sum(slices) / 1000, 3)
        out["llama_cpp_tiles"] = len(slices)
    else:
        out["llama_cpp_note"] = f"llama-mtmd-cli printed no encode time (exit {r.returncode}): {log[-300:]!r}"
    if encode_only:
        return {k: v for k, v in out.items() if "ttft" not in k}
    proc, base = start_llama_server(server, str(model), "--mmproj", str(mmproj), "-c", "8192", "-t", threads,
                                    "--jinja")
    if proc is None:
        out["llama_cpp_note"] = "llama-server did not start"
        return out
    try:
        first, second = two_turns(base, jpeg)
        out["llama_cpp_ttft_first_s"] = round(first["ttft"], 3)
        out["llama_cpp_ttft_second_turn_s"] = round(second["ttft"], 3)
    finally:
        proc.terminate()
        proc.wait(30)
    return out


def measure(model: Path, mmproj: Path, n_burst: int, bin_dir) -> dict:
    jpeg = frame(0)
    res = encode_times(model, mmproj, jpeg)
    print(f"encode: {res['encode_s']} s ({res['encode_math']}), exact {res['encode_exact_s']} s, "
          f"{res['tiles']} tiles, {res['image_tokens']} image tokens")
    proc, base, _ = start_server("--model", str(model), "--mmproj", str(mmproj))
    try:
        first, second = two_turns(base, jpeg)
        res["ttft_first_s"] = round(first["ttft"], 3)
        res["ttft_second_turn_s"] = round(second["ttft"], 3)
        res["second_turn_cached_tokens"] = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        res["second_turn_prompt_tokens"] = second["usage"]["prompt_tokens"]
        print(f"TTFT first {res['ttft_first_s']} s, second turn {res['ttft_second_turn_s']} s "
              f"({res['second_turn_cached_tokens']} of {res['second_turn_prompt_tokens']} tokens cached)")
        alone = [chat(base, HOME)["ttft"] for _ in range(3)]
        res["home_ttft_alone_s"] = round(statistics.median(alone), 3)
        t0, threads, answers = burst(base, list(range(100, 100 + n_burst)))
        time.sleep(1.0)        # the first command a second in, while the encoder works
        beside = []
        while len(beside) < 3 and any(t.is_alive() for t in threads):
            beside.append(chat(base, HOME)["ttft"])
            time.sleep(0.5)
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        res["images_per_min"] = round(n_burst / wall * 60, 2)
        res["burst"] = n_burst
        res["home_ttft_beside_burst_s"] = round(statistics.median(beside), 3) if beside else None
        res["home_commands_beside_burst"] = len(beside)
        print(f"burst of {n_burst}: {res['images_per_min']} images/min; home TTFT alone {res['home_ttft_alone_s']} s, "
              f"beside the burst {res['home_ttft_beside_burst_s']} s")
    finally:
        proc.terminate()
        proc.wait(60)
    with tempfile.TemporaryDirectory() as tmp:
        res.update(llama_cpp(bin_dir, model, mmproj, jpeg, Path(tmp)))
    if res.get("llama_cpp_encode_s"):
        res["encode_vs_llama_cpp"] = round(res["encode_s"] / res["llama_cpp_encode_s"], 3)
    if res.get("ttft_first_s"):
        res["second_over_first"] = round(res["ttft_second_turn_s"] / res["ttft_first_s"], 3)
    if res.get("home_ttft_beside_burst_s"):
        res["home_beside_over_alone"] = round(res["home_ttft_beside_burst_s"] / res["home_ttft_alone_s"], 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--burst", type=int, default=8, help="camera snapshots sent at once")
    ap.add_argument("--llama-bin", default=None, help="the folder of llama.cpp's llama-mtmd-cli and llama-server")
    ap.add_argument("--skip-gemma", action="store_true", help="measure SmolVLM-256M only")
    ap.add_argument("--skip-smolvlm", action="store_true", help="measure Gemma 3 4B only")
    ap.add_argument("--work", default=None, help="where the synthetic files are written (kept: a second run "
                    "reuses them)")
    args = ap.parse_args()
    from edgepaged.testing.vision_models import synthetic_smolvlm
    work = Path(args.work or Path(tempfile.gettempdir()) / "edgepaged-vision-bench")
    out = {"cpu": cpu_flags(), "image": "1280x720 JPEG", "shapes": {}}
    if not args.skip_smolvlm:
        model, mmproj = synthetic_smolvlm(work, "smolvlm-256m")
        out["shapes"]["smolvlm-256m"] = measure(model, mmproj, args.burst, args.llama_bin)
    if not args.skip_gemma:
        from edgepaged.testing.vision_models import synthetic_gemma3
        model, mm = synthetic_gemma3(work, "gemma3-4b")
        out["shapes"]["gemma3-4b"] = measure(model, mm, args.burst, args.llama_bin)
    first = next(iter(out["shapes"].values()), {})
    out.update({k: v for k, v in first.items() if k != "note"})
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
