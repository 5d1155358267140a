"""Prefill attention's products: where the CPU has AVX-512 BF16 (`vdpbf16ps`, twice the f32
FMA's products a cycle) the tiles over an f16 or q8_0 cache multiply in bf16 with f32 sums,
unless EDGEPAGED_ATTENTION_BF16=0 (or `ops.bf16_attention(False)`); an f32 cache always in
f32. The CPU runtime then gives every prompt row to the tiles, so a prompt's tail after a
prefix-cache hit attends as the whole prompt did. Measured on the embedded model
(bench/RESULTS.md): the full-attention perplexity of the shipped text 38.230 against 38.231,
the KL divergence of the next-token distributions 4e-6 (the q8_0 cache's: 1.6e-4)."""
from __future__ import annotations

import numpy as np
import pytest

from edgepaged._native import ops
from edgepaged.model.cpu.runner import CpuRunner
from edgepaged.model.settings import CpuConfig

from test_model import Paged

# the kernel's output against f32 products, over the output's largest value (measured:
# 2e-3 to 9e-3, random rows of unit variance, 300-1000 positions)
KERNEL_BOUND = 2e-2


def _has_bf16() -> bool:
    was = ops.bf16_attention()
    try:
        return ops.bf16_attention(True)     # False where the CPU has no AVX-512 BF16
    finally:
        ops.bf16_attention(was)


HAS_BF16 = _has_bf16()


def test_on_by_default_where_the_cpu_has_it_and_off_with_0():
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "EDGEPAGED_ATTENTION_BF16"}
    code = "from edgepaged._native import ops; print(ops.bf16_attention())"
    run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout.strip()
    assert run(env) == str(HAS_BF16)
    assert run({**env, "EDGEPAGED_ATTENTION_BF16": "0"}) == "False"


@pytest.fixture
def products():
    """Restores the process's setting after a test that changes it."""
    was = ops.bf16_attention()
    yield
    ops.bf16_attention(was)


def _attend(dtype, window=0, cap=0.0, seed=0):
    """paged_prefill over two sequences (100 rows over 300 positions, 37 over 37) and a
    shuffled block table, with bf16 products and with f32 ones."""
    rng = np.random.default_rng(seed)
    nh, nkv, d, bs, nb = 8, 2, 64, 16, 40
    k = rng.standard_normal((nb, bs, nkv, d)).astype(np.float32)
    v = rng.standard_normal((nb, bs, nkv, d)).astype(np.float32)
    k, v = (_q8(k), _q8(v)) if dtype == "q8_0" else (k.astype(dtype), v.astype(dtype))
    q = rng.standard_normal((137, nh * d)).astype(np.float32)
    tables = np.stack([rng.permutation(nb)[:20], rng.permutation(nb)[:20]]).astype(np.int32)
    starts, lens = np.array([0, 100, 137], np.int64), np.array([300, 37], np.int32)
    outs = []
    for on in (False, True):
        ops.bf16_attention(on)
        out = np.zeros((137, nh * d), np.float32)
        ops.paged_prefill(q, out, starts, lens, tables, k, v, nh, nkv, 0.125, window, cap)
        outs.append(out)
    return outs


def _q8(x: np.ndarray) -> np.ndarray:
    """A q8_0 cache of x's rows, written by the kernel that writes the cache (rope_write_kv)."""
    from edgepaged.model.cpu.runner import kv_row_units
    nb, bs, nkv, d = x.shape
    cache = np.zeros((nb, bs, nkv, kv_row_units("q8_0", d)), np.int8)
    dummy = np.zeros_like(cache)
    t = nb * bs
    qkv = np.concatenate([np.zeros((t, nkv * d), np.float32), x.reshape(t, nkv * d),
                          np.zeros((t, nkv * d), np.float32)], axis=1)
    ones = np.ones((1, d), np.float32)   # position 0: the rotary turns nothing
    ops.rope_write_kv(qkv, np.zeros(t, np.int64), ones, np.zeros_like(ones), np.arange(t, dtype=np.int64), cache,
                      dummy, nkv, nkv)
    return cache


