"""The window context policy (issue 25): a sequence keeps its first `sink` tokens and its last
`window`; the blocks between go back to the pool as it grows, the kernels see the kept blocks
as one shorter sequence (each token rotated at its true position), and it may generate past
the model's context. Real parts: the Rust allocator, the torch-free CPU runtime on a GGUF file
written here, the engine's scheduler."""
import numpy as np
import pytest
import trio

from edgepaged.engine import Engine, EngineConfig, Request, RequestRejected, TokenEvent
from edgepaged.model import SamplingParams
from edgepaged.model.cpu.runner import CpuRunner
from edgepaged.testing.gguf_models import write_random_gguf

BS, SINK, WINDOW, CONTEXT = 8, 4, 16, 64


@pytest.fixture(scope="module")
def gguf_one_layer(tmp_path_factory):
    """One layer: a token's K/V depend on its embedding and position only, so attention over
    the kept positions can be checked exactly against a fresh prefill of those tokens."""
    path = tmp_path_factory.mktemp("window") / "one-layer.gguf"
    return write_random_gguf(path, hidden=64, layers=1, heads=4, kv_heads=2, inter=96, context=CONTEXT,
                             qtypes=dict(token_embd=0, output=0, attn_q=0, attn_k=0, attn_v=0, attn_output=0,
                                         ffn_gate=0, ffn_up=0, ffn_down=0))


@pytest.fixture(scope="module")
def gguf_two_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("window") / "two-layers.gguf"
    return write_random_gguf(path, hidden=64, layers=2, heads=4, kv_heads=2, inter=96, context=CONTEXT, seed=3,
                             qtypes=dict(token_embd=8, output=8, attn_q=8, attn_k=8, attn_v=8, attn_output=8,
                                         ffn_gate=8, ffn_up=8, ffn_down=8))


def engine_for(path, num_blocks=48, **cfg) -> Engine:
    runner = CpuRunner(path, num_blocks=num_blocks, block_size=BS, kv_dtype="f32")
    return Engine(runner, EngineConfig(window_tokens=WINDOW, window_sink=SINK, **cfg))


def request(prompt, max_tokens, window=True, logprobs=None) -> Request:
    return Request(prompt_ids=list(prompt), params=SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens,
                                                                  logprobs=logprobs),
                   context_window=(SINK, WINDOW) if window else None)


async def collect(engine, req):
    ids, lps, done = [], [], None
    async with engine.stream(req) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                ids += ev.token_ids
                lps += ev.logprobs or []
            else:
                done = ev
    return ids, lps, done


def counting(engine, seen: list):
    """Blocks in use before each forward (the engine's step hook runs in the worker)."""
    engine.step_hook = lambda batch: seen.append((engine.allocator.num_used_blocks,
                                                  [int(x) for x in batch.seq_lens]))


