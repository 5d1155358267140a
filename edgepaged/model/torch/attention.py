"""Paged attention: metadata for one flat batch and the two backends (torch, Triton).

A backend has `plan(meta)`, called once per forward, and
`forward(q, k, v, k_cache, v_cache, plan)`, called per layer: it writes this step's K/V
into their slots, then attends over each sequence's context through its block table.
q [T, H, D], k/v [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] -> out [T, H, D].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def _tensor(x, dtype, device) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    return torch.as_tensor(x, dtype=dtype).to(device, non_blocking=True)


@dataclass
class AttentionMetadata:
    """The contract of docs/INTERNALS.md, plus host copies of the lengths for planning."""
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor         # int32 [B]
    block_tables: torch.Tensor     # int32 [B, M]
    slot_mapping: torch.Tensor     # int64 [T]
    q_lens_host: list[int]
    seq_lens_host: list[int]
    # per row, how many positions it sees at least (past its causal limit: Gemma 3's image
    # tokens see their whole image, model/image_table.image_see); None: causal
    see: np.ndarray | None = None
    # M-RoPE's image rows (Qwen2.5-VL): (rows, their h and w [k, 2]), as torch tensors; None: none
    mrope: tuple | None = None

    @classmethod
    def build(cls, query_start_loc, seq_lens, block_tables, slot_mapping, device="cpu",
              see=None, mrope=None) -> "AttentionMetadata":
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        lens = np.asarray(seq_lens, dtype=np.int64)
        q_lens = np.diff(qsl)
        if len(q_lens) != len(lens) or (q_lens < 1).any() or (q_lens > lens).any():
            raise ValueError("attention metadata: need 1 <= q_len <= seq_len for every sequence")
        bt = block_tables if isinstance(block_tables, torch.Tensor) else np.asarray(block_tables, np.int32)
        return cls(_tensor(qsl, torch.int32, device), _tensor(lens, torch.int32, device),
                   _tensor(bt, torch.int32, device).reshape(len(lens), -1),
                   _tensor(slot_mapping, torch.int64, device), q_lens.tolist(), lens.tolist(),
                   None if see is None else np.asarray(see, np.int64),
                   None if mrope is None else tuple(_tensor(np.asarray(a, np.int64), torch.int64, device)
                                                    for a in mrope))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens_host)

    def last_token_indices(self) -> torch.Tensor:
        return (self.query_start_loc[1:] - 1).long()


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks as rows of a 2-D view: the fast contiguous-row path of index_select."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


@dataclass
class _DecodeGroup:      # sequences with one new token, attended in one SDPA call
    tokens: torch.Tensor | slice  # their rows in the flat batch
    blocks: torch.Tensor          # int64 [B * nb] block ids, nb = blocks of the longest context
    bias: torch.Tensor            # [B, 1, 1, L] 0 / -inf (length and window mask)
    num_seqs: int


@dataclass
class _TorchPlan:
    meta: AttentionMetadata
    decode: dict                  # window -> _DecodeGroup (absent: no decode rows)
    prefills: dict                # window -> [(token slice, block ids, context len, causal mask or None)]
    write: tuple | None = None    # (rows, slots) when some slots are -1 (skipped), else None


_SAME = object()   # "the backend's own window"


def explicit_attention(q, k, v, mask, causal: bool, scale: float, softcap: float | None,
                       rows: int = 256) -> torch.Tensor:
    """Attention with the scores in the open (SDPA cannot soft-cap them): q [.., H, L, D],
    k/v [.., Hkv, S, D]; `mask` boolean (True: attend) or additive float, broadcastable to
    [.., L, S]; `causal` the top-left causal mask. Scores: q·k·scale, then cap·tanh(s / cap),
    then the mask; `rows` queries at a time, so a long prompt's scores stay small."""
    if q.shape[-3] != k.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    kt, vf = k.float().transpose(-1, -2), v.float()
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal:
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril_()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for r0 in range(0, n_q, rows):
        r1 = min(r0 + rows, n_q)
        s = torch.matmul(q[..., r0:r1, :].float(), kt).mul_(scale)
        if softcap:
            s = torch.tanh(s.div_(softcap)).mul_(softcap)
        if mask is not None:
            m = mask[..., r0:r1, :] if mask.shape[-2] == n_q and n_q > 1 else mask
            s = s.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else s.add_(m)
        out[..., r0:r1, :] = torch.matmul(torch.softmax(s, -1), vf).to(q.dtype)
    return out