@pytest.mark.parametrize("window,cap", [(0, 0.0), (70, 0.0), (0, 3.0), (70, 3.0)])
@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_bf16_products_stay_within_the_bound(cache, window, cap, products):
    want, got = _attend(np.float16 if cache == "f16" else "q8_0", window, cap)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= KERNEL_BOUND
    if HAS_BF16:
        assert err > 0, "bf16 products should differ from f32 ones on this CPU"
    else:
        assert err == 0


def test_an_f32_cache_always_attends_in_f32(products):
    want, got = _attend(np.float32)
    assert np.array_equal(got, want)


def test_the_embedded_model_prefills_as_with_f32_products(products):
    """A 300-token prompt (arbitrary tokens: flat next-token distributions, near ties) in
    paged_prefill's tiles over the f16 cache: logits of every row within 1 % of the largest,
    the same top token at 95 % of the rows (measured: 0.5 %, 98.3 %)."""
    settings = CpuConfig(rust_attention_max=0)
    r = CpuRunner(num_blocks=48, settings=settings)
    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    outs = []
    for on in (False, True):
        ops.bf16_attention(on)
        paged = Paged(r.num_blocks, r.block_size, seed=3)
        ids, pos, meta = paged.batch([(0, prompt)])
        outs.append(np.asarray(r.execute(ids, pos, meta, list(range(300)))))
    want, got = outs
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"relative error {err:.2e}, same top {(got.argmax(-1) == want.argmax(-1)).mean():.3f}")
    assert err <= 1e-2 and (err > 0) == HAS_BF16
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_a_prompt_attends_the_same_whole_or_after_a_cached_prefix(cache, products):
    """With bf16 products, a prompt's last logits computed in one chunk equal, bit for bit,
    those computed over its first 32 tokens' blocks (a prefix-cache hit) with a tail of 5
    rows: a short chunk goes to the tiles too, not row by row in f32 (which changed the
    greedy answer of test_kv_q8's prefix hits). (A tail of one row is another matter: the
    linear layers' one-token kernels sum in another order than the batched ones.)"""
    ops.bf16_attention(True)
    r = CpuRunner(num_blocks=16, kv_dtype=cache)
    prompt = [(i * 7919) % 40000 + 100 for i in range(37)]

    def last(chunks, prompt_flag=None):
        paged = Paged(r.num_blocks, r.block_size, seed=5)
        for c in chunks:
            ids, pos, meta = paged.batch([(0, c)])
            if prompt_flag is not None:
                meta["prompt"] = np.array([prompt_flag])
            out = np.asarray(r.execute(ids, pos, meta, [len(c) - 1]))
        return out[0]

    whole = last([prompt])
    assert np.array_equal(last([prompt[:32], prompt[32:]]), whole)
    assert np.array_equal(last([prompt[:32], prompt[32:]], prompt_flag=True), whole)
    if HAS_BF16:     # rows flagged as generated tokens' (drafts) attend row by row, in f32
        assert not np.array_equal(last([prompt[:32], prompt[32:]], prompt_flag=False), whole)


KEPT_SCRATCH = r"""
import resource, sys
import numpy as np
from edgepaged._native import ops
from edgepaged.server.app import tame_malloc
tame_malloc()                         # the server's allocator: a megabyte or more is mapped fresh
rng = np.random.default_rng(0)
nh, nkv, d, bs, ctx, rows = 32, 8, 64, 16, 2304, 64
nb = ctx // bs
k = rng.standard_normal((nb, bs, nkv, d)).astype(np.float16)
v = rng.standard_normal((nb, bs, nkv, d)).astype(np.float16)
q = rng.standard_normal((rows, nh * d)).astype(np.float32)
tables = np.arange(nb, dtype=np.int32)[None]
starts, lens = np.array([0, rows], np.int64), np.array([ctx], np.int32)
out = np.zeros((rows, nh * d), np.float32)
for _ in range(2):
    ops.paged_prefill(q, out, starts, lens, tables, k, v, nh, nkv, 0.125)
first = out.copy()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    ops.paged_prefill(q, out, starts, lens, tables, k, v, nh, nkv, 0.125)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, np.array_equal(out, first))
"""


