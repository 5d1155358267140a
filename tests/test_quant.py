"""Quantized weights kept quantized (rust_alloc/cpu_kernels/src/quant, edgepaged/model/quant/).

Ground truth: llama.cpp's own `gguf.quants.dequantize` followed by an fp32 matmul."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from edgepaged._native import quant as kernels
from edgepaged.model import ModelRunner
from edgepaged.model.settings import CpuConfig
from edgepaged.model.quant import BLOCK, FORMATS, QuantEmbedding, QuantLinear, QuantWeight, weight_bytes
from edgepaged.testing.gguf_models import random_blocks, write_random_gguf


def gguf_dequant(data: np.ndarray, qtype: int) -> np.ndarray:
    from gguf.quants import dequantize
    return dequantize(data, qtype)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


QTYPES = sorted(FORMATS)
IDS = [FORMATS[q] for q in QTYPES]


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_dequantize_is_gguf_bit_for_bit(qtype):
    rng = np.random.default_rng(qtype)
    bw = BLOCK[qtype][0]
    data = random_blocks(qtype, 9, 3 * bw, rng)
    want = gguf_dequant(data, qtype)
    for scalar in (False, True):
        out = np.full((9, 3 * bw), np.nan, np.float32)
        kernels.dequantize(data, qtype, out, scalar=scalar)
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
        part = np.empty((4, 3 * bw), np.float32)
        kernels.dequantize(data, qtype, part, 5, scalar=scalar)  # a row range
        assert np.array_equal(part, want[5:9])
        rows = np.array([8, 0, 8, 3], np.int64)
        kernels.gather_rows(data, qtype, rows, part, scalar=scalar)
        assert np.array_equal(part, want[rows])


@pytest.mark.parametrize("qtype", QTYPES, ids=IDS)
def test_matmul_matches_gguf_dequant_then_fp32_matmul(qtype):
    rng = np.random.default_rng(100 + qtype)
    bw = BLOCK[qtype][0]
    for rows, blocks, tokens in [(1, 1, 5), (7, 2, 3), (33, 3, 8), (130, 1, 13), (67, 5, 2), (16, 2, 40), (9, 2, 1)]:
        cols = blocks * bw
        data = random_blocks(qtype, rows, cols, rng)
        w = torch.from_numpy(gguf_dequant(data, qtype))
        x = torch.from_numpy(rng.standard_normal((tokens, cols), dtype=np.float32))
        ref = x @ w.T
        outs = []
        for scalar in (False, True):
            out = torch.full((tokens, rows), float("nan"))
            kernels.matmul(data, qtype, x.numpy(), out.numpy(), scalar=scalar)
            assert rel_err(out, ref) <= 1e-5, (rows, cols, tokens, scalar)
            outs.append(out)
        # the CPU's best path gives the portable path's bits (the same operations in the same order)
        assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), (rows, cols, tokens)


def test_column_bands_and_one_dimensional_inputs():
    rng = np.random.default_rng(7)
    data = random_blocks(3, 20, 64, rng)
    w = torch.from_numpy(gguf_dequant(data, 3))
    x = torch.randn(5, 64)
    out = torch.full((5, 50), float("nan"))
    kernels.matmul(data, 3, x.numpy(), out.numpy(), col=20, rows=20)  # columns 20..40 of a wider output
    assert rel_err(out[:, 20:40], x @ w.T) <= 1e-5
    assert out[:, :20].isnan().all() and out[:, 40:].isnan().all()
    v = torch.randn(64)
    o = torch.empty(20)
    kernels.matmul(data, 3, v.numpy(), o.numpy())
    assert rel_err(o, w @ v) <= 1e-5
    with pytest.raises(ValueError, match="contiguous"):
        kernels.matmul(data, 3, torch.randn(5, 100)[:, 10:74].numpy(), out[:, :20].contiguous().numpy())
    with pytest.raises(ValueError, match="do not fit"):
        kernels.matmul(data, 3, x.numpy(), out.numpy(), col=40, rows=20)


def test_bad_arguments_raise_value_error():
    data = random_blocks(2, 4, 64, np.random.default_rng(0))
    x, out = np.zeros((2, 64), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="not supported"):
        kernels.matmul(data, 0, x, out)           # F32 is not a block format
    with pytest.raises(ValueError):
        kernels.matmul(data, 2, np.zeros((2, 48), np.float32), out)   # 48 is not a multiple of 32
    with pytest.raises(ValueError, match="rows"):
        kernels.matmul(data, 2, x, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="rows"):
        kernels.matmul(data, 2, x, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="out of range"):
        kernels.gather_rows(data, 2, np.array([4]), np.zeros((1, 64), np.float32))
    with pytest.raises(TypeError):
        kernels.matmul(data, 2, x.astype(np.float64), out)
    with pytest.raises((ValueError, TypeError)):       # x and out sharing memory, out not contiguous
        kernels.matmul(data, 2, x, x[:, :4])


def test_quant_linear_mixed_segments_bias_and_dense_path():
    rng = np.random.default_rng(3)
    cols = 256
    segs = [QuantWeight(q, random_blocks(q, n, cols, rng), n, cols) for q, n in [(12, 32), (12, 16), (14, 24), (8, 8)]]
    dense = torch.cat([torch.from_numpy(gguf_dequant(s.data, s.qtype)) for s in segs])
    bias = torch.randn(80)
    lin = QuantLinear(segs, bias, dense_min_tokens=16)
    assert [s.qtype for s in lin.segments] == [12, 14, 8]  # neighbours of one format merged
    for t in (1, 5, 15, 16, 40):  # kernels below 16 rows, decode-to-scratch + GEMM from 16 on
        x = torch.randn(t, cols)
        assert rel_err(lin(x), x @ dense.T + bias) <= 1e-5, t
    x3 = torch.randn(2, 3, cols)
    assert lin(x3).shape == (2, 3, 80)
    emb = QuantEmbedding(segs[0])
    ids = torch.tensor([3, 0, 31])
    assert torch.equal(emb(ids), dense[ids])


def test_interleaved_weights_give_the_same_products_lookups_and_dense_path():
    """Q4_0/Q4_1/Q8_0 weights interleaved in groups of 8 rows (as the loader leaves them):
    products for 1, 2..15 and 16+ tokens (on the kernels at any count) and embedding lookups
    agree with the GGUF row order (its products decoding to scratch + GEMM from 24 tokens);
    a ragged row count is padded and never written past."""
    rng = np.random.default_rng(11)
    cols = 96
    for q, n in [(2, 13), (3, 40), (8, 21)]:
        w = QuantWeight(q, random_blocks(q, n, cols, rng), n, cols)
        dense = torch.from_numpy(gguf_dequant(w.data, q))
        rows_layout = QuantLinear([w], dense_min_tokens=24)
        wx = QuantWeight(q, w.data.copy(), n, cols)
        assert wx.interleave() and wx.x8 and wx.data.shape == (-(-n // 8), 8 * w.data.shape[1])
        assert wx.kind == q | kernels.info()["x8_flag"]
        lin = QuantLinear([wx], dense_min_tokens=24)
        for t in (1, 2, 7, 15, 16, 23, 24, 40):   # GEMV, tiles, broadcast path (rows: + decode + GEMM)
            x = torch.randn(t, cols)
            got = lin(x)
            assert got.shape == (t, n)
            assert rel_err(got, x @ dense.T) <= 1e-5, (q, t)
            assert rel_err(got, rows_layout(x)) <= 1e-6, (q, t)
        assert torch.equal(torch.from_numpy(wx.dequantize()), dense)
        ids = torch.tensor([n - 1, 0, 5, n - 1])
        assert torch.equal(QuantEmbedding(wx)(ids), dense[ids])
        out = np.full((2, n + 3), np.nan, np.float32)
        kernels.matmul(wx.data, wx.kind, np.ones((2, cols), np.float32), out, rows=n)
        assert np.isfinite(out[:, :n]).all() and np.isnan(out[:, n:]).all()
    k4 = QuantWeight(12, random_blocks(12, 8, 256, rng), 8, 256)
    assert not k4.interleave() and not k4.x8          # K-quants keep the row order
    with pytest.raises(ValueError, match="cannot be interleaved"):
        kernels.interleave(k4.data, 12, 8)
    with pytest.raises(ValueError, match="interleaved already"):
        kernels.interleave(wx.data, wx.kind, n)
    with pytest.raises(ValueError, match="rows"):         # 8 rows of bytes cannot be 30 output columns
        kernels.matmul(wx.data, wx.kind, np.ones((1, cols), np.float32), np.zeros((1, 30), np.float32))


REPACKABLE = [q for q in QTYPES if q in kernels.info()["repackable"]]


def int8_bound(w: np.ndarray, x: np.ndarray, span: int = 32) -> np.ndarray:
    """The most the integer product may differ from the exact one, per [token, row]: each
    activation rounds to its block's grid (step max|x| / 127 per `span`: 32, or 256 for
    K-quant weights as llama.cpp's q8_K), so by at most half a step; plus fp32 rounding
    (1e-5 of the sum of |w x|)."""
    step = np.abs(x.reshape(len(x), -1, span)).max(axis=2, keepdims=True) / 127
    half_step = np.broadcast_to(step / 2, (len(x), x.shape[1] // span, span)).reshape(x.shape)
    return (half_step.astype(np.float64) @ np.abs(w).T.astype(np.float64)) * (1 + 1e-6) + \
        1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))


def int8_activations(x: np.ndarray, span: int) -> np.ndarray:
    """x on the int8 grid the integer kernels put it on: per `span` values the scale
    d = max|x| / 127 and codes round(x · (1 / d)) (ties to even) within ±127, in fp32."""
    b = x.reshape(len(x), -1, span).astype(np.float32)
    d = np.abs(b).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inv), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("qtype", REPACKABLE, ids=[FORMATS[q] for q in REPACKABLE])
def test_repacked_weights_int8_products_within_their_bound_exact_lookups(qtype):
    """Weights repacked for the integer kernels (as the loader leaves K-quants and the 5-bit
    formats): products for 1..40 tokens within `int8_bound` of gguf's dequantize + fp32
    matmul and equal (to fp32 rounding) to the weights times the activations on their int8
    grid (per 32, per 256 for K-quants), the portable path equal to the bit, dequantize and lookups bit-for-bit gguf's;
    a ragged row count is padded and never written past."""
    rng = np.random.default_rng(qtype + 100)
    bw = BLOCK[qtype][0]
    n, cols = 37, 2 * max(bw, 64)
    w = QuantWeight(qtype, random_blocks(qtype, n, cols, rng), n, cols)
    dense = gguf_dequant(w.data, qtype)
    r = QuantWeight(qtype, w.data.copy(), n, cols)
    assert r.repack() and r.layout == "r16" and r.kind == qtype | kernels.info()["r16_flag"]
    assert r.nbytes <= 1.03 * w.nbytes + 16 * w.data.shape[1]     # the file's bytes (K-quants: 2-3% more)
    assert np.array_equal(r.dequantize().view(np.uint32), dense.view(np.uint32))
    ids = np.array([n - 1, 0, 17, n - 1])
    got = np.empty((4, cols), np.float32)
    kernels.gather_rows(r.data, r.kind, ids, got)
    assert np.array_equal(got, dense[ids])
    for t in (1, 3, 8, 13, 40):
        x = rng.standard_normal((t, cols)).astype(np.float32)
        out = np.full((t, n + 3), np.nan, np.float32)
        kernels.matmul(r.data, r.kind, x, out, rows=n)
        assert np.isnan(out[:, n:]).all()
        exact = x.astype(np.float64) @ dense.T.astype(np.float64)
        span = 256 if bw == 256 else 32
        assert (np.abs(out[:, :n] - exact) <= int8_bound(dense, x, span)).all(), t
        xq = int8_activations(x, span)     # the activations the kernels multiply, to 1e-5
        on_grid = xq @ dense.T.astype(np.float64)
        assert (np.abs(out[:, :n] - on_grid) <= 1e-5 * (np.abs(xq) @ np.abs(dense).T.astype(np.float64)) + 1e-30).all()
        portable = np.full_like(out, np.nan)
        kernels.matmul(r.data, r.kind, x, portable, rows=n, scalar=True)
        assert np.array_equal(out.view(np.uint32), portable.view(np.uint32)), t
        lin = QuantLinear([r, w], dense_min_tokens=24)     # from 24 tokens the exact segment decodes + GEMMs,
        y = lin(torch.from_numpy(x)).numpy()               # the repacked one stays on the integer kernels
        assert np.array_equal(y[:, :n], out[:, :n])
        assert rel_err(torch.from_numpy(y[:, n:]), torch.from_numpy(exact.astype(np.float32))) <= 1e-5
    with pytest.raises(ValueError, match="repacked already"):
        kernels.repack(r.data, r.kind, n)
    with pytest.raises(ValueError, match="needs .* bytes|multiple of the block"):
        kernels.matmul(r.data, r.kind, np.ones((1, cols - 32), np.float32), np.zeros((1, n), np.float32))
    f16 = QuantWeight(1, random_blocks(1, 4, 64, rng), 4, 64)
    assert not f16.repack() and f16.layout == "rows"          # F16 / BF16 stay as they are


# ---------------------------------------------------------------- the embedded model

@pytest.fixture(scope="module")
def fp32_runner():
    return ModelRunner(num_blocks=64, quantized=False, kv_dtype="f32")


@pytest.fixture(scope="module")
def quant_f32kv_runner():
    return ModelRunner(num_blocks=64, kv_dtype="f32")


def _logits(runner, ids):
    from test_model import Paged
    i, p, m = Paged(runner.num_blocks).batch([(0, ids)])
    return runner.execute(i, p, m, list(range(len(ids))))


def test_embedded_model_quantized_logits_match_fp32_and_answer_paris(quant_f32kv_runner, fp32_runner):
    from test_model import CHAT, generate
    q = quant_f32kv_runner
    assert q.quantized and not fp32_runner.quantized  # auto: GGUF on CPU in fp32 -> quantized
    wb = weight_bytes(q.model)
    assert wb["quantized"] <= q.model_path.stat().st_size and wb["dense"] < 1 << 20
    # the loader interleaved every Q4_1/Q8_0 weight (the tied embedding and LM head share one)
    lins = [m for m in q.model.modules() if isinstance(m, QuantLinear)]
    assert lins and all(s.x8 for m in lins for s in m.segments)
    assert q.model.embed_tokens.weight is q.model.lm_head.segments[0]
    ids = q.tokenizer.apply_chat_template(CHAT)
    got, ref = _logits(q, ids), _logits(fp32_runner, ids)
    assert (got - ref).abs().max().item() <= 1e-3
    answer = q.tokenizer.decode(generate(q, [ids], 12)[0], skip_special_tokens=True)
    assert "Paris" in answer


def test_quantized_option_resolution():
    from types import SimpleNamespace as NS

    from edgepaged.model.torch.runner import keeps_quantized
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    gguf = NS(reader=object(), has_quantized=True)
    assert keeps_quantized(gguf, cpu, torch.float32, None)
    assert not keeps_quantized(gguf, cpu, torch.float32, False)
    assert not keeps_quantized(gguf, cpu, torch.bfloat16, None)
    assert not keeps_quantized(gguf, cuda, torch.float32, None)
    with pytest.raises(ValueError, match="dtype"):
        keeps_quantized(gguf, cpu, torch.bfloat16, True)
    with pytest.raises(ValueError, match="not a GGUF"):
        keeps_quantized(NS(reader=None, has_quantized=False), cpu, torch.float32, True)
    with pytest.raises(ValueError, match="no tensor"):
        keeps_quantized(NS(reader=object(), has_quantized=False), cpu, torch.float32, True)


# ---------------------------------------------------------------- GGUF files written here

def test_kquant_model_quantized_matches_fp32(tmp_path):
    """K-quants (absent from the embedded model: 576 is not a multiple of 256) end to end,
    with a fused QKV mixing Q4_K and Q6_K and an untied Q8_0 LM head."""
    path = write_random_gguf(tmp_path / "kq.gguf", hidden=256, layers=2, heads=4, kv_heads=2, inter=512, tied=False,
                             qtypes=dict(token_embd=14, output=8, attn_q=12, attn_k=12, attn_v=14, attn_output=12,
                                         ffn_gate=12, ffn_up=14, ffn_down=12))
    q = ModelRunner(path, num_blocks=8, kv_dtype="f32", settings=CpuConfig(quant_math="exact"))
    f = ModelRunner(path, num_blocks=8, quantized=False, kv_dtype="f32")
    assert q.quantized and q.quant_math == "exact"
    qkv = q.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and [s.qtype for s in qkv.segments] == [12, 14]
    assert {s.layout for s in qkv.segments} == {"rows"}
    assert isinstance(q.model.embed_tokens, QuantEmbedding)
    ids = q.tokenizer.encode("hello paged world")
    got, ref = _logits(q, ids), _logits(f, ids)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0.1
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    # auto: a model this small stays exact; int8 asked for: repacked, within its error
    assert ModelRunner(path, num_blocks=8).quant_math == "exact"
    if kernels.info()["int8_isa"] == "scalar":
        return
    i8 = ModelRunner(path, num_blocks=8, kv_dtype="f32", settings=CpuConfig(quant_math="int8"))
    assert i8.quant_math == "int8" and i8.products.startswith("int8 (")
    qkv = i8.model.layers[0].self_attn.qkv_proj
    assert {s.layout for s in qkv.segments} == {"r16"}
    err = (_logits(i8, ids) - ref).abs()
    assert err.max().item() <= 0.05 * ref.abs().max().item()
    assert err.mean().item() <= 0.01 * ref.abs().max().item()


BILLION_PROBE = r"""
import json, sys
def rss(key="VmRSS:"):  # VmHWM: peak of this process (ru_maxrss would include the parent's at fork)
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch
from edgepaged.model import ModelRunner
from edgepaged.model.quant import weight_bytes
before = rss()
r = ModelRunner(sys.argv[1], num_blocks=16)
loaded = rss()
ids = r.tokenizer.encode("Hello")
from edgepaged.testing.decode import make_allocator, run_batch
toks = run_batch(r, make_allocator(r), [ids], 4)[0][0]
print(json.dumps({"before": before, "loaded": loaded, "after": rss(), "peak": rss("VmHWM:"),
                  "tokens": toks, "is_quantized": r.quantized, "params": r.config.num_params, **weight_bytes(r.model)}))
