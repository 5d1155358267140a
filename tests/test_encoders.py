"""Embedding models of the BERT family (issue 37, section 1): `bert` (all-MiniLM, bge) and
`nomic-bert` (nomic-embed-text: rotary, SwiGLU), tiny ones built from transformers' config
classes and written as GGUF (F32 and F16, as llama.cpp's converter writes them) and as Hugging
Face folders (safetensors): the tokenizer gives transformers' ids, the vectors match
transformers' pooled ones (cosine >= 0.9999). Served through the engine (its blocks only while
a request runs) to the real clients: `ollama.embed`, `openai.embeddings.create`, a LangChain
retriever over /api/embed; a chat request to an embedding model is a clear 400; one box
serves a chat model and an embedding model at once."""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgepaged.testing.encoders import make_encoder, reference_embeddings, write_encoder_gguf
from edgepaged.testing.serving import serving
from test_http import afetch

TEXTS = ["Turn off the kitchen lights.", "What is the temperature in the living room?",
         "Bake the bread for 40 minutes at 220 degrees; crème brûlée!", "x", "日本 über  tabs\tand\nnewlines",
         "the invoice for the car insurance was paid on day 12"]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """{(kind, pooling): (folder, model, tokenizer)} and the GGUF files of each."""
    d = tmp_path_factory.mktemp("enc")
    out = {}
    for kind, pooling, seed in (("bert", "mean", 1), ("nomic-bert", "mean", 2), ("bert", "cls", 3)):
        folder = d / f"{kind}-{pooling}"
        model, tok = make_encoder(kind, folder, seed=seed, pooling=pooling)
        out[kind, pooling] = {"folder": folder, "model": model, "tok": tok, "pooling": pooling,
                              "gguf": write_encoder_gguf(folder, d / f"{kind}-{pooling}.gguf"),
                              "f16": write_encoder_gguf(folder, d / f"{kind}-{pooling}-f16.gguf", f16=True)}
    return out


@pytest.mark.parametrize("key", [("bert", "mean"), ("nomic-bert", "mean"), ("bert", "cls")])
def test_vectors_and_tokens_match_transformers(encoders, key):
    from edgepaged.model.cpu.encoder import load_encoder
    e = encoders[key]
    ref = reference_embeddings(e["model"], e["tok"], TEXTS, e["pooling"])
    for source in ("folder", "gguf", "f16"):
        enc, tok = load_encoder(e[source])
        ids = [tok.encode(t) for t in TEXTS]
        assert ids == [e["tok"](t)["input_ids"] for t in TEXTS], source
        assert enc.cfg.pooling == e["pooling"]
        for text, v, r in zip(TEXTS, enc.embed([np.array(i) for i in ids]), ref):
            assert cosine(v, r) >= 0.9999, (source, text, cosine(v, r))