def test_prefill_attention_keeps_its_scratch_from_call_to_call():
    """A tile's scores over a 2 k context (32 rows x 4 query heads a KV head) pass a megabyte:
    made per call, the server's allocator mapped them fresh and every call faulted them in
    again (12,800 page faults in a 146-row step of the 1 B file at 2,193 positions, against 36
    now). Kept per thread, four more calls fault in (almost) nothing and answer the same."""
    import subprocess
    import sys
    got = subprocess.run([sys.executable, "-c", KEPT_SCRATCH], capture_output=True, text=True, check=True)
    faults, same = got.stdout.split()
    assert same == "True"
    assert int(faults) < 64, faults       # per call made: 4 calls x 8 chunks x 1.2 MB of scores


@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_rows_that_see_past_their_causal_limit(cache):
    """`see`: a vision tower's patches attend to every patch (each row sees the whole
    sequence), Gemma 3's image tokens to their whole image (rows of a span see its end), the
    rest causally; against a masked softmax in float64, over two sequences in one call; a
    `see` past the context or shrinking for a later row is refused."""
    rng = np.random.default_rng(5)
    nh, nkv, d, bs = 4, 2, 32, 16
    lens, qs = [70, 37], [70, 20]          # the second: 20 new rows after 17 cached
    blocks = [list(range(0, 5)), list(range(5, 8))]
    k = rng.standard_normal((8, bs, nkv, d)).astype(np.float32)
    v = rng.standard_normal((8, bs, nkv, d)).astype(np.float32)
    kc, vc = (k.astype(np.float16), v.astype(np.float16)) if cache == "f16" else (k, v)
    q = rng.standard_normal((sum(qs), nh * d)).astype(np.float32)
    starts = np.array([0, qs[0], sum(qs)], np.int64)
    tables = np.full((2, 5), 0, np.int32)
    for b, bl in enumerate(blocks):
        tables[b, :len(bl)] = bl
    see = np.concatenate([np.full(qs[0], lens[0]), np.arange(lens[1] - qs[1] + 1, lens[1] + 1)]).astype(np.int32)
    see[qs[0] + 3: qs[0] + 9] = lens[1] - qs[1] + 9      # an image span: rows 3..8 of the chunk see its end
    out = np.empty_like(q)
    ops.paged_prefill(q, out, starts, np.array(lens, np.int32), tables, kc, vc, nh, nkv, 0.125, see=see)
    kk, vv = kc.astype(np.float64), vc.astype(np.float64)
    for b in range(2):
        K = np.concatenate([kk[x] for x in blocks[b]])[:lens[b]]
        V = np.concatenate([vv[x] for x in blocks[b]])[:lens[b]]
        for j in range(qs[b]):
            r = starts[b] + j
            hi = max(lens[b] - qs[b] + j + 1, see[r])
            for h in range(nh):
                s = K[:hi, h // (nh // nkv)] @ q[r, h * d:(h + 1) * d].astype(np.float64) * 0.125
                p = np.exp(s - s.max())
                want = (p / p.sum()) @ V[:hi, h // (nh // nkv)]
                got = out[r, h * d:(h + 1) * d]
                assert np.abs(got - want).max() <= (1e-5 if cache == "f32" else KERNEL_BOUND), (b, j, h)
    for bad in (np.where(np.arange(len(see)) == 5, 999, see), np.where(np.arange(len(see)) == 2, 1, see)):
        with pytest.raises(ValueError, match="past its context of .* or decreasing"):
            ops.paged_prefill(q, out, starts, np.array(lens, np.int32), tables, kc, vc, nh, nkv, 0.125,
                              see=bad.astype(np.int32))
    with pytest.raises(ValueError, match="one entry per row"):
        ops.paged_prefill(q, out, starts, np.array(lens, np.int32), tables, kc, vc, nh, nkv, 0.125, see=see[:-1])