"""


def test_billion_parameter_q4_model_answers_within_memory_budget(tmp_path):
    """The README's budget: resident weights <= 1.3 x the GGUF file (here 1.03 B parameters
    in Q4_0, ~580 MB), measured in a fresh process; the fp32 path would need ~4 GB."""
    import json
    import subprocess
    import sys
    path = write_random_gguf(tmp_path / "1b.gguf", hidden=2048, layers=17, heads=16, kv_heads=4, inter=8192,
                             qtypes=dict(token_embd=2, attn_q=2, attn_k=2, attn_v=2, attn_output=2, ffn_gate=2,
                                         ffn_up=2, ffn_down=2))
    size = path.stat().st_size
    run = subprocess.run([sys.executable, "-c", BILLION_PROBE, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["is_quantized"] and m["params"] >= 1_000_000_000
    assert len(m["tokens"]) == 4 and all(0 <= t < 258 for t in m["tokens"])
    assert 0.9 * size <= m["quantized"] <= size
    assert m["after"] - m["before"] <= 1.3 * size, m
    assert m["peak"] - m["before"] <= 1.5 * size, m
    path.unlink()


def test_quant_math_setting_and_its_default_by_model_size():
    from edgepaged.model.settings import INT8_MIN_PARAMS
    assert CpuConfig.from_env({}).quant_math == "auto"
    assert CpuConfig.from_env({"EDGEPAGED_QUANT_MATH": " INT8 "}).quant_math == "int8"
    with pytest.raises(ValueError, match="EDGEPAGED_QUANT_MATH='fast'"):
        CpuConfig.from_env({"EDGEPAGED_QUANT_MATH": "fast"})
    auto = CpuConfig()
    assert auto.math(INT8_MIN_PARAMS - 1) == "exact"
    assert auto.math(INT8_MIN_PARAMS) == ("exact" if kernels.info()["int8_isa"] == "scalar" else "int8")
    assert CpuConfig(quant_math="exact").math(8_000_000_000) == "exact"
    assert CpuConfig(quant_math="int8").math(1) == "int8"


def test_one_table_of_the_runtime_knobs():
    """Every EDGEPAGED_ variable that changes how a model runs is read in one place
    (`CpuConfig.from_env`, or the Rust kernels for their own pool and ISA), is a row of that
    module's table (`ENV_KNOBS`), and in the README's; no other module reads one on its own."""
    import inspect
    import re
    from pathlib import Path

    import edgepaged
    from edgepaged.model import settings
    root = Path(edgepaged.__file__).parent
    table = {k.name for k in settings.ENV_KNOBS}
    read = set(re.findall(r'"(EDGEPAGED_[A-Z0-9_]+)"', inspect.getsource(settings.CpuConfig.from_env)))
    for f in (root.parent / "rust_alloc").rglob("*.rs"):
        read |= set(re.findall(r'env[_a-z:]*\("(EDGEPAGED_[A-Z0-9_]+)"', f.read_text()))
    assert read == table, (read ^ table)
    readme = (root.parent / "README.md").read_text()
    assert [v for v in sorted(table) if f"`{v}`" not in readme] == []
    for f in root.rglob("*.py"):
        if f.name != "settings.py":
            stray = set(re.findall(r'"(EDGEPAGED_[A-Z0-9_]+)"', f.read_text())) & table
            assert not stray, (f, stray)


def test_every_variable_read_is_in_the_readme_table():
    """Every EDGEPAGED_ variable the package or its Rust kernels read (the runtime's knobs and
    the rest: the store, the token, the registry, ...) has a row in the README's table of them,
    and the table names none that nothing reads."""
    import re
    from pathlib import Path

    import edgepaged
    root = Path(edgepaged.__file__).parent
    read = set()
    for f in root.rglob("*.py"):
        read |= set(re.findall(r'"(EDGEPAGED_[A-Z0-9_]+)"', f.read_text()))
    for f in (root.parent / "rust_alloc").rglob("*.rs"):
        read |= set(re.findall(r'"(EDGEPAGED_[A-Z0-9_]+)"', f.read_text()))
    readme = (root.parent / "README.md").read_text()
    start = readme.index("- **Knobs**")
    table = readme[start:readme.index("\n- **", start + 1)]
    rows = set(re.findall(r"`(EDGEPAGED_[A-Z0-9_]+)`", table))
    assert read - rows == set(), f"read but not in the README's table: {sorted(read - rows)}"
    assert rows - read == set(), f"in the README's table but read nowhere: {sorted(rows - read)}"


@pytest.mark.parametrize("qtype", [8, 12, 14])
def test_fused_parts_are_repacked_where_they_lie(qtype):
    """A fused Q/K/V (or gate/up) for the integer kernels: repacked straight from its parts
    (no stacked copy at load), byte for byte what repacking the stacked rows gives; a part
    before the last that is not whole groups of 16 rows falls back to stacking first."""
    from edgepaged.model.quant.formats import merge_segments
    rng = np.random.default_rng(qtype)
    cols = 512
    parts = [QuantWeight(qtype, random_blocks(qtype, r, cols, rng), r, cols) for r in (64, 32, 32)]
    stacked = QuantWeight(qtype, np.concatenate([p.data for p in parts]), 128, cols)
    assert stacked.repack()
    (merged,) = merge_segments(parts, repack=True)
    assert merged.layout == "r16" and merged.rows == 128 and np.array_equal(merged.data, stacked.data)
    (rows,) = merge_segments(parts)                       # exact math: stacked, in GGUF's rows
    assert rows.layout == "rows" and rows.rows == 128
    odd = [QuantWeight(qtype, random_blocks(qtype, r, cols, rng), r, cols) for r in (24, 8)]
    (fallback,) = merge_segments(odd, repack=True)
    assert fallback.layout == "rows" and fallback.rows == 32


def test_repacking_as_weights_arrive_changes_no_logit(monkeypatch):
    """The CPU runtime under int8 math repacks each linear as it arrives (fused ones from their
    parts); laying them out after the whole load instead gives the same logits, bit for bit
    (on any CPU: without SIMD the portable integer kernels run)."""
    from edgepaged.model.cpu import runner as cpu_runtime
    from edgepaged.model.quant import formats
    from edgepaged.testing.decode import make_allocator, prompt_logits

    def logits():
        r = cpu_runtime.CpuRunner(num_blocks=16, kv_dtype="f32", settings=CpuConfig(quant_math="int8"),
                                  progress=lambda *a, **k: None)
        return r, prompt_logits(r, make_allocator(r), list(range(40, 80)), every=True)
    now, got = logits()
    assert {s.layout for la in now.model.layers for s in la.qkv.segments} == {"r16"}
    monkeypatch.setattr(cpu_runtime, "merge_segments", lambda segments, repack=False: formats.merge_segments(segments))
    after, want = logits()
    assert {s.layout for la in after.model.layers for s in la.qkv.segments} == {"r16"}    # by lay_out, at the end
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_an_int8_load_reads_the_file_pages_and_keeps_no_view_of_them(tmp_path, monkeypatch):
    """Under int8 math the CPU runtime repacks each block weight straight from the file's
    pages (no private copy first: the 8 B load's np.fromfile share); what it keeps as it is
    (an F16 linear, an untied embedding's rows) is copied, so no model array views the file.
    The logits are the ones of a load through private copies, bit for bit."""
    from edgepaged.model.cpu import runner as cpu_runtime
    from edgepaged.model import loader
    from edgepaged.testing.decode import make_allocator, prompt_logits
    path = write_random_gguf(tmp_path / "mix.gguf", hidden=256, layers=2, heads=4, kv_heads=2, inter=512, tied=False,
                             qtypes=dict(token_embd=8, output=14, attn_q=12, attn_k=12, attn_v=14, attn_output=1,
                                         ffn_gate=12, ffn_up=14, ffn_down=2))
    maps = []
    real_memmap = loader.np.memmap

    def counted(*a, **k):
        maps.append(a[0])
        return real_memmap(*a, **k)

    def load():
        r = cpu_runtime.CpuRunner(path, num_blocks=16, kv_dtype="f32", settings=CpuConfig(quant_math="int8"),
                                  progress=lambda *a, **k: None)
        return r, prompt_logits(r, make_allocator(r), list(range(40, 80)), every=True)
    monkeypatch.setattr(loader.np, "memmap", counted)
    r, got = load()
    assert len(maps) == 2 * 7 + 2    # every block weight in place (Q and K too: their rows gathered from it)
    m = r.model
    kept = [m.embed_q] + [s for la in m.layers for lin in (la.qkv, la.o, la.gate_up, la.down) for s in lin.segments]
    kept += m.head.segments
    assert {s.layout for s in kept} == {"rows", "r16"} and m.layers[0].o.segments[0].qtype == 1
    for s in kept:                   # memory of its own: no view of a file mapping
        base = s.data
        while base is not None:
            assert not isinstance(base, (real_memmap, mmap.mmap)), s
            base = getattr(base, "base", None)
        assert s.data.flags.writeable and s.data.flags.c_contiguous
    real_weights = loader.ModelFiles.weights
    monkeypatch.setattr(loader.ModelFiles, "weights", lambda self, *a, borrow=False, **k: real_weights(self, *a, **k))
    maps.clear()
    _, want = load()                 # private copies (np.fromfile), as before: only Q and K's rows mapped
    assert len(maps) == 2 * 2
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_the_int8_peak_bounds_the_integer_kernels():
    """quant.int8_peak_gops (family_bench's `prefill_int8_frac` divides by it): a positive rate
    where the int8 path is AVX-512 VNNI (None elsewhere), and above what the Q8_0 kernel
    reaches on a product of 64 tokens by 2048 x 2048 weights (the probe measures the limit)."""
    import time
    peak = kernels.int8_peak_gops(2)
    if kernels.info()["int8_isa"] != "avx512-vnni":
        assert peak is None
        return
    rng = np.random.default_rng(5)
    n = cols = 2048
    w = QuantWeight(8, random_blocks(8, n, cols, rng), n, cols)
    assert w.repack()
    x = rng.standard_normal((64, cols)).astype(np.float32)
    out = np.empty((64, n), np.float32)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        kernels.matmul(w.data, w.kind, x, out, rows=n)
        best = max(best, 2 * 64 * n * cols / (time.perf_counter() - t) / 1e9)
    assert 0 < best < peak, (best, peak)


def test_the_read_probe_measures_the_memory_as_a_decode_streams_it():
    """quant.read_gbs (family_bench's `b1_roofline_frac` divides by the best probe): a finite
    rate, at least half of what numpy's plain sum of a buffer as large reads in this process
    (a probe that waits on itself reads slower; one that skips bytes or times nothing reads
    beyond any memory)."""
    import time
    bw = kernels.read_gbs(256, 2)
    assert 0 < bw < 5000, bw
    a = np.ones(256 << 18, np.float32)
    np.sum(a)
    numpy_gbs = 0.0
    for _ in range(3):
        t = time.perf_counter()
        np.sum(a)
        numpy_gbs = max(numpy_gbs, a.nbytes / (time.perf_counter() - t) / 1e9)
    assert bw >= 0.5 * numpy_gbs, (bw, numpy_gbs)


def test_the_decode_prefetch_changes_no_product():
    """quant.decode_prefetch (EDGEPAGED_DECODE_PREFETCH, default 8192 bytes): 1, 2, 9 and 40
    tokens against repacked Q4_K and Q6_K weights and an interleaved Q4_1 give the same bits
    at every distance, the last row group's reads ahead running past the matrix's end
    included."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "EDGEPAGED_DECODE_PREFETCH"}
    code = "from edgepaged._native import quant; print(quant.decode_prefetch())"
    # unset, unreadable, negative: the default; past 1 MiB: 1 MiB
    for value, want in ((None, "8192"), ("junk", "8192"), ("-5", "8192"), ("", "8192"), ("0", "0"),
                        ("99999999999999", str(1 << 20))):
        e = env if value is None else {**env, "EDGEPAGED_DECODE_PREFETCH": value}
        assert subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                              check=True).stdout.strip() == want, value
    rng = np.random.default_rng(9)
    was = kernels.decode_prefetch()
    try:
        assert kernels.decode_prefetch(1 << 40) == 1 << 20       # at most 1 MiB
        # repacked K-quants (the integer kernels) and an interleaved Q4_1 (the exact ones)
        for qtype, lay in ((12, "repack"), (14, "repack"), (3, "interleave")):
            n, cols = 67, 1024
            w = QuantWeight(qtype, random_blocks(qtype, n, cols, rng), n, cols)
            assert getattr(w, lay)()
            for t in (1, 2, 9, 40):
                x = rng.standard_normal((t, cols)).astype(np.float32)
                outs = []
                for d in (0, 64, 8192, 1 << 20):
                    assert kernels.decode_prefetch(d) == d
                    out = np.empty((t, n), np.float32)
                    kernels.matmul(w.data, w.kind, x, out, rows=n)
                    outs.append(out)
                assert all(np.array_equal(o, outs[0]) for o in outs)
    finally:
        kernels.decode_prefetch(was)


def test_the_exact_products_say_how_many_lanes_they_take():
    """On a CPU with AVX-512 F the interleaved exact products take 16 rows a vector and the
    banner's products say so; EDGEPAGED_NO_AVX512=1 keeps them at 8 (AVX2)."""
    import os
    import subprocess
    import sys
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    info = kernels.info()
    if info["isa"] == "scalar":
        assert info["exact_lanes"] == 1
        return
    assert info["exact_lanes"] == (16 if "avx512f" in flags and os.environ.get("EDGEPAGED_NO_AVX512", "0") in ("", "0") else 8)
    off = subprocess.run([sys.executable, "-c", "from edgepaged._native import quant; print(quant.info()['exact_lanes'])"],
                         env={**os.environ, "EDGEPAGED_NO_AVX512": "1"}, capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "8"


def test_the_few_token_tiles_give_the_same_bits_with_groups_at_once():
    """A few tokens against interleaved Q4_0/Q4_1/Q8_0 weights take tiles that run several
    groups of rows at once (more FMA chains in flight, `quant.tile_groups`, the default; up
    to 8 tokens on 16 lanes, 5 on 8), more tokens the broadcast path (12-token tiles on 16
    lanes): the same bits as one group at a time and as the same tokens inside a 40-token
    batch, right against f64, on 16 lanes and on 8 (EDGEPAGED_NO_AVX512=1, a process of its
    own), row counts that leave partial groups and pairs included."""
    import os
    import subprocess
    import sys
    code = r'''
import numpy as np
from edgepaged._native import quant as kernels
from edgepaged.model.quant import QuantWeight
from edgepaged.testing.gguf_models import random_blocks
from gguf.quants import dequantize
rng = np.random.default_rng(17)
assert kernels.tile_groups() is True
try:
    for qtype in (2, 3, 8):
        for n, cols in ((8, 64), (37, 96), (72, 576), (200, 256)):
            data = random_blocks(qtype, n, cols, rng)
            ref_w = dequantize(data, qtype).astype(np.float64).reshape(n, cols)
            w = QuantWeight(qtype, data.copy(), n, cols)
            assert w.interleave()
            x = rng.standard_normal((40, cols)).astype(np.float32)
            full = np.empty((40, n), np.float32)
            kernels.matmul(w.data, w.kind, x, full, rows=n)
            for t in (2, 3, 4, 5, 6, 8, 9, 13, 16):
                outs = []
                for many in (True, False):
                    assert kernels.tile_groups(many) is many
                    out = np.full((t, n), np.nan, np.float32)
                    kernels.matmul(w.data, w.kind, x[:t], out, rows=n)
                    outs.append(out)
                assert np.array_equal(outs[0], outs[1]), (qtype, n, t)
                assert np.array_equal(outs[0], full[:t]), (qtype, n, t)
                ref = x[:t].astype(np.float64) @ ref_w.T
                assert np.abs(outs[0] - ref).max() <= 1e-4 * np.abs(ref).max(), (qtype, n, t)
finally:
    kernels.tile_groups(True)
print("ok", kernels.info()["exact_lanes"])
'''
    lanes = set()
    for no512 in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "EDGEPAGED_NO_AVX512": no512},
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        lanes.add(r.stdout.split()[-1])
    assert "8" in lanes or "1" in lanes


def test_interleaved_weights_stay_on_the_kernels_at_any_token_count():
    """A long prefill's products with interleaved weights stay on the vectorised kernels (their
    broadcast path: faster than decoding to fp32 + GEMM, on 16 lanes and on 8), giving the
    kernels' own bits; row-layout K-quant weights, and interleaved ones where the kernels are
    the portable ones, decode to GEMM from `dense_min_tokens` rows."""
    from edgepaged.model.cpu.runner import Linear
    from edgepaged.model.quant.formats import kernel_layouts
    vector = kernels.info()["exact_lanes"] > 1
    assert kernel_layouts() == (("r16", "x8") if vector else ("r16",))
    rng = np.random.default_rng(23)
    n, cols, t = 40, 256, 30
    for qtype, lay in ((3, "x8"), (12, "rows")):
        w = QuantWeight(qtype, random_blocks(qtype, n, cols, rng), n, cols)
        if lay == "x8":
            assert w.interleave()
        x = rng.standard_normal((t, cols)).astype(np.float32)
        direct = np.empty((t, n), np.float32)
        kernels.matmul(w.data, w.kind, x, direct, rows=n)
        got = Linear([w], None, dense_min_tokens=24)(x)
        short = Linear([w], None, dense_min_tokens=10_000)(x)       # the kernels
        assert np.array_equal(short, direct)
        if lay == "x8" and vector:
            assert np.array_equal(got, direct), qtype          # stayed on the kernels
        else:
            dense = x @ np.asarray(w.dequantize(), np.float32).reshape(n, cols).T
            assert np.allclose(got, dense, rtol=1e-5, atol=1e-4), qtype
            assert not np.array_equal(got, direct), qtype      # decoded to GEMM: other sums