async def test_served_to_the_real_clients_and_a_langchain_retriever(encoders, tmp_path):
    import ollama
    import openai
    import trio
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_ollama import OllamaEmbeddings

    from edgepaged.model.cpu.encoder import EncoderRunner
    e = encoders["nomic-bert", "mean"]
    ref = reference_embeddings(e["model"], e["tok"], TEXTS)
    runner = EncoderRunner(e["gguf"], block_size=16)
    async with serving(runner, http=True) as server:
        base, model = server.http_base, server.front.model

        def clients():
            o = ollama.Client(host=base, timeout=60)
            oa = openai.OpenAI(base_url=base + "/v1", api_key="none")
            store = InMemoryVectorStore.from_texts(TEXTS, OllamaEmbeddings(model=model, base_url=base))
            hits = [store.as_retriever(search_kwargs={"k": 1}).invoke(t)[0].page_content for t in TEXTS]
            return {"ollama": o.embed(model=model, input=TEXTS).embeddings,
                    "openai": [d.embedding for d in oa.embeddings.create(model=model, input=TEXTS).data],
                    "short": oa.embeddings.create(model=model, input=TEXTS[0], dimensions=16).data[0].embedding,
                    "hits": hits}
        got = await trio.to_thread.run_sync(clients)
        status, _, body = await afetch(base + "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        gen_status, _, gen_body = await afetch(base + "/api/generate", {"model": model, "prompt": "hi"})
        long = " ".join(["kitchen lights"] * 100)        # 202 tokens with [CLS] and [SEP]; the context is 128
        cut_status, _, cut_body = await afetch(base + "/api/embed", {"model": model, "input": long})
        no_status, _, no_body = await afetch(base + "/api/embed", {"model": model, "input": long, "truncate": False})
        assert server.engine.stats()["kv_blocks_used"] == 0
    for door in ("ollama", "openai"):
        for text, v, r in zip(TEXTS, got[door], ref):
            assert cosine(v, r) >= 0.9999, (door, text)
            assert abs(np.linalg.norm(v) - 1) < 1e-5
    assert len(got["short"]) == 16 and abs(np.linalg.norm(got["short"]) - 1) < 1e-5
    assert got["hits"] == TEXTS                   # each document finds itself first
    import torch
    enc = e["tok"](long, truncation=True, max_length=128, return_tensors="pt")   # transformers' cut keeps [SEP]
    with torch.no_grad():
        want = e["model"](**enc).last_hidden_state[0].mean(0).numpy()
    assert cut_status == 200 and cosine(json.loads(cut_body)["embeddings"][0], want) >= 0.9999
    assert no_status == 400 and "truncate" in json.loads(no_body)["error"]
    assert status == 400 and "embedding model" in json.loads(body)["error"]["message"]
    assert gen_status == 400 and "embedding model" in json.loads(gen_body)["error"]


def test_a_chat_model_and_an_embedding_model_on_one_box(encoders, tiny, env):
    """`serve --model all` over a store holding a chat model and nomic-bert: both answer, the
    store lists the encoder with its architecture, /api/tags lists both."""
    import ollama

    from test_store import Serve, cli, models
    e = encoders["nomic-bert", "mean"]
    assert cli(env, "pull", str(tiny["llama"]), "--name", "chat").returncode == 0
    r = cli(env, "pull", str(e["gguf"]), "--name", "nomic")
    assert r.returncode == 0, r.stderr
    listed = {m["name"]: m for m in models(env)}
    assert listed["nomic"]["architecture"] == "nomic-bert" and listed["nomic"]["context"] == 128
    box = Serve(env, "--model", "all", "--kv-memory", "16M")
    try:
        c = ollama.Client(host=box.http, timeout=120)
        assert {"chat:latest", "nomic:latest"} <= {m.model for m in c.list().models}
        answer = c.chat(model="chat", messages=[{"role": "user", "content": "hello"}],
                        options={"num_predict": 4, "temperature": 0})
        vectors = c.embed(model="nomic", input=TEXTS[:2]).embeddings
        with pytest.raises(ollama.ResponseError) as refused:
            c.chat(model="nomic", messages=[{"role": "user", "content": "hello"}])
        # honest metadata (issue 65, item 2): an embedding model embeds only and says its quantization;
        # every listed model its file's time and its size in parameters; a request that waited for
        # its model's load after an unload says how long
        shown = c.show("nomic")
        tags = {m.model: m for m in c.list().models}
        chat_shown = c.show("chat")
        assert c.generate(model="chat", keep_alive=0).done_reason == "unload"
        assert "chat:latest" not in {m.model for m in c.ps().models}
        reloaded = c.chat(model="chat", messages=[{"role": "user", "content": "hello"}],
                          options={"num_predict": 2, "temperature": 0})
        warm = c.chat(model="chat", messages=[{"role": "user", "content": "hello"}],
                      options={"num_predict": 2, "temperature": 0})
    finally:
        box.stop()
    assert shown.capabilities == ["embedding"] and shown.details.quantization_level == "F32", shown
    assert tags["nomic:latest"].details.quantization_level == shown.details.quantization_level
    assert "completion" in chat_shown.capabilities and "embedding" not in chat_shown.capabilities
    for m in tags.values():
        assert m.modified_at.year >= 2025 and m.details.parameter_size, m
    assert reloaded.load_duration > 1e6 and reloaded.total_duration >= reloaded.load_duration, reloaded
    assert warm.load_duration == 0
    assert answer.message.content
    ref = reference_embeddings(e["model"], e["tok"], TEXTS[:2])
    assert all(cosine(v, r) >= 0.9999 for v, r in zip(vectors, ref))
    assert refused.value.status_code == 400 and "embedding model" in refused.value.error


from test_store import env, tiny  # noqa: E402,F401 - fixtures
