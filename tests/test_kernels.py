"""Triton paged-attention kernels against a plain torch reference.

Runs in Triton's CPU interpreter (see conftest.py), or compiled on a CUDA GPU with
EDGEPAGED_GPU_TESTS=1. The interpreter runs programs x loop iterations one at a time in Python:
keep heads, sequences and cases few.
"""
import os

import pytest
import torch

from edgepaged.kernels import paged_decode, paged_prefill, write_kv

if os.environ.get("EDGEPAGED_GPU_TESTS") == "1" and not torch.cuda.is_available():
    pytest.skip("EDGEPAGED_GPU_TESTS=1 but no CUDA GPU", allow_module_level=True)
DEVICE = "cuda" if os.environ.get("EDGEPAGED_GPU_TESTS") == "1" else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def case_id(v):
    return str(v).removeprefix("torch.")


def cdiv(a, b):
    return -(-a // b)


def make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, spare=3):
    """Random caches (garbage in every slot) and block tables of scattered blocks, padded with 0."""
    nblk = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(nblk) + spare
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(nblk) + 1, dtype=torch.int32)
    for b, n in enumerate(nblk):
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    return k_cache, v_cache, tables.to(DEVICE)


def filled_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype):
    """`make_cache` with each sequence's K/V written in its slots: (caches, tables, keys, values)."""
    k_cache, v_cache, tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        k, v = torch.randn(2, n, num_kv_heads, head_dim, device=DEVICE).to(dtype)
        s = slots(tables[b], torch.arange(n, device=DEVICE), block_size)
        k_cache.view(-1, num_kv_heads, head_dim)[s], v_cache.view(-1, num_kv_heads, head_dim)[s] = k, v
        keys.append(k), values.append(v)
    return k_cache, v_cache, tables, keys, values


