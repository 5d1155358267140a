"""Embeddings from any served model (issue 37, section 1, for decoder models): a request's
prompt runs through the engine like any prompt (its KV blocks only while it runs) and answers
its final hidden state at the last token, after the final norm (last-token pooling, as
Qwen3-Embedding and llama.cpp's `--pooling last`). Checked against transformers on tiny
models on both runtimes (cosine >= 0.9999), and on every door with the real clients:
`/api/embed` (`ollama.embed`), `/api/embeddings` (the older shape), `/v1/embeddings`
(`openai.embeddings.create`, `dimensions`, base64), beside a chat that keeps answering."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
import trio

from test_http import afetch
from edgepaged.testing.serving import serving

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, hello paged cache", "hello"]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
async def test_last_token_pooling_matches_transformers_on_both_runtimes(name, tmp_path):
    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", name, seed=7)
    gguf = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0)
    runners = {"cpu": CpuRunner(gguf, num_blocks=64), "torch": ModelRunner(tmp_path / "m", num_blocks=64)}
    for runtime, runner in runners.items():
        async with serving(runner, http=True) as server:
            status, _, raw = (await afetch(server.http_base + "/v1/embeddings", {"input": TEXTS}))
            assert status == 200, raw
            got = [d["embedding"] for d in json.loads(raw)["data"]]
            ids = [runner.tokenizer.encode(t) for t in TEXTS]
            assert server.engine.stats()["kv_blocks_used"] == 0
        for text_ids, vec in zip(ids, got):
            with torch.no_grad():
                out = hf(torch.tensor([text_ids]), output_hidden_states=True)
            want = out.hidden_states[-1][0, -1].numpy()          # after the final norm
            assert cosine(vec, want) >= 0.9999, (runtime, cosine(vec, want))
            assert abs(np.linalg.norm(vec) - 1) < 1e-5


async def test_every_door_with_the_real_clients_beside_a_chat(embedded_runner):
    import ollama
    import openai
    async with serving(embedded_runner, http=True) as server:
        base, model = server.http_base, server.front.model

        def scenario():
            o = ollama.Client(host=base, timeout=120)
            out = {"embed": o.embed(model=model, input=TEXTS), "one": o.embed(model=model, input=TEXTS[0]),
                   "dims": o.embed(model=model, input=TEXTS[:1], dimensions=8),
                   "legacy": o.embeddings(model=model, prompt=TEXTS[0])}
            c = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120)
            out["openai"] = c.embeddings.create(model=model, input=TEXTS)
            out["openai_dims"] = c.embeddings.create(model=model, input=TEXTS[0], dimensions=16)
            # token ids, as LangChain's OpenAIEmbeddings sends OpenAI's (tiktoken) ids by default: read as this
            # model's ids they gave a 200 and a wrong vector (cosine 0.08); refused, naming the setting
            try:
                c.embeddings.create(model=model, input=[[9906, 1917, 0, 2028]])
            except openai.BadRequestError as e:
                out["tokens"] = e
            out["langchain_setting"] = c.embeddings.create(model=model, input=[TEXTS[0]])   # what it sends then
            return out

        chat = {}

        async def chatting():
            status, _, raw = (await afetch(base + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
                "temperature": 0}))
            chat["answer"] = json.loads(raw)["choices"][0]["message"]["content"]
        async with trio.open_nursery() as n:
            n.start_soon(chatting)
            out = await trio.to_thread.run_sync(scenario)
        status, _, raw = (await afetch(base + "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}))
        b64 = np.frombuffer(base64.b64decode(json.loads(raw)["data"][0]["embedding"]), dtype="<f4")
        bad = [({"input": []}, "/v1/embeddings"), ({"input": [""]}, "/v1/embeddings"), ({"input": [[10**9]]},
               "/v1/embeddings"), ({"input": "x", "dimensions": 0}, "/v1/embeddings"), ({"input": 5}, "/v1/embeddings"),
               ({"model": model, "input": "x", "truncate": "yes"}, "/api/embed"),
               ({"model": model, "input": "word " * 9000, "truncate": False}, "/api/embed"),
               ({"model": "nope", "input": "x"}, "/api/embed"), ({"model": model, "prompt": 3}, "/api/embeddings"),
               ({"model": model, "prompt": "\ud800"}, "/api/embeddings")]     # (the fuzzer found it: a 500)
        for body, path in bad:
            status, _, raw = (await afetch(base + path, body))
            assert 400 <= status < 500, (path, body, raw)
            err = json.loads(raw)["error"]
            assert isinstance(err, str) if path.startswith("/api/") else err["message"]
        status, _, raw = (await afetch(base + "/api/embed", {"model": model, "input": "word " * 9000}))
        assert status == 200                              # truncate (Ollama's default): cut to the context
        assert server.engine.stats()["kv_blocks_used"] == 0
    vecs = np.array(out["embed"].embeddings)
    # a text embedded again hits the prefix cache for all but its last token: that row alone
    # gives the whole text's vector (CpuRunner.execute pads it to the many-row kernels)
    tol = 1e-5
    assert vecs.shape == (3, 576) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert np.allclose(out["one"].embeddings[0], vecs[0], atol=tol)
    assert len(out["dims"].embeddings[0]) == 8 and abs(np.linalg.norm(out["dims"].embeddings[0]) - 1) < 1e-5
    legacy = np.array(out["legacy"].embedding)
    assert cosine(legacy, vecs[0]) > 0.99999 and np.linalg.norm(legacy) > 2     # the raw state, not normed
    oa = np.array([d.embedding for d in out["openai"].data])
    assert np.allclose(oa, vecs, atol=tol) and out["openai"].usage.prompt_tokens > 0
    assert len(out["openai_dims"].data[0].embedding) == 16
    assert out["tokens"].status_code == 400 and "check_embedding_ctx_length=False" in str(out["tokens"])
    assert np.allclose(out["langchain_setting"].data[0].embedding, vecs[0], atol=tol)
    assert np.allclose(b64, vecs[0], atol=tol)
    assert cosine(vecs[1], vecs[2]) > cosine(vecs[0], vecs[2])     # "hello world…" is nearer "hello"
    assert "Paris" in chat["answer"]


async def test_one_request_embeds_a_bounded_number_of_tokens(embedded_runner):
    async with serving(embedded_runner, http=True, max_identity_tokens=50) as server:
        status, _, raw = await afetch(server.http_base + "/v1/embeddings", {"input": [TEXTS[0]] * 10})
        assert status == 400 and b"--max-identity-tokens" in raw and b"send them in parts" in raw
        status, _, raw = await afetch(server.http_base + "/v1/embeddings", {"input": [TEXTS[0]] * 2})
        assert status == 200


@pytest.mark.parametrize("runtime", ["cpu", "torch"])
async def test_mean_pooling_of_a_decoder_across_chunks(runtime, tmp_path):
    """A decoder embedding model whose file says mean pooling (`pooling_type` 1): the mean of
    every prompt position's final-norm state, gathered over prefill chunks (the engine cuts a
    long prompt into several steps), matches transformers'; the same text twice (its prefix
    cached by the first) still gives every position's state."""
    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", "qwen3", seed=5)
    gguf = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0, pooling=1)
    runner = CpuRunner(gguf, num_blocks=64) if runtime == "cpu" else ModelRunner(gguf, num_blocks=64)
    long = " ".join(TEXTS * 6)
    inputs = [long, TEXTS[0], long]
    async with serving(runner, http=True, engine={"max_num_batched_tokens": 32}) as server:
        status, _, raw = await afetch(server.http_base + "/v1/embeddings", {"input": inputs})
        assert status == 200, raw
        got = [d["embedding"] for d in json.loads(raw)["data"]]
        ids = [runner.tokenizer.encode(t) for t in inputs]
        assert server.engine.stats()["kv_blocks_used"] == 0
    assert len(ids[0]) > 3 * 32                               # several chunks
    for text_ids, vec in zip(ids, got):
        with torch.no_grad():
            out = hf(torch.tensor([text_ids]), output_hidden_states=True)
        want = out.hidden_states[-1][0].mean(0).numpy()
        assert cosine(vec, want) >= 0.9999, (runtime, cosine(vec, want))
        last = out.hidden_states[-1][0, -1].numpy()
        assert cosine(vec, last) < 0.999                     # not the last token's state
