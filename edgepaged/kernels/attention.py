"""Paged attention through block tables: split-KV decode and packed variable-length prefill.

K/V caches are [num_blocks, block_size, Hkv, D]. Each program handles one KV head and the whole
group of G = H // Hkv query heads that share it, so K/V tiles are read once per group and fed to
`tl.dot`. A K/V tile holds BLOCK_N consecutive positions of one sequence; each position looks its
block id up in the block table, so tiles span several (scattered) blocks. Softmax is online, in
base 2 (scores are pre-multiplied by log2(e)), accumulated in fp32.
"""
import functools

import torch
import triton
import triton.language as tl

from . import interpreting

LOG2E = 1.4426950408889634
# Launch settings. A K/V tile is about TILE_BYTES per tensor (64 positions at D=128 in bf16);
# bench/kernel_bench.py --sweep overrides these to search for better ones on a GPU.
DECODE_CONFIG = dict(TILE_BYTES=16384, num_warps=4, num_stages=2)
# Prefill: SPLIT_DIAG runs the K/V tiles every query of a program sees without the causal mask,
# masking only the tiles on the diagonal (1.1-1.3x on an H200, with 3 stages: bench/RESULTS.md).
PREFILL_CONFIG = dict(TILE_BYTES=16384, BLOCK_M=64, num_warps=4, num_stages=3, SPLIT_DIAG=True)
MIN_SPLIT_TOKENS = 256  # a decode split reads at least this many positions
MAX_SPLITS = 64


