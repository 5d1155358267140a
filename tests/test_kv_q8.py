"""The q8_0 KV cache (`--kv-dtype q8_0`): head rows turned by a Walsh-Hadamard rotation,
then blocks of 32 values with one half-precision scale, read where they lie by the decode
kernel, the prefill tiles and the one-call decoder. Each kernel against the f32 cache of the
values the blocks stand for (exact up to float sums), the written blocks against a numpy
quantizer, and whole models (windowed and soft-capped layers, q/k norms, the one-call decoder)
against their f32-cache logits within a stated bound."""
from __future__ import annotations

import re

import numpy as np
import pytest

from edgepaged._native import ops
from edgepaged.model.cpu.runner import CpuRunner, kv_row_units
from edgepaged.model.settings import CpuConfig
from edgepaged.testing.decode import make_allocator, run_batch
from edgepaged.testing.families import make_family_model, write_family_gguf

from test_model import Paged

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]

# Logits of a whole tiny model (random weights) with a q8_0 cache against the same model with
# an f32 cache: at most this fraction of the largest logit apart. Measured: 0.011 (llama),
# 0.010 (qwen3), 0.040 (gemma2, 4 layers); an f16 cache: 0.0004-0.0016.
LOGIT_BOUND = 0.06


def hadamard(d: int) -> np.ndarray:
    """The cache's rotation of head rows of d values: the orthonormal Walsh-Hadamard matrix
    of each chunk of 64 values (32 when d is not a multiple of 64), Sylvester's order."""
    n = 64 if d % 64 == 0 else 32
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(d // n), h / np.sqrt(n)).astype(np.float32)


def q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's q8_0 of rows [..., d]: (int8 head rows [..., d + d / 16] as the cache holds
    them: the turned rows' blocks, the f32 values they stand for, turned back)."""
    d = x.shape[-1]
    rot = hadamard(d)
    blocks = (x.astype(np.float32) @ rot).reshape(*x.shape[:-1], d // 32, 32)
    scale = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float16)
    s32 = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32[..., None] > 0, np.rint(blocks / s32[..., None]), 0)
    q = np.clip(q, -127, 127).astype(np.int8)
    rows = np.concatenate([q.reshape(*x.shape[:-1], d), scale.view(np.int8).reshape(*x.shape[:-1], d // 16)], -1)
    return rows, (q.astype(np.float32) * s32[..., None]).reshape(x.shape) @ rot


def dequant(rows: np.ndarray, d: int) -> np.ndarray:
    """The values a q8_0 cache's head rows stand for."""
    q = rows[..., :d].astype(np.float32)
    scale = np.ascontiguousarray(rows[..., d:]).view(np.float16).astype(np.float32)
    return (q * np.repeat(scale, 32, -1)) @ hadamard(d)


def test_q8_cache_holds_188_times_the_tokens_of_f16():
    f16 = CpuRunner(kv_memory_bytes=64 << 20, progress=lambda *a, **k: None)
    q8 = CpuRunner(kv_memory_bytes=64 << 20, kv_dtype="q8_0", progress=lambda *a, **k: None)
    d = q8.config.head_dim
    assert q8.kv_dtype_name == "q8_0" and q8.kv_cache.dtype == np.int8
    assert q8.kv_cache.shape[-1] == kv_row_units("q8_0", d) == d + d // 16
    assert q8.block_bytes * 32 == f16.block_bytes * 17
    assert q8.num_blocks >= 1.87 * f16.num_blocks    # 32 / 17 = 1.88, less a block of rounding


def test_models_whose_heads_do_not_split_into_blocks_and_the_torch_runner_refuse_it(tmp_path):
    hf = make_family_model(tmp_path / "llama", "llama")     # heads of 16 values
    path = write_family_gguf(tmp_path / "llama", tmp_path / "llama.gguf", hf)
    with pytest.raises(ValueError, match="multiple of 32"):
        CpuRunner(path, num_blocks=8, kv_dtype="q8_0")
    from edgepaged.model import ModelRunner
    with pytest.raises(ValueError, match="CPU runtime"):
        ModelRunner(path, num_blocks=8, kv_dtype="q8_0")


def test_written_blocks_are_numpy_s_quantization_and_every_kernel_reads_them_exactly():
    rng = np.random.default_rng(3)
    nh, nkv, d, bs, nb = 8, 2, 64, 4, 12
    width = (nh + 2 * nkv) * d
    cos = np.cos(rng.standard_normal((40, d))).astype(np.float32)
    sin = np.sin(rng.standard_normal((40, d))).astype(np.float32)
    qkv = (rng.standard_normal((5, width)) * 3).astype(np.float32)
    pos, slots = np.array([1, 4, 7, 30, 2]), np.array([5, 0, 13, 47, 20])
    q32, q8 = qkv.copy(), qkv.copy()
    k32, v32 = np.zeros((nb, bs, nkv, d), np.float32), np.zeros((nb, bs, nkv, d), np.float32)
    k8, v8 = np.zeros((nb, bs, nkv, d + d // 16), np.int8), np.zeros((nb, bs, nkv, d + d // 16), np.int8)
    ops.rope_write_kv(q32, pos, cos, sin, slots, k32, v32, nh, nkv)
    ops.rope_write_kv(q8, pos, cos, sin, slots, k8, v8, nh, nkv)
    assert np.array_equal(q32, q8)
    for c32, c8 in ((k32, k8), (v32, v8)):
        want, _ = q8_blocks(c32.reshape(-1, nkv, d)[slots])
        got = c8.reshape(-1, nkv, d + d // 16)[slots]
        # the rotation's float sums may round a value on a .5 the other way: off by one at most
        assert np.abs(got[..., :d].astype(int) - want[..., :d]).max() <= 1 and (got != want).mean() < 0.01
        assert np.array_equal(got[..., d:], want[..., d:]) or np.allclose(
            got[..., d:].copy().view(np.float16), want[..., d:].copy().view(np.float16), rtol=2e-3)
    # a filled cache: the kernels read the blocks as the f32 cache of their values reads
    full = (rng.standard_normal((nb, bs, nkv, d)) * 2).astype(np.float32)
    kq, kv = q8_blocks(full)
    vq, vv = q8_blocks(full[::-1].copy())
    assert np.allclose(dequant(kq, d), kv, atol=1e-5)
    tables = np.array([[2, 0, 1, 3, 9, 11], [5, 4, 3, 2, 8, 10]], np.int32)
    q = rng.standard_normal((40, nh * d)).astype(np.float32)
    for window, cap in ((0, 0.0), (6, 0.0), (0, 2.0), (6, 2.0)):
        rows, lens = np.array([0, 2], np.int64), np.array([21, 9], np.int32)
        got, want = np.zeros((3, nh * d), np.float32), np.zeros((3, nh * d), np.float32)
        ops.paged_decode(q, got, rows, lens, tables, kq, vq, nh, nkv, 0.2, window, cap)
        ops.paged_decode(q, want, rows, lens, tables, kv, vv, nh, nkv, 0.2, window, cap)
        assert np.abs(got - want).max() < 1e-5
        starts, lens = np.array([0, 17, 40], np.int64), np.array([22, 23], np.int32)   # 17 rows over 22, 23 over 23
        got, want = np.zeros((40, nh * d), np.float32), np.zeros((40, nh * d), np.float32)
        was = ops.bf16_attention(False)   # f32 products, as the f32 cache's (test_attention_precision: bf16)
        try:
            ops.paged_prefill(q, got, starts, lens, tables, kq, vq, nh, nkv, 0.2, window, cap)
        finally:
            ops.bf16_attention(was)
        ops.paged_prefill(q, want, starts, lens, tables, kv, vv, nh, nkv, 0.2, window, cap)
        assert np.abs(got - want).max() < 1e-5
    with pytest.raises(ValueError, match="caches must be"):    # a q8_0 K beside an f32 V
        ops.paged_decode(q, got, rows, lens[:2], tables, kq, vv, nh, nkv, 0.2)


def _logits(r, tokens, prefill):
    paged = Paged(r.num_blocks, r.block_size, seed=5)
    ids, pos, meta = paged.batch([(0, tokens[:prefill])])
    got = [np.asarray(r.execute(ids, pos, meta, list(range(prefill))))]
    for t in tokens[prefill:]:
        ids, pos, meta = paged.batch([(0, [t])])
        got.append(np.asarray(r.execute(ids, pos, meta)))
    return np.concatenate(got)


# (family, config overrides, GGUF weight type): heads of 32 values; gemma2 has soft-capped
# scores and sliding-window layers shorter than the prompt, qwen3 q/k norms, and llama's Q8_0
# weights run the one-call decoder
CASES = [("llama", {"head_dim": 32}, 8), ("gemma2", {"head_dim": 32, "query_pre_attn_scalar": 32}, 0),
         ("qwen3", {}, 0)]


@pytest.mark.parametrize("name,overrides,qtype", CASES, ids=[c[0] for c in CASES])
def test_models_with_a_q8_cache_answer_as_with_an_f32_one(name, overrides, qtype, tmp_path):
    """A 30-token prefill (in rows and in tiles) and 10 decode steps past the windows: the
    logits within LOGIT_BOUND of the f32 cache's, the same greedy choice at 95 % of the rows."""
    import torch
    hf = make_family_model(tmp_path / name, name, overrides=overrides)
    path = write_family_gguf(tmp_path / name, tmp_path / f"{name}.gguf", hf, qtype=qtype)
    tokens = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    for attention in ("rows", "tiles"):
        settings = CpuConfig(rust_attention_max=0 if attention == "tiles" else CpuConfig().rust_attention_max)
        ref = CpuRunner(path, num_blocks=32, kv_dtype="f32", settings=settings)
        q8 = CpuRunner(path, num_blocks=32, kv_dtype="q8_0", settings=settings)
        assert (q8.model.decoder is not None) == (qtype == 8)
        want, got = _logits(ref, tokens, 30), _logits(q8, tokens, 30)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert 0 < err <= LOGIT_BOUND, (attention, err)
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_the_embedded_model_answers_as_with_f16(embedded_runner):
    q8 = CpuRunner(num_blocks=64, kv_dtype="q8_0")
    ids = np.array(q8.tokenizer.apply_chat_template(FRANCE), np.int64)
    (toks,), _, _ = run_batch(q8, make_allocator(q8), [ids], 16)
    f16 = CpuRunner(num_blocks=64)
    (want,), _, _ = run_batch(f16, make_allocator(f16), [ids], 16)
    text = q8.tokenizer.decode(toks, skip_special_tokens=True)
    assert "Paris" in text and toks == want


async def test_an_engine_on_q8_caches_prefixes_in_ram_and_on_disk_apart_from_f16(tmp_path):
    """Prefix hits in RAM and from the disk tier after a restart with q8_0 blocks (bit for bit,
    the same answer), and f16's blocks on disk never served to a q8_0 cache."""
    from test_disk_cache import answer, cached_blocks, engine_for, prompt
    q8, f16 = CpuRunner(num_blocks=40, kv_dtype="q8_0"), CpuRunner(num_blocks=40)
    a = prompt(9)
    async with engine_for(f16, tmp_path) as e:
        await answer(e, a)
    async with engine_for(q8, tmp_path) as e:
        first, cached = await answer(e, a)
        assert cached == 0                                   # f16's blocks are not q8_0's
        again, cached = await answer(e, a)
        assert cached > 0 and again == first                 # the RAM cache
        blocks = cached_blocks(e, a)
    async with engine_for(q8, tmp_path) as e:                # restarted: from disk
        third, cached = await answer(e, a)
        assert cached > 0 and third == first
        assert cached_blocks(e, a)[: cached // 16] == blocks[: cached // 16]
        assert e.stats()["kv_blocks_used"] == 0 and e.stats()["kv_dtype"] == "q8_0"


def test_serve_kv_dtype_q8_0_holds_more_blocks_and_answers():
    import json
    import os
    import sys
    import urllib.request

    from test_cli import CLI, SERVE_ARGS, ServeProcess
    env = {**os.environ, "EDGEPAGED_VENV": sys.prefix}
    env.pop("EDGEPAGED_TOKEN", None)
    s = ServeProcess([*CLI, "serve", *SERVE_ARGS, "--kv-dtype", "q8_0"], env)
    try:
        base = s.wait_for(r"HTTP \(OpenAI API, chat page\) (http://127\.0\.0\.1:\d+)/", timeout=180).group(1)
        assert re.search(r"KV capacity \d+ tokens \(\d+ blocks of 16, q8_0\)", "".join(s.lines))
        body = {"messages": FRANCE, "max_tokens": 12, "temperature": 0}
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert "Paris" in json.loads(r.read())["choices"][0]["message"]["content"]
    finally:
        s.proc.terminate()
        s.proc.wait(30)


def test_auto_picks_q8_0_when_the_kv_memory_is_what_limits(tmp_path):
    from edgepaged.server.app import AUTO_Q8_BELOW_TOKENS, auto_kv_dtype
    per_token = 2 * 30 * 3 * 64 * 2                          # the embedded model's f16 bytes a token
    kind, why = auto_kv_dtype(None, 64 << 20)
    assert kind == "q8_0" and f"{(64 << 20) // per_token} tokens in f16" in why
    assert auto_kv_dtype(None, AUTO_Q8_BELOW_TOKENS * per_token)[0] is None
    hf = make_family_model(tmp_path / "llama", "llama")     # heads of 16 values: f16 whatever the memory
    path = write_family_gguf(tmp_path / "llama", tmp_path / "llama.gguf", hf)
    assert auto_kv_dtype(path, 1 << 20) == (None, "heads that do not split into blocks of 32")
