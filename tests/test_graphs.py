"""The decode step with static shapes (`model/torch/graphs.py`): what a CUDA graph replays on
a GPU, run eagerly here (the padded buckets, the static block tables) gives the dynamic step's
logits and writes the same K/V, with the torch backend and with the Triton kernels (their
interpreter: the GPU path's attention, padding rows included)."""
import numpy as np
import pytest
import torch

from edgepaged.model import ModelRunner
from edgepaged.model.torch.forward import TorchForward

from test_model import Paged


def _decode_steps(r, steps, seed=3):
    paged, outs = Paged(r.num_blocks, r.block_size, seed=seed), []
    for items in steps:
        ids, pos, meta = paged.batch(items)
        outs.append(torch.as_tensor(np.asarray(r.execute(ids, pos, meta))).clone())
    return outs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_graph_ready_decode_step_gives_the_dynamic_steps_logits(backend, tiny_model_dir):
    dynamic = ModelRunner(tiny_model_dir, num_blocks=32, kv_dtype="f32", decode_graphs=False)
    static = ModelRunner(tiny_model_dir, num_blocks=32, kv_dtype="f32", decode_graphs=True, max_num_seqs=6)
    assert dynamic.graphs is None and static.graphs is not None and not static.graphs.capture
    if backend == "triton":
        pytest.importorskip("triton")
        from edgepaged import kernels
        from edgepaged.model.torch.attention import backend_for
        if not kernels.is_available():
            pytest.skip("Triton has neither a GPU nor the interpreter here")
        for r in (dynamic, static):
            r.backend = backend_for("cuda", r.config, r.block_size, r.dtype)
            r.forward = TorchForward(r.model, r.backend, r.kv_cache)
        static.graphs.backend = static.backend
    assert static.graphs.buckets == [1, 2, 4, 8] and static.graphs.bucket(5) == 8
    prompts = [list(range(10 + 7 * i, 10 + 7 * i + n)) for i, n in enumerate((5, 19, 33, 3, 12, 7, 2))]
    steps = [[(i, p) for i, p in enumerate(prompts[:5])],          # prefills: the dynamic step
             [(i, [40 + i]) for i in range(5)],                    # 5 decodes: bucket 8, 3 rows of padding
             [(i, [50 + i]) for i in (4, 0, 2)],                   # 3: bucket 4
             [(1, [60])],                                          # 1: bucket 1, no padding
             [(5, prompts[5]), (6, prompts[6])],
             [(i, [70 + i]) for i in range(7)]]                    # 7: bucket 8 (the first >= max_num_seqs)
    want, got = _decode_steps(dynamic, steps), _decode_steps(static, steps)
    for a, b in zip(want, got):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5
    assert torch.equal(dynamic.kv_cache, static.kv_cache)      # the padding rows wrote nothing
    assert static.graphs.steps == {8: 2, 4: 1, 1: 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_residual_add_and_its_norm_in_one_kernel(dtype):
    """kernels.norms.add_rms_norm: h += x in place, and the norm of the sum, as the two torch
    calls it replaces give them (a width not a power of two: the row masked)."""
    pytest.importorskip("triton")
    from edgepaged import kernels
    if not kernels.is_available():
        pytest.skip("Triton has neither a GPU nor the interpreter here")
    from edgepaged.kernels.norms import add_rms_norm
    g = torch.Generator().manual_seed(0)
    h, x = (torch.randn(5, 96, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    want_h = h + x
    want = torch.nn.functional.rms_norm(want_h, (96,), w, 1e-6)
    got = add_rms_norm(h, x, w, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert torch.equal(h, want_h)
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_the_gpu_step_s_pieces_give_the_plain_steps_tokens(tiny_model_dir, monkeypatch):
    """The pieces the torch runner turns on for a CUDA device, each on a CPU (the Triton
    interpreter): the residual add and norm in one kernel, the decode step through the
    static buffers, and greedy rows picked by an argmax where the logits are (B ids to the
    host, not B x vocab logits): the same greedy tokens and logits as the plain step."""
    pytest.importorskip("triton")
    from edgepaged import kernels
    if not kernels.is_available():
        pytest.skip("Triton has neither a GPU nor the interpreter here")
    from edgepaged.model.torch.attention import backend_for
    from edgepaged.testing.decode import make_allocator, run_batch
    plain = ModelRunner(tiny_model_dir, num_blocks=32, kv_dtype="f32", decode_graphs=False)
    gpu_like = ModelRunner(tiny_model_dir, num_blocks=32, kv_dtype="f32", decode_graphs=True, max_num_seqs=4)
    for r in (plain, gpu_like):
        r.backend = backend_for("cuda", r.config, r.block_size, r.dtype)
        r.forward = TorchForward(r.model, r.backend, r.kv_cache)
    gpu_like.graphs.backend = gpu_like.backend
    gpu_like.model.use_triton_norms()
    gpu_like.device_sampling = True
    prompts = [np.arange(5, 5 + n) for n in (9, 20, 4)]
    want = run_batch(plain, make_allocator(plain), prompts, 6)[0]
    from edgepaged.model import runtime
    copied = []
    monkeypatch.setattr(runtime, "as_array", lambda x: copied.append(x.shape) or np.asarray(x))
    got = run_batch(gpu_like, make_allocator(gpu_like), prompts, 6)[0]
    assert got == want
    assert copied == []                                       # no step copied its logits to the host
    assert gpu_like.graphs.steps == {4: 5}                     # 3 sequences in bucket 4, 5 decode steps


def test_the_whole_gpu_configuration_interpreted_gives_the_cpu_runtime_s_tokens(tmp_path, monkeypatch):
    """Everything the torch runner turns on for a CUDA device at once, on a Q8_0 file, run by
    Triton's interpreter: the blocks kept and multiplied by the Triton kernels, Triton's paged
    attention, the residual add and norm kernel, the decode step through the static buffers,
    greedy picks on the device. Its greedy tokens are the CPU runtime's on the same file."""
    pytest.importorskip("triton")
    from edgepaged import kernels
    if not kernels.is_available():
        pytest.skip("Triton has neither a GPU nor the interpreter here")
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.model.torch.attention import backend_for
    from edgepaged.testing.decode import make_allocator, run_batch
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", "llama")
    path = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=8)
    gpu = ModelRunner(path, num_blocks=32, kv_dtype="f32", quant_kernels="triton", decode_graphs=True, max_num_seqs=4)
    gpu.backend = backend_for("cuda", gpu.config, gpu.block_size, gpu.dtype)
    gpu.forward = TorchForward(gpu.model, gpu.backend, gpu.kv_cache)
    gpu.graphs.backend = gpu.backend
    gpu.model.use_triton_norms()
    gpu.device_sampling = True
    cpu = CpuRunner(path, num_blocks=32, kv_dtype="f32")
    prompts = [np.arange(3, 3 + n) for n in (11, 4, 17)]
    want = run_batch(cpu, make_allocator(cpu), prompts, 5)[0]
    got = run_batch(gpu, make_allocator(gpu), prompts, 5)[0]
    assert got == want
    assert gpu.graphs.steps == {4: 4} and gpu.products == "GGUF blocks (triton)"


def test_rotary_and_the_cache_write_in_one_kernel():
    """kernels.rope.rope_write_kv: the rotated queries, and the rotated keys and the values at
    their slots (slot -1: nowhere), as `Rotary.apply` then the cache write give them, from a
    strided fused QKV view."""
    pytest.importorskip("triton")
    from edgepaged import kernels
    if not kernels.is_available():
        pytest.skip("Triton has neither a GPU nor the interpreter here")
    from edgepaged.kernels.rope import rope_write_kv
    from edgepaged.model.torch.layers import Rotary
    g = torch.Generator().manual_seed(0)
    t, h, hkv, d, bs = 5, 6, 2, 32, 4
    wide = torch.randn(t, (h + 2 * hkv) * d + 8, generator=g)
    qkv = wide[:, 8:]                                       # a strided view, as a bias-free slice is
    rot = Rotary(d, 64, 10000.0)
    pos = torch.tensor([0, 3, 17, 40, 63])
    cos, sin = rot.tables(pos)
    slots = torch.tensor([5, -1, 0, 13, 22])
    kc, vc = torch.zeros(6, bs, hkv, d), torch.zeros(6, bs, hkv, d)
    q = rope_write_kv(qkv, cos[:, 0], sin[:, 0], slots, kc, vc, h, hkv)
    x = qkv.reshape(t, h + 2 * hkv, d)
    qk = Rotary.apply(x[:, : h + hkv], cos, sin)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, s % bs] = qk[i, h:]
            want_v[s // bs, s % bs] = x[i, h + hkv:]
    assert (q - qk[:, :h]).abs().max().item() <= 1e-6
    assert (kc - want_k).abs().max().item() <= 1e-6 and torch.equal(vc, want_v)


def test_the_engine_s_decode_steps_run_through_the_graph_and_ahead(tiny_model_dir):
    """The engine on a runner set up as on a GPU (decode graphs, the sampler on the device,
    look-ahead decode): its decode steps go through the static buffers (the engine passes
    each sequence's row as logits_indices: before the fix the graph never ran in the engine,
    only under the benchmark's harness), steps are launched ahead with the ids on the device,
    and the greedy answers are the plain runner's, step by step."""
    import trio

    from edgepaged.engine import Engine, EngineConfig, Request, TokenEvent
    from edgepaged.model import SamplingParams

    prompts = [list(range(5, 5 + n)) for n in (9, 30, 4)]

    async def answers(runner, ahead):
        out = [None] * len(prompts)
        async with Engine(runner, EngineConfig(max_num_seqs=4, async_decode=ahead, speculation="off")) as eng:
            async def one(i):
                r = Request(prompt_ids=prompts[i], params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
                async with eng.stream(r) as chan:
                    out[i] = [t for ev in [e async for e in chan] if isinstance(ev, TokenEvent) for t in ev.token_ids]
            async with trio.open_nursery() as n:
                for i in range(len(prompts)):
                    n.start_soon(one, i)
            return out, eng.stats()["steps_ahead"]

    plain = ModelRunner(tiny_model_dir, num_blocks=32, kv_dtype="f32", decode_graphs=False)
    gpu_like = ModelRunner(tiny_model_dir, num_blocks=32, kv_dtype="f32", decode_graphs=True, max_num_seqs=4)
    gpu_like.device_sampling = True
    want, _ = trio.run(answers, plain, False)
    got, ahead = trio.run(answers, gpu_like, True)
    assert got == want and all(len(a) == 10 for a in got)
    assert sum(gpu_like.graphs.steps.values()) >= 8, gpu_like.graphs.steps     # (decode steps of 3 rows)
    assert ahead >= 5, ahead
