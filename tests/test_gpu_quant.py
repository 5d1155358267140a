"""GGUF weights kept quantized on the GPU (`edgepaged.kernels.quant`): the products and the
embedding rows from the blocks' codes against gguf's own `dequantize` and a float32 product,
every format the kernel reads; a linear of mixed formats (a Q4_K_M file's fused QKV); and the
torch runner with these kernels giving the logits of the CPU's Rust kernels on the same file.

Runs in Triton's CPU interpreter (conftest.py), or compiled on a CUDA GPU with
EDGEPAGED_GPU_TESTS=1 (bench/gpu_check.sh). Shapes stay tiny: the interpreter runs each
program's loop in Python.
"""
import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from edgepaged import kernels  # noqa: E402

if not kernels.is_available():
    pytest.skip("Triton has neither a GPU nor the interpreter here", allow_module_level=True)
if os.environ.get("EDGEPAGED_GPU_TESTS") == "1" and not torch.cuda.is_available():
    pytest.skip("EDGEPAGED_GPU_TESTS=1 but no CUDA GPU", allow_module_level=True)

import gguf  # noqa: E402

from edgepaged.kernels import quant as kq  # noqa: E402
from edgepaged.testing.gguf_models import random_blocks  # noqa: E402

DEVICE = "cuda" if os.environ.get("EDGEPAGED_GPU_TESTS") == "1" else "cpu"
NAMES = {2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def reference(qtype, blocks, rows, cols) -> np.ndarray:
    """gguf's own dequantization of the blocks: float32 [rows, cols]."""
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    return np.asarray(w, np.float32).reshape(rows, cols)


@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("qtype", kq.KEPT, ids=NAMES.get)
def test_products_from_the_codes_equal_gguf_dequantize_and_a_float32_product(qtype, m):
    rng = np.random.default_rng(100 * qtype + m)
    rows, cols = 40, 512              # 40 rows: the last program's outputs masked
    blocks = random_blocks(qtype, rows, cols, rng)
    w = reference(qtype, blocks, rows, cols)
    x = rng.standard_normal((m, cols)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    packed = kq.pack(qtype, blocks, rows, cols, device=DEVICE)
    assert packed.nbytes <= 1.03 * blocks.nbytes          # resident: the file's bytes, the scales unpacked
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    got = kq.qmatmul(torch.from_numpy(x).to(DEVICE, dtype), packed).float().cpu().numpy()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (m, rows)
    assert np.abs(got - want).max() <= tol * np.abs(want).max(), NAMES[qtype]
    # the embedding rows: decoded exactly as gguf decodes them
    ids = torch.tensor([3, 0, 39, 3, 17], device=DEVICE)
    rows_got = kq.qgather(ids, packed, torch.float32).cpu().numpy()
    assert np.array_equal(rows_got, w[ids.cpu().numpy()]), NAMES[qtype]


def test_a_strided_output_and_what_the_kernel_does_not_read():
    """Products written into a column slice of a wider output (a fused linear's segments);
    a format the kernel does not read, and blocks that do not match the shape, are refused."""
    rng = np.random.default_rng(7)
    a, b = random_blocks(12, 16, 256, rng), random_blocks(14, 24, 256, rng)
    x = torch.from_numpy(rng.standard_normal((2, 256)).astype(np.float32)).to(DEVICE)
    out = torch.full((2, 40), float("nan"), device=DEVICE)
    kq.qmatmul(x, kq.pack(12, a, 16, 256, device=DEVICE), out=out[:, :16])
    kq.qmatmul(x, kq.pack(14, b, 24, 256, device=DEVICE), out=out[:, 16:])
    w = np.concatenate([reference(12, a, 16, 256), reference(14, b, 24, 256)])
    want = x.cpu().numpy().astype(np.float64) @ w.T
    assert np.abs(out.cpu().numpy() - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="not one the GPU kernel reads"):
        kq.pack(3, random_blocks(3, 4, 64, rng), 4, 64)
    with pytest.raises(ValueError, match="bad block bytes"):
        kq.pack(8, a, 16, 256)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_torch_runner_on_these_kernels_gives_the_rust_kernels_logits(name, tmp_path):
    """A Q8_0 file (llama: the LM head tied to the embedding table, one packed copy for
    both; qwen2: attention biases) on the torch runner with the Triton kernels multiplying
    the blocks kept quantized, against the same file on the CPU's Rust kernels: the same
    logits on a prefill and decode steps, and every linear and the table kept as blocks."""
    if DEVICE != "cpu":
        pytest.skip("compares with the CPU's kernels in the same process (interpreter run)")
    from edgepaged.model.torch.gpu_quant import TritonQuantEmbedding, TritonQuantLinear
    from edgepaged.model.torch.quant_modules import weight_bytes
    from edgepaged.model.torch.runner import ModelRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / name, name)
    path = write_family_gguf(tmp_path / name, tmp_path / f"{name}.gguf", hf, qtype=8)
    rust = ModelRunner(path, num_blocks=8, kv_dtype="f32")
    tri = ModelRunner(path, num_blocks=8, kv_dtype="f32", quant_kernels="triton")
    assert rust.quantized and tri.quantized and tri.products == "GGUF blocks (triton)"
    m = tri.model
    assert isinstance(m.embed_tokens, TritonQuantEmbedding) and isinstance(m.lm_head, TritonQuantLinear)
    assert all(isinstance(x, TritonQuantLinear) for layer in m.layers
               for x in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    if hf.config.tie_word_embeddings:
        assert m.lm_head.segments[0] is m.embed_tokens.seg
    assert weight_bytes(m)["quantized"] == pytest.approx(weight_bytes(rust.model)["quantized"], rel=0.03)
    from test_families import _paged_logits
    tokens = list(range(3, 23))
    want, got = _paged_logits(rust, tokens, 16), _paged_logits(tri, tokens, 16)
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-4


# every format the CPU runtime serves, two mixes that together hold all ten (one format a tensor kind)
MIXES = {"mix_a": dict(token_embd=3, output=6, attn_q=7, attn_k=1, attn_v=30, attn_output=2, ffn_gate=8,
                       ffn_up=12, ffn_down=14),
         "mix_b": dict(token_embd=13, output=14, attn_q=12, attn_k=8, attn_v=2, attn_output=30, ffn_gate=7,
                       ffn_up=6, ffn_down=3)}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_every_format_the_cpu_serves_gives_its_logits_on_the_triton_runner(mix, tmp_path):
    """Item 1's "every other format the CPU runtime serves correctly": a llama file whose tensors
    are in all ten formats the CPU runtime reads (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
    Q5_K, Q6_K), on the torch runner with the Triton kernels: the formats the kernel reads stay
    blocks (packed, about the file's bytes), the others decoded once, and the logits of a prefill
    and decode steps are those of the CPU's Rust kernels on the same file."""
    if DEVICE != "cpu":
        pytest.skip("compares with the CPU's Rust kernels in the same process: runs in CI (Triton's CPU "
                    "interpreter), not in gpu_check.sh's compiled run on a GPU")
    from edgepaged.model.quant.formats import FORMATS
    from edgepaged.model.torch.gpu_quant import TritonQuantEmbedding, TritonQuantLinear
    from edgepaged.model.torch.runner import ModelRunner
    from edgepaged.testing.gguf_models import write_random_gguf
    from test_families import _paged_logits
    assert set(MIXES["mix_a"].values()) | set(MIXES["mix_b"].values()) == set(FORMATS)
    path = write_random_gguf(tmp_path / f"{mix}.gguf", hidden=256, layers=1, heads=4, kv_heads=2, inter=512,
                             qtypes=MIXES[mix], seed=3, tied=False, vocab=300)
    rust = ModelRunner(path, num_blocks=8, kv_dtype="f32")
    tri = ModelRunner(path, num_blocks=8, kv_dtype="f32", quant_kernels="triton")
    assert tri.products == "GGUF blocks (triton)"
    m = tri.model
    layer = m.layers[0]
    segments = {"token_embd": [m.embed_tokens.seg], "output": m.lm_head.segments,
                "ffn_down": layer.mlp.down_proj.segments, "attn_output": layer.self_attn.o_proj.segments}
    segments.update(zip(("attn_q", "attn_k", "attn_v"), ([s] for s in layer.self_attn.qkv_proj.segments)))
    segments.update(zip(("ffn_gate", "ffn_up"), ([s] for s in layer.mlp.gate_up_proj.segments)))
    assert isinstance(m.embed_tokens, TritonQuantEmbedding) and isinstance(m.lm_head, TritonQuantLinear)
    for kind, segs in segments.items():
        (seg,) = segs
        assert seg.qtype == MIXES[mix][kind], kind
        assert (seg.packed is not None) == (seg.qtype in kq.KEPT), (kind, FORMATS[seg.qtype])
    tokens = list(range(3, 15))
    want, got = _paged_logits(rust, tokens, 10), _paged_logits(tri, tokens, 10)
    assert got.shape == want.shape == (12, 300)
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