@pytest.mark.parametrize("runtime", ["cpu", "torch", "triton"])
async def test_generates_twice_the_context_with_flat_memory(gguf_two_layers, tmp_path, runtime):
    if runtime == "cpu":
        engine = engine_for(gguf_two_layers)
    else:   # the torch runner on a safetensors checkpoint: the same tables, its own rotary tables grown
        from edgepaged.model import ModelRunner
        from edgepaged.testing.tiny_models import make_tiny_model
        runner = ModelRunner(make_tiny_model(tmp_path / "tiny", context=CONTEXT), num_blocks=48, block_size=BS,
                             kv_dtype="f32" if runtime == "triton" else None)   # (Triton: q's dtype)
        if runtime == "triton":   # the GPU path's attention kernels (Triton's interpreter on a CPU)
            pytest.importorskip("triton")
            from edgepaged import kernels
            from edgepaged.model.torch.attention import backend_for
            from edgepaged.model.torch.forward import TorchForward
            if not kernels.is_available():
                pytest.skip("Triton has neither a GPU nor the interpreter here (conftest.py sets TRITON_INTERPRET=1)")
            runner.forward = TorchForward(runner.model, backend_for("cuda", runner.config, BS, runner.dtype),
                                          runner.kv_cache)
            assert "Triton" in runner.forward.name
        engine = Engine(runner, EngineConfig(window_tokens=WINDOW, window_sink=SINK))
    prompt = list(range(3, 23))
    seen = []
    counting(engine, seen)
    async with engine:
        assert engine.max_model_len == CONTEXT
        with pytest.raises(RequestRejected, match="context"):      # full attention cannot
            await collect(engine, request(prompt, 2 * CONTEXT, window=False))
        ids, _, done = await collect(engine, request(prompt, 2 * CONTEXT))
    assert done.finish_reason == "length" and len(ids) == 2 * CONTEXT
    # the sink block, the window (WINDOW tokens up to BS - 1 more) and the block being written
    bound = -(-SINK // BS) + -(-(WINDOW + BS - 1) // BS) + 1
    used = [u for u, _ in seen]
    assert max(used[len(used) // 4:]) <= bound, used
    assert max(used) <= max(bound, -(-len(prompt) // BS) + 1)
    # what the kernels were shown: never more than the kept positions
    assert max(max(lens) for _, lens in seen[1:]) <= bound * BS
    assert len(seen) >= 2 * CONTEXT
    a = engine.allocator
    assert a.num_used_blocks == 0 and a.num_free_blocks == a.num_blocks
    a.check_invariants()


async def test_attention_over_the_kept_positions_is_exact(gguf_one_layer):
    """Each late token's log-probability equals a fresh prefill of the kept tokens (the sink
    blocks, then the window blocks) at their true positions, which a one-layer model makes an
    exact reference; and while the sequence is shorter than window + sink the answer equals
    full attention's."""
    engine = engine_for(gguf_one_layer)
    prompt = [5, 9, 17, 33, 65, 129, 200, 7, 11, 13]
    async with engine:
        ids_w, lps_w, _ = await collect(engine, request(prompt, 40, logprobs=5))
        short = WINDOW + SINK - len(prompt)
        ids_f, lps_f, _ = await collect(engine, request(prompt, short, window=False, logprobs=0))
        ids_s, lps_s, _ = await collect(engine, request(prompt, short, logprobs=0))
    assert ids_s == ids_f and [x["logprob"] for x in lps_s] == [x["logprob"] for x in lps_f]
    assert ids_w[:short] == ids_f
    runner = engine.runner
    seq = prompt + ids_w
    sink_blocks = -(-SINK // BS)
    checked = 0
    for k in range(short + 2, len(ids_w)):
        # the token sampled at step k came from the query at position n - 1 (n = its context)
        n = len(prompt) + k
        # kept then: the sink blocks, and every block not wholly before n - 1 - WINDOW + 1
        # (released between steps: what the step before left)
        start = max(sink_blocks, (n - 1 + 1 - WINDOW) // BS) * BS if n - 1 >= WINDOW else 0
        keep = list(range(min(sink_blocks * BS, n))) + list(range(max(start, sink_blocks * BS), n))
        logits = prefill(runner, [seq[p] for p in keep], keep)
        lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert int(np.argmax(logits)) == ids_w[k], k
        # the chosen token's and the next likeliest ones' (the chosen one saturates near 0)
        for tok, got in [(ids_w[k], lps_w[k]["logprob"])] + lps_w[k]["top"]:
            assert abs(lp[tok] - got) <= 1e-4 * max(1.0, abs(got)), (k, tok, lp[tok], got)
        checked += 1
    assert checked >= 10


def prefill(runner, tokens, positions) -> np.ndarray:
    """Logits of the last of `tokens` (at `positions`) in a fresh sequence of the runner's pool."""
    n = len(tokens)
    blocks = list(range(runner.num_blocks - -(-n // BS), runner.num_blocks))
    slots = [blocks[i // BS] * BS + i % BS for i in range(n)]
    meta = {"query_start_loc": np.array([0, n], np.int32), "seq_lens": np.array([n], np.int32),
            "block_tables": np.array([blocks], np.int32), "slot_mapping": np.array(slots, np.int64)}
    out = runner.execute(np.array(tokens, np.int64), np.array(positions, np.int64), meta, np.array([n - 1]))
    return np.asarray(out, np.float64)[0]


async def test_a_shared_prefix_block_outlives_one_window(gguf_two_layers):
    """Two requests share their prompt's blocks (the prefix cache); the windowed one gives its
    references back as it grows, the full one keeps the blocks it still attends."""
    engine = engine_for(gguf_two_layers)
    prompt = list(range(40, 64))                     # 3 full blocks
    states = []

    def hook(batch):
        reqs = {r.context_window is not None: r for r in batch.requests}
        if len(reqs) == 2 and all(r.output_ids for r in reqs.values()):
            a = engine.allocator
            w, f = reqs[True], reqs[False]
            states.append((a.block_table(w.id), a.block_table(f.id),
                           [a.refcount(b) for b in a.block_table(f.id)[:3]]))
    engine.step_hook = hook
    async with engine:
        _, _, done = await collect(engine, request(prompt, 1))     # the prompt's blocks enter the cache
        full = request(prompt, 30, window=False)
        full.drafting.allowed = False      # one token a step, as the windowed one: they run side by side to the end
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, engine, full)
            nursery.start_soon(collect, engine, request(prompt, 30))
    assert states
    w_table, f_table, refs = states[-1]
    assert w_table[:3][0] == f_table[0]                              # the sink block: both hold it
    assert w_table[1] == 2 ** 32 - 1 and w_table[2] == 2 ** 32 - 1   # released by the windowed one ...
    assert f_table[1] != 2 ** 32 - 1 and refs[1] == 1 and refs[0] == 2   # ... kept by the full one
    a = engine.allocator
    assert a.num_used_blocks == 0
    a.check_invariants()


async def test_every_door_takes_the_policy_per_server_and_per_request(gguf_two_layers):
    """A box serving with the window policy answers past the context on the OpenAI and Ollama
    APIs and the msgpack protocol; a request may ask for full attention (then the context
    holds) and a policy that does not exist is a 400 naming the field."""
    import httpx

    from edgepaged.client import open_client
    from edgepaged.testing import serving as box
    runner = CpuRunner(gguf_two_layers, num_blocks=48, block_size=BS, kv_dtype="f32")
    policy = dict(context_policy="window", window_tokens=WINDOW, window_sink=SINK)
    async with box.serving(runner, http=True, engine=policy) as server:
        base, n = server.http_base, 2 * CONTEXT
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"prompt": "the house", "max_tokens": n, "temperature": 0, "ignore_eos": True}
            r = (await c.post(base + "/v1/completions", json=body)).json()
            assert r["usage"]["completion_tokens"] == n and r["choices"][0]["finish_reason"] == "length", r
            full = await c.post(base + "/v1/completions", json={**body, "context_policy": "full"})
            assert full.status_code == 400 and full.json()["error"]["code"] == "invalid_params", full.text
            assert 'context_policy "window"' in full.json()["error"]["message"]
            bad = await c.post(base + "/v1/completions", json={**body, "context_policy": "sliding"})
            assert bad.status_code == 400 and "context_policy" in bad.json()["error"]["message"], bad.text
            o = (await c.post(base + "/api/generate", json={
                "model": server.front.model, "prompt": "the house", "raw": True, "stream": False, "context_policy": "window",
                "options": {"num_predict": n, "temperature": 0}})).json()
            assert o.get("done") and (o["eval_count"] == n or o["done_reason"] == "stop"), o
        async with open_client(server.address) as client:
            async with client.generate("the house", max_tokens=n, temperature=0, ignore_eos=True) as stream:
                async for _ in stream:
                    pass
            assert stream.done["finish_reason"] == "length" and stream.done["usage"]["completion_tokens"] == n
        with trio.fail_after(5):
            while server.engine.stats()["kv_blocks_used"]:
                await trio.sleep(0.05)
        server.engine.allocator.check_invariants()


def test_perplexity_bench_measures_the_policies(embedded_runner_cpu):
    """bench/perplexity.py's measure (edgepaged.testing.perplexity) on the shipped text: a window wider than the text is full attention
    (one token a step against chunks: the same up to rounding); a narrow one holds fewer
    blocks; every block comes back."""
    from pathlib import Path

    from edgepaged.testing.perplexity import perplexity
    text = (Path(__file__).resolve().parent.parent / "bench" / "data" / "coriolanus.txt").read_text()
    ids = embedded_runner_cpu.tokenizer.encode(text)[:160]
    full = perplexity(embedded_runner_cpu, ids)
    wide = perplexity(embedded_runner_cpu, ids, window=1024, sink=4)
    narrow = perplexity(embedded_runner_cpu, ids, window=32, sink=4)
    assert 1 < full["ppl"] < 200 and abs(wide["nll"] - full["nll"]) <= 1e-3, (full, wide)
    assert narrow["kv_blocks_max"] <= 1 + 3 + 1 < full["kv_blocks_max"] and narrow["nll"] != full["nll"]


@pytest.fixture(scope="module")
def embedded_runner_cpu():
    return CpuRunner(num_blocks=64, block_size=16)