@triton.jit
def _attend_tile(q, k_base, v_base, bt_row, n, load_ok, s_kb, s_kt, s_vb, s_vt,
                 qk_scale, softcap, d, BS: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr):
    """Gather K/V of positions n (through the block table row) and return (scores, V tile);
    with SOFTCAP the scaled scores become softcap * tanh(s / softcap) (gemma2)."""
    blk = tl.load(bt_row + n // BS, mask=load_ok, other=0).to(tl.int64)
    off = n % BS
    k = tl.load(k_base + (blk * s_kb + off * s_kt)[:, None] + d[None, :], mask=load_ok[:, None], other=0.0)
    v = tl.load(v_base + (blk * s_vb + off * s_vt)[:, None] + d[None, :], mask=load_ok[:, None], other=0.0)
    if UPCAST:  # the interpreter computes bf16 wrongly: do all math in fp32
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if SOFTCAP:   # on the natural-log scale: s / log2(e), capped, back to base 2
        x = s * (2.0 / (1.4426950408889634 * softcap))
        s = (1.0 - 2.0 / (tl.exp(x) + 1.0)) * (softcap * 1.4426950408889634)
    return s, v


@triton.jit
def _softmax_update(s, v, acc, m_i, l_i):
    """Fold one tile of (masked, -inf) scores s and values v into the online-softmax state."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts at -1e30, so m_new is finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr, lens_ptr, qk_scale, window, softcap,
    s_qb, s_qh, s_ob, s_oh, s_os, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # grid (B, Hkv, NUM_SPLITS): sequence b, KV head kvh, one slice of the context.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    first = 0  # first visible position
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    tile0 = first // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - tile0, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = tile0 + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, G_PAD)  # query heads of the group, padded to >= 16 rows for tl.dot
    d = tl.arange(0, D)
    h = kvh * G + g
    q = tl.load(q_ptr + b * s_qb + h[:, None] * s_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], -1e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    bt_row = bt_ptr + b * s_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        ok = (n >= first) & (n < hi)
        s, v = _attend_tile(q, k_base, v_base, bt_row, n, ok, s_kb, s_kt, s_vb, s_vt,
                            qk_scale, softcap, d, BS, UPCAST, SOFTCAP)
        s = tl.where(ok[None, :], s, float("-inf"))
        acc, m_i, l_i = _softmax_update(s, v, acc, m_i, l_i)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split: output 0, lse about -1e30
    o_off = b * s_ob + h[:, None] * s_oh + split * s_os + d[None, :]
    tl.store(o_ptr + o_off, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])
    if NUM_SPLITS > 1:
        lse_off = (b * tl.num_programs(1) * G + h) * NUM_SPLITS + split
        tl.store(lse_ptr + lse_off, m_i + tl.log2(l_i), mask=g < G)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, o_ptr, s_ob, s_oh, H,
                  NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr):
    # grid (B, H): weight each split's normalized output by 2^(lse - max lse).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    row = (b * H + h) * NUM_SPLITS + s
    lse = tl.load(lse_ptr + row, mask=s < NUM_SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + b * s_ob + h * s_oh + d, o.to(o_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, qsl_ptr, lens_ptr, see_ptr, qk_scale, window, softcap, num_seqs,
    s_qt, s_qh, s_ot, s_oh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, B_PAD: tl.constexpr, USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr, SPLIT_DIAG: tl.constexpr, HAS_SEE: tl.constexpr,
):
    # grid (T // BLOCK_Q + B, Hkv). Sequence b owns the query tiles numbered from
    # qsl[b] // BLOCK_Q + b, at least cdiv(q_len, BLOCK_Q) of them; a tile past its q_len idles.
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seqs = tl.arange(0, B_PAD)
    first_tile = tl.load(qsl_ptr + seqs, mask=seqs < num_seqs, other=0) // BLOCK_Q + seqs
    b = tl.sum(((first_tile <= pid) & (seqs < num_seqs)).to(tl.int32), 0) - 1
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q0 = (pid - q_start // BLOCK_Q - b) * BLOCK_Q
    seq_len = tl.load(lens_ptr + b)
    ctx0 = seq_len - q_len  # position of the first query (cached prefix length)

    # Rows: BLOCK_Q queries x G_PAD heads of the group (row = query * G_PAD + head).
    r = tl.arange(0, BLOCK_Q * G_PAD)
    qi = q0 + r // G_PAD
    g = r % G_PAD
    row_ok = (qi < q_len) & (g < G)
    tok = (q_start + qi).to(tl.int64)
    h = kvh * G + g
    pos = ctx0 + qi
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok[:, None] * s_qt + h[:, None] * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_Q * G_PAD], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D], tl.float32)

    hi = tl.where(q0 < q_len, ctx0 + tl.minimum(q0 + BLOCK_Q, q_len), 0)  # causal: up to the last query
    if HAS_SEE:  # rows that see past their causal limit (Gemma 3's image tokens: their whole image)
        sees = tl.load(see_ptr + tok, mask=row_ok, other=0)
        hi = tl.maximum(hi, tl.max(sees, 0))
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx0 + q0 - window + 1, 0) // BLOCK_N * BLOCK_N
    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    mid = lo
    if SPLIT_DIAG:
        if not USE_WINDOW:  # positions before the program's first query: visible to all its rows
            mid = tl.minimum((ctx0 + q0) // BLOCK_N * BLOCK_N, hi)
            for start in range(0, mid, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                s, v = _attend_tile(q, k_base, v_base, bt_row, n, n < mid, s_kb, s_kt, s_vb, s_vt,
                                    qk_scale, softcap, d, BS, UPCAST, SOFTCAP)
                acc, m_i, l_i = _softmax_update(s, v, acc, m_i, l_i)
    for start in range(mid, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        s, v = _attend_tile(q, k_base, v_base, bt_row, n, n < hi, s_kb, s_kt, s_vb, s_vt,
                            qk_scale, softcap, d, BS, UPCAST, SOFTCAP)
        visible = n[None, :] <= pos[:, None]
        if HAS_SEE:
            visible = visible | (n[None, :] < sees[:, None])
        if USE_WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _softmax_update(s, v, acc, m_i, l_i)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o_off = tok[:, None] * s_ot + h[:, None] * s_oh + d[None, :]
    tl.store(o_ptr + o_off, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------

@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(q, k_cache, v_cache, block_tables, seq_lens):
    D = q.shape[-1]
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4 and k_cache.shape[3] == D
    assert q.shape[1] % k_cache.shape[2] == 0, "query heads must be a multiple of KV heads"
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "last dim must be contiguous"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    return k_cache.shape[1], k_cache.shape[2], D


def _block_n(cfg, dtype, D):
    return max(16, triton.next_power_of_2(cfg["TILE_BYTES"] // (D * dtype.itemsize)))


def _auto_splits(programs: int, max_ctx: int, device: torch.device) -> int:
    """Enough split-KV programs to give every SM about 4 of them, each reading a fair share."""
    want = triton.cdiv(4 * _num_sms(device), programs)
    return max(1, min(want, max_ctx // MIN_SPLIT_TOKENS, MAX_SPLITS))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 num_splits: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence: q [B, H, D] at position seq_lens[b] - 1 attends to its whole context.

    block_tables int32 [B, M], seq_lens int32 [B] (>= 1). The context is cut into num_splits
    slices computed in parallel and merged by log-sum-exp; by default enough slices to fill the
    GPU when B * Hkv is small, judged from M * block_size (no device sync). Returns [B, H, D].
    """
    BS, Hkv, D = _check(q, k_cache, v_cache, block_tables, seq_lens)
    B, H, _ = q.shape
    G = H // Hkv
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if B == 0:
        return out
    cfg = DECODE_CONFIG
    block_n = _block_n(cfg, k_cache.dtype, D)
    if num_splits is None:
        max_ctx = block_tables.shape[1] * BS
        if sliding_window:
            max_ctx = min(max_ctx, sliding_window + block_n)
        num_splits = _auto_splits(B * Hkv, max_ctx, q.device)
    if num_splits > 1:
        part = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
        o, s_ob, s_oh, s_os = part, *part.stride()[:3]
    else:
        o, lse, s_ob, s_oh, s_os = out, out, out.stride(0), out.stride(1), 0
    _decode_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, o, lse, block_tables, seq_lens, scale * LOG2E, sliding_window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), s_ob, s_oh, s_os, *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BS=BS, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        USE_WINDOW=bool(sliding_window), UPCAST=interpreting(), SOFTCAP=bool(softcap),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _merge_kernel[(B, H)](part, lse, out, out.stride(0), out.stride(1), H,
                              NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), D=D)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  sliding_window: int | None = None, softcap: float | None = None,
                  see: torch.Tensor | None = None) -> torch.Tensor:
    """Packed causal attention: q [T, H, D] holds B chunks, chunk b = rows qsl[b]:qsl[b+1].

    Chunk b's queries are the last q_len positions of its context of seq_lens[b] tokens; their own
    K/V must already be in the cache (write_kv). They attend to the cached prefix and causally to
    themselves. Rows with q_len = 1 (decode) may be mixed in. `softcap`: gemma2's tanh capping
    of the scaled scores. `see` (int32 [T], at most the row's seq_len): positions a row sees at
    least, past its causal limit (Gemma 3's image tokens see their whole image; a window still
    counts back from the row). Returns [T, H, D].
    """
    BS, Hkv, D = _check(q, k_cache, v_cache, block_tables, seq_lens)
    T, H, _ = q.shape
    B = seq_lens.shape[0]
    assert query_start_loc.shape == (B + 1,) and query_start_loc.is_contiguous()
    G = H // Hkv
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    cfg = PREFILL_CONFIG
    g_pad = triton.next_power_of_2(G)
    block_q = max(cfg["BLOCK_M"], 16, g_pad) // g_pad  # queries per program: BLOCK_M rows of (query, head)
    _prefill_kernel[(T // block_q + B, Hkv)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        seq_lens if see is None else see.to(device=q.device, dtype=torch.int32).contiguous(), scale * LOG2E,
        sliding_window or 0, softcap or 1.0, B,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        G=G, G_PAD=g_pad, D=D, BS=BS, BLOCK_Q=block_q, BLOCK_N=_block_n(cfg, k_cache.dtype, D),
        B_PAD=triton.next_power_of_2(B), USE_WINDOW=bool(sliding_window), UPCAST=interpreting(), SOFTCAP=bool(softcap),
        SPLIT_DIAG=bool(cfg.get("SPLIT_DIAG")), HAS_SEE=see is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