class TorchAttention:
    """Reference backend in plain torch, also the CPU path.

    Decode rows: one gather of whole blocks per cache for all of them, then one SDPA call
    with a length mask, the query heads of each KV head folded into the query length.
    Prefill chunks: per sequence SDPA with the causal mask offset by the cached context."""

    fuses_rope_write = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 sliding_window: int | None = None, dtype=torch.float32, *, scale: float | None = None,
                 softcap: float | None = None, windows: list | None = None):
        """`sliding_window`: the default window; `windows`: every window the layers use (a
        layer passes its own to `forward`); `scale`: of the scores (default head_dim ** -0.5);
        `softcap`: gemma2's tanh capping of the scores."""
        self.dtype = dtype
        self.h, self.hkv, self.d, self.block_size = num_heads, num_kv_heads, head_dim, block_size
        self.group, self.window = num_heads // num_kv_heads, sliding_window
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap or None
        self.windows = sorted({sliding_window, *(windows or [])}, key=lambda w: w or 0)

    def _sdpa(self, q, k, v, mask=None, causal=False, gqa=False) -> torch.Tensor:
        if self.softcap:
            return explicit_attention(q, k, v, mask, causal, self.scale, self.softcap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              enable_gqa=gqa)

    def plan(self, meta: AttentionMetadata) -> _TorchPlan:
        """Once per forward: the decode group, the prefill chunks and the KV write, for every
        window the layers use."""
        decode = {w: g for w in self.windows if (g := self._decode_group(meta, w)) is not None}
        seqs = [i for i, q in enumerate(meta.q_lens_host) if q > 1]
        prefills = {w: self.prefill_plan(meta, seqs, w) for w in self.windows}
        write = None
        if len(meta.slot_mapping) and int(meta.slot_mapping.min()) < 0:
            rows = (meta.slot_mapping >= 0).nonzero().squeeze(1)
            write = rows, meta.slot_mapping[rows]
        return _TorchPlan(meta, decode, prefills, write)

    def _decode_group(self, meta: AttentionMetadata, window) -> _DecodeGroup | None:
        bs, dev = self.block_size, meta.block_tables.device
        starts = np.cumsum([0] + meta.q_lens_host)
        dec = [i for i, q in enumerate(meta.q_lens_host) if q == 1]
        decode = None
        if dec:
            lens = [meta.seq_lens_host[i] for i in dec]
            nb = -(-max(lens) // bs)
            idx = torch.tensor(dec, device=dev)
            first = int(starts[dec[0]])   # decode rows in the flat batch: consecutive ones as a slice
            rows = starts[dec]
            consecutive = bool((rows == np.arange(first, first + len(dec))).all())
            tokens = slice(first, first + len(dec)) if consecutive else torch.tensor(rows, device=dev)
            blocks = meta.block_tables.index_select(0, idx)[:, :nb].reshape(-1).long()
            pos = torch.arange(nb * bs, device=dev)
            lens_t = torch.tensor(lens, device=dev)[:, None]
            visible = pos < lens_t
            if window:
                visible &= pos >= lens_t - window
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=dev).masked_fill_(~visible, float("-inf"))
            decode = _DecodeGroup(tokens, blocks, bias[:, None, None, :].to(self.dtype), len(dec))
        return decode

    def prefill_plan(self, meta: AttentionMetadata, seqs: list[int], window=_SAME) -> list:
        """The prefill chunks of sequences `seqs` (indices into the batch), as
        `attend_prefills` takes them: (token rows, block ids, context length, mask or None),
        for layers of `window` (default: the backend's)."""
        window = self.window if window is _SAME else window
        bs, dev = self.block_size, meta.block_tables.device
        starts = np.cumsum([0] + meta.q_lens_host)
        prefills = []
        for i in seqs:
            q, n = meta.q_lens_host[i], meta.seq_lens_host[i]
            blocks = meta.block_tables[i, : -(-n // bs)].long()
            mask = None
            see = None if meta.see is None else meta.see[int(starts[i]):int(starts[i]) + q]
            if q != n or window or (see is not None and (see > np.arange(n - q, n) + 1).any()):
                qpos = torch.arange(n - q, n, device=dev)[:, None]
                kpos = torch.arange(n, device=dev)[None, :]
                mask = kpos <= qpos
                if window:
                    mask &= kpos > qpos - window
                if see is not None:       # rows that see past their causal limit (an image both ways)
                    mask |= (kpos > qpos) & (kpos < torch.as_tensor(see, device=dev)[:, None])
            prefills.append((slice(int(starts[i]), int(starts[i]) + q), blocks, n, mask))
        return prefills

    def forward(self, q, k, v, k_cache, v_cache, plan: _TorchPlan, window=_SAME) -> torch.Tensor:
        """This layer's attention (its `window`; default the backend's)."""
        window = self.window if window is _SAME else window
        slots = plan.meta.slot_mapping
        if plan.write is not None:  # slot -1: don't write that token
            rows, slots = plan.write
            k, v = k[rows], v[rows]
        k_cache.view(-1, self.hkv, self.d).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, self.hkv, self.d).index_copy_(0, slots, v.to(v_cache.dtype))
        decode, prefills = plan.decode.get(window), plan.prefills[window]
        if not prefills:
            return self._decode(q, k_cache, v_cache, decode)
        out = torch.empty_like(q)
        self.attend_prefills(q, k_cache, v_cache, prefills, out)
        if decode is not None:
            out[decode.tokens] = self._decode(q[decode.tokens], k_cache, v_cache, decode)
        return out

    def attend_prefills(self, q, k_cache, v_cache, prefills, out) -> None:
        """Prefill chunks (K/V already in the cache): SDPA of q[rows] [q, H, D] over each
        sequence's gathered context, written to out[rows]."""
        for rows, blocks, n, mask in prefills:
            kc = _gather(k_cache, blocks).view(-1, self.hkv, self.d)[:n].transpose(0, 1).to(q.dtype)
            vc = _gather(v_cache, blocks).view(-1, self.hkv, self.d)[:n].transpose(0, 1).to(q.dtype)
            o = self._sdpa(q[rows].transpose(0, 1), kc, vc, mask, mask is None, gqa=True)
            out[rows] = o.transpose(0, 1)

    def _decode(self, q, k_cache, v_cache, g: _DecodeGroup) -> torch.Tensor:
        b, hkv, d = g.num_seqs, self.hkv, self.d
        # [B * nb, block_size * Hkv * D] -> [B, Hkv, L, D], a view
        kc = _gather(k_cache, g.blocks).view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
        vc = _gather(v_cache, g.blocks).view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
        # GQA folded into the query length: the G query heads of a KV head are G "positions"
        o = self._sdpa(q.reshape(b, hkv, self.group, d), kc, vc, g.bias)
        return o.view(b, self.h, d)


class TritonAttention:
    """GPU backend: edgepaged.kernels (imported lazily so CPU-only runs never load Triton)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 sliding_window: int | None = None, dtype=None, *, scale: float | None = None,
                 softcap: float | None = None, windows: list | None = None):
        from edgepaged.kernels import paged_decode, paged_prefill, write_kv
        self._write, self._decode, self._prefill = write_kv, paged_decode, paged_prefill
        self.window, self.softcap = sliding_window, softcap or None
        self.scale = head_dim ** -0.5 if scale is None else scale

    fuses_rope_write = True     # `rope_write`: rotary and the cache write in one kernel (kernels/rope.py)

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def rope_write(self, qkv, cos, sin, meta: AttentionMetadata, k_cache, v_cache, num_heads: int,
                   num_kv_heads: int) -> torch.Tensor:
        """The queries rotated; the keys rotated and the values written to their slots."""
        from edgepaged.kernels.rope import rope_write_kv
        return rope_write_kv(qkv, cos, sin, meta.slot_mapping, k_cache, v_cache, num_heads, num_kv_heads)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, window=_SAME) -> torch.Tensor:
        self._write(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, window)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, window=_SAME) -> torch.Tensor:
        """Attention over the caches, this step's K/V written already."""
        window = self.window if window is _SAME else window
        if meta.is_decode:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                sliding_window=window, softcap=self.softcap)
        see = None
        if meta.see is not None:        # (Gemma 3's images: their rows see the whole image)
            see = getattr(meta, "_see_dev", None)
            if see is None:
                see = meta._see_dev = torch.as_tensor(meta.see, dtype=torch.int32).to(q.device, non_blocking=True)
        return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                             self.scale, sliding_window=window, softcap=self.softcap, see=see)


def backend_for(device, cfg, block_size: int, dtype):
    """The attention backend for model `cfg` on `device`: its layers' windows and score
    soft-cap (their `Attention` steps), and the score scale."""
    steps = [cfg.layer(i).attention for i in range(cfg.num_layers)]
    caps = {a.softcap or None for a in steps}
    if len(caps) > 1:
        raise ValueError(f"layers with different score soft-caps ({sorted(caps, key=lambda c: c or 0)}): the "
                         "attention backends take one per model")
    windows = sorted({a.window for a in steps}, key=lambda w: w or 0)
    return make_backend(device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, cfg.sliding_window, dtype,
                        scale=cfg.scale, softcap=caps.pop(), windows=windows)


def make_backend(device, *args, **kwargs):
    if torch.device(device).type == "cuda":
        return TritonAttention(*args, **kwargs)
    return TorchAttention(*args, **kwargs)