def slots(table_row, positions, block_size):
    return table_row[positions // block_size].long() * block_size + positions % block_size


def reference(q, query_start_loc, keys, values, scale, window=None, see=None):
    """Causal attention per sequence on contiguous K/V [L, Hkv, D]; queries are the last positions
    (`see`: per row, positions it sees at least past its causal limit)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, (k, v) in enumerate(zip(keys, values)):
        a, e = int(query_start_loc[b]), int(query_start_loc[b + 1])
        L, group = k.shape[0], q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(group, 1)
        v = v.float().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:e].float(), k) * scale
        pos = torch.arange(L - (e - a), L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        visible = kpos <= pos
        if see is not None:
            visible |= kpos < see[a:e, None].to(q.device)
        if window:
            visible &= kpos > pos - window
        out[a:e] = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return out


def assert_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [f32, f16, bf16], ids=case_id)
def test_write_kv(dtype):
    torch.manual_seed(0)
    T, Hkv, D, bs = 37, 3, 64, 16
    k_cache, v_cache, _ = make_cache([40], bs, Hkv, D, dtype)
    slot_mapping = torch.randperm(k_cache.shape[0] * bs, device=DEVICE)[:T]
    slot_mapping[[3, 20, 36]] = -1  # padding rows
    # key/value as strided views of a fused QKV projection, as a model produces them
    qkv = torch.randn(T, 2 + 2 * Hkv, D, device=DEVICE).to(dtype)
    key, value = qkv[:, 2:2 + Hkv], qkv[:, 2 + Hkv:]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ok = slot_mapping >= 0
    want_k.view(-1, Hkv, D)[slot_mapping[ok]] = key[ok]
    want_v.view(-1, Hkv, D)[slot_mapping[ok]] = value[ok]
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


DECODE_CASES = [  # dtype, block_size, head_dim, kv heads, group (H / Hkv), sliding window, num_splits
    (f32, 16, 64, 2, 1, None, 1),
    (f16, 32, 128, 1, 8, None, None),
    (bf16, 16, 128, 1, 3, None, 3),
    (f16, 16, 64, 1, 3, 40, 2),
    (bf16, 32, 64, 1, 8, 20, 1),
    (f32, 32, 128, 1, 3, None, 4),
    (f16, 16, 64, 2, 4, None, 2),
]


@pytest.mark.parametrize("dtype,bs,D,Hkv,G,window,num_splits", DECODE_CASES, ids=case_id)
def test_paged_decode(dtype, bs, D, Hkv, G, window, num_splits):
    torch.manual_seed(1)
    seq_lens = [1, 16, 17, 33, 300]
    k_cache, v_cache, tables, keys, values = filled_cache(seq_lens, bs, Hkv, D, dtype)
    q = torch.randn(len(seq_lens), Hkv * G, D, device=DEVICE).to(dtype)
    scale = D ** -0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode(q, k_cache, v_cache, tables, lens, scale, sliding_window=window, num_splits=num_splits)
    qsl = torch.arange(len(seq_lens) + 1)
    assert_close(out, reference(q, qsl, keys, values, scale, window), dtype)


PREFILL_CASES = [  # dtype, block_size, head_dim, kv heads, group, sliding window
    (f32, 16, 64, 2, 1, None),
    (f16, 32, 128, 1, 3, None),
    (bf16, 16, 64, 1, 8, None),
    (f16, 16, 128, 1, 8, 48),
    (bf16, 32, 64, 2, 3, 17),
]


@pytest.mark.parametrize("dtype,bs,D,Hkv,G,window", PREFILL_CASES, ids=case_id)
def test_paged_prefill(dtype, bs, D, Hkv, G, window):
    """Prefill chunks with and without cached prefixes, mixed with decode rows (q_len = 1)."""
    torch.manual_seed(2)
    chunks = [(0, 50), (32, 17), (99, 1), (0, 1), (200, 64), (5, 1)]  # (cached prefix, q_len)
    seq_lens = [p + n for p, n in chunks]
    k_cache, v_cache, tables = make_cache(seq_lens, bs, Hkv, D, dtype)
    keys, values, new_k, new_v, slot_mapping = [], [], [], [], []
    for b, (prefix, n) in enumerate(chunks):
        k, v = torch.randn(2, prefix + n, Hkv, D, device=DEVICE).to(dtype)
        s = slots(tables[b], torch.arange(prefix + n, device=DEVICE), bs)
        k_cache.view(-1, Hkv, D)[s[:prefix]], v_cache.view(-1, Hkv, D)[s[:prefix]] = k[:prefix], v[:prefix]
        new_k.append(k[prefix:]), new_v.append(v[prefix:]), slot_mapping.append(s[prefix:])
        keys.append(k), values.append(v)
    pad = torch.randn(3, Hkv, D, device=DEVICE).to(dtype)  # padded batch rows: slot -1
    minus = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    write_kv(torch.cat(new_k + [pad]), torch.cat(new_v + [pad]), k_cache, v_cache, torch.cat(slot_mapping + [minus]))

    T = sum(n for _, n in chunks)
    q = torch.randn(T, Hkv * G, D, device=DEVICE).to(dtype)
    qsl = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = D ** -0.5
    out = paged_prefill(q, k_cache, v_cache, tables, qsl, lens, scale, sliding_window=window)
    assert_close(out, reference(q, qsl, keys, values, scale, window), dtype)


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
def test_paged_prefill_rows_that_see_past_their_causal_limit(window):
    """Gemma 3's image tokens see their whole image (`see`), in a chunk after a cached prefix
    and beside a plain chunk and a decode row; other rows stay causal; a window still counts
    back from the row."""
    torch.manual_seed(5)
    dtype, bs, Hkv, G, D = f32, 16, 1, 2, 64
    chunks = [(20, 40), (0, 9), (30, 1)]         # (cached prefix, q_len)
    seq_lens = [p + n for p, n in chunks]
    k_cache, v_cache, tables, keys, values = filled_cache(seq_lens, bs, Hkv, D, dtype)
    T = sum(n for _, n in chunks)
    q = torch.randn(T, Hkv * G, D, device=DEVICE).to(dtype)
    qsl = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    pos = torch.cat([torch.arange(p, p + n) for p, n in chunks])
    see = pos + 1
    see[5:25] = 45          # an image at positions 25..44 of the first sequence: rows 5..24 see it whole
    out = paged_prefill(q, k_cache, v_cache, tables, qsl, lens, D ** -0.5, sliding_window=window,
                        see=see.to(torch.int32).to(DEVICE))
    want = reference(q, qsl, keys, values, D ** -0.5, window, see=see)
    assert_close(out, want, dtype)
    assert (want - reference(q, qsl, keys, values, D ** -0.5, window)).abs().max() > 1e-2
    # the GPU backend passes the step's `see` (AttentionMetadata.see, Gemma 3's images) to the kernel
    import numpy as np

    from edgepaged.model.torch.attention import AttentionMetadata, TritonAttention
    meta = AttentionMetadata.build(qsl.cpu().numpy(), seq_lens, tables.cpu(), np.zeros(T, np.int64), DEVICE,
                                   see=see.numpy())
    backend = TritonAttention(Hkv * G, Hkv, D, bs, window)
    assert_close(backend.attend(q, k_cache, v_cache, meta), want, dtype)


def test_decode_splits_agree():
    """Split-KV (several partitions, some empty for short sequences) matches the unsplit result."""
    torch.manual_seed(3)
    seq_lens, bs, Hkv, D = [3, 130, 257], 16, 1, 64
    k_cache, v_cache, tables = make_cache(seq_lens, bs, Hkv, D, f32)
    q = torch.randn(len(seq_lens), 4 * Hkv, D, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    one = paged_decode(q, k_cache, v_cache, tables, lens, 0.125, num_splits=1)
    many = paged_decode(q, k_cache, v_cache, tables, lens, 0.125, num_splits=5)
    assert (one - many).abs().max().item() <= 1e-5


def test_auto_splits():
    from edgepaged.kernels.attention import _auto_splits
    dev = torch.device("cpu")  # counts as one SM: aims at 4 programs
    assert _auto_splits(programs=1, max_ctx=100, device=dev) == 1  # short context: no split
    assert _auto_splits(programs=1, max_ctx=4096, device=dev) == 4
    assert _auto_splits(programs=64, max_ctx=32768, device=dev) == 1  # enough programs already
