"""The KV cache in f16 (the CPU default) and f32: twice the tokens in the same memory, the
Rust attention and the torch reference reading the same f16 values, the same answers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edgepaged._native import ops
from edgepaged.model import ModelRunner
from edgepaged.testing.decode import make_allocator, run_batch

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_f16_is_the_cpu_default_and_holds_twice_the_tokens(embedded_runner):
    assert embedded_runner.kv_dtype_name == "f16" and embedded_runner.kv_cache.dtype == np.float16
    f32 = ModelRunner(kv_memory_bytes=64 << 20, kv_dtype="f32")
    f16 = ModelRunner(kv_memory_bytes=64 << 20)
    assert f16.block_bytes * 2 == f32.block_bytes and f16.num_blocks == 2 * f32.num_blocks
    with pytest.raises(ValueError, match="KV cache dtype"):
        ModelRunner(num_blocks=4, kv_dtype="q4")


def test_f16_cache_answers_as_the_f32_one(embedded_runner):
    f32 = ModelRunner(num_blocks=64, kv_dtype="f32")
    ids = np.array(embedded_runner.tokenizer.apply_chat_template(FRANCE), np.int64)
    outs = {}
    for name, r in (("f16", embedded_runner), ("f32", f32)):
        (toks,), _, _ = run_batch(r, make_allocator(r), [ids], 12)
        outs[name] = r.tokenizer.decode(toks, skip_special_tokens=True)
    assert "Paris" in outs["f16"] and outs["f16"] == outs["f32"]


def test_rust_reads_and_writes_f16_as_torch_does():
    rng = np.random.default_rng(0)
    nh, nkv, d, bs, nb = 4, 2, 32, 4, 6
    width = (nh + 2 * nkv) * d
    qkv = rng.standard_normal((3, width)).astype(np.float32)
    cos = np.cos(rng.standard_normal((10, d))).astype(np.float32)
    sin = np.sin(rng.standard_normal((10, d))).astype(np.float32)
    pos, slots = np.array([1, 4, 7]), np.array([5, 0, 13])
    caches = {}
    for dt in (np.float32, np.float16):
        k, v = np.zeros((nb, bs, nkv, d), dt), np.zeros((nb, bs, nkv, d), dt)
        q = qkv.copy()
        ops.rope_write_kv(q, pos, cos, sin, slots, k, v, nh, nkv)
        caches[dt] = (q, k, v)
    q32, k32, v32 = caches[np.float32]
    q16, k16, v16 = caches[np.float16]
    assert np.array_equal(q32, q16)
    # written rounded to nearest even, as numpy (and torch) round
    assert np.array_equal(k16, k32.astype(np.float16)) and np.array_equal(v16, v32.astype(np.float16))
    tables = np.array([[2, 0, 1, 3], [5, 4, 3, 2]], np.int32)
    lens = np.array([14, 9], np.int32)
    rows = np.array([0, 2], np.int64)
    k_filled = rng.standard_normal((nb, bs, nkv, d)).astype(np.float16)
    v_filled = rng.standard_normal((nb, bs, nkv, d)).astype(np.float16)
    out16, out32 = np.zeros((3, nh * d), np.float32), np.zeros((3, nh * d), np.float32)
    ops.paged_decode(q16, out16, rows, lens, tables, k_filled, v_filled, nh, nkv, 0.2)
    ops.paged_decode(q32, out32, rows, lens, tables, k_filled.astype(np.float32), v_filled.astype(np.float32),
                     nh, nkv, 0.2)
    assert np.array_equal(out16, out32)   # the f16 values, read exactly
    with pytest.raises(ValueError, match="one dtype"):
        ops.paged_decode(q16, out16, rows, lens, tables, k_filled, v_filled.astype(np.float32), nh, nkv, 0.2)
