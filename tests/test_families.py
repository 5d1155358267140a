"""Every family edgepaged runs (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3) against
transformers: tiny random models from each family's config class with its quirks on
(soft-capping, sliding windows shorter than the prompt, q/k norms, local and global rotary
tables, LongRoPE), saved as safetensors and written as GGUF with llama.cpp's names; logits on
the Rust CPU path, the torch path and the Triton kernels (interpreted on CPU); greedy
answers; the families' tokenizers and real chat templates; serving with their stop tokens."""
import json
import os
import subprocess
import urllib.request

import numpy as np
import pytest
import torch

from edgepaged.model import ModelRunner, families
from edgepaged.model.families.llama import Llama
from edgepaged.model.cpu.runner import CpuRunner
from edgepaged.model.torch.forward import TorchForward
from edgepaged.model.loader import ModelFileError, ModelFiles
from edgepaged.model.settings import CpuConfig
from edgepaged.model.tokenizer import Tokenizer
from edgepaged.testing.families import (FAMILIES, MULTILINGUAL, family, make_family_model, write_family_gguf)

from test_cli import CLI, ROOT, SERVE_ARGS, ServeProcess
from test_model import Paged

NEW = ("qwen3", "gemma2", "gemma3", "phi3")
_BUILT = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (HF folder, GGUF path, transformers model), each built once."""
    def get(name):
        if name not in _BUILT:
            folder = tmp_path_factory.mktemp(name) / name
            hf = make_family_model(folder, name)
            _BUILT[name] = folder, write_family_gguf(folder, folder.parent / f"{name}.gguf", hf), hf
        return _BUILT[name]
    return get


def _prompt(hf, n=40, seed=1):
    return torch.randint(0, hf.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(src, **kw) -> ModelRunner:
    """The torch runner (the GPU path and the reference) on the CPU, float32 K/V."""
    r = ModelRunner(src, num_blocks=32, kv_dtype="f32", **kw)
    assert r.forward.name.startswith("torch")
    return r


def _paged_logits(r: ModelRunner, tokens: list[int], prefill: int) -> torch.Tensor:
    """A prefill of the first `prefill` tokens (every row's logits), then one decode step per token."""
    paged = Paged(r.num_blocks, r.block_size, seed=5)
    ids, pos, meta = paged.batch([(0, tokens[:prefill])])
    got = [r.execute(ids, pos, meta, list(range(prefill)))]
    for t in tokens[prefill:]:
        ids, pos, meta = paged.batch([(0, [t])])
        got.append(r.execute(ids, pos, meta))
    return torch.cat([torch.as_tensor(np.asarray(g)) for g in got])


# ---------------------------------------------------------------- logits and greedy answers

def _check_40_tokens(r, hf) -> torch.Tensor:
    """A 30-token prefill and 10 decode steps on runner r, within 1e-3 of transformers."""
    tokens = _prompt(hf)
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = _paged_logits(r, tokens, 30)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-3
    return got


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, source, built):
    """40 tokens (a 30-token prefill, then 10 decode steps): past every sliding window (8)
    and, for phi3, past the original context (32), so LongRoPE runs its long factors."""
    folder, gguf, hf = built(name)
    r = _runner(folder if source == "safetensors" else gguf)
    assert r.config.arch == ("llama" if name == "mistral" and source == "gguf" else name)
    _check_40_tokens(r, hf)


@pytest.mark.parametrize("source", ["gguf", "safetensors"])
@pytest.mark.parametrize("attention", ["rows", "tiles"])
@pytest.mark.parametrize("name", FAMILIES)
def test_cpu_runtime_logits_match_transformers(name, attention, source, built):
    """The torch-free CPU runtime (numpy + Rust, every prefill row attending in Rust over the
    paged cache, row by row or in paged_prefill's tiles of rows) on each family's GGUF file
    and on its safetensors folder (read without torch): the same 40 tokens as above; and
    against the torch runner's logits."""
    folder, gguf, hf = built(name)
    settings = CpuConfig(rust_attention_max=0 if attention == "tiles" else CpuConfig().rust_attention_max)
    got = _check_40_tokens(CpuRunner(gguf if source == "gguf" else folder, num_blocks=32, kv_dtype="f32",
                                     settings=settings), hf)
    torch_path = _paged_logits(_runner(gguf), _prompt(hf), 30)
    assert (got - torch_path).abs().max().item() <= 1e-4


def test_cpu_runtime_reads_a_bf16_checkpoint_and_refuses_what_it_cannot(built, tmp_path):
    """A bf16 safetensors folder is widened to float32 exactly (the logits of transformers with
    the same bf16-rounded weights); a tensor type it does not read and a truncated file are
    refused, naming the file, before anything runs."""
    import shutil

    from safetensors.torch import save_file

    from edgepaged.model.loader import ModelFileError
    folder, _, hf = built("qwen3")
    bf16 = tmp_path / "bf16"
    shutil.copytree(folder, bf16, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(bf16 / "model.safetensors"))
    import copy
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for p in rounded.parameters():          # the same weights as the file holds them
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    _check_40_tokens(CpuRunner(bf16, num_blocks=32, kv_dtype="f32"), rounded)
    ints = tmp_path / "ints"
    shutil.copytree(folder, ints, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: (v * 0).to(torch.int8) for k, v in hf.state_dict().items()}, str(ints / "model.safetensors"))
    with pytest.raises(ModelFileError, match="is I8: the CPU runtime reads F32, F16, BF16"):
        CpuRunner(ints, num_blocks=32)
    cut = tmp_path / "cut"
    shutil.copytree(bf16, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelFileError, match="do not match its shape"):
        CpuRunner(cut, num_blocks=32)
    import json as _json
    for header, says in (({"w": {"dtype": "F32"}}, "not a safetensors entry"), ([1, 2], "not a map"),
                         ({"w": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 0]}}, "do not match its shape")):
        text = _json.dumps(header).encode()
        (cut / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text)
        with pytest.raises(ModelFileError, match=says):
            CpuRunner(cut, num_blocks=32)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3"])
def test_cpu_runtime_on_quantized_files_equals_the_torch_runner(name, built, tmp_path):
    """Q8_0 weights kept as GGUF blocks: the torch-free runtime gives the torch runner's
    logits (qwen2: the one-call decoder with attention biases; the others layer by layer
    with their quirks), on the prefill and the decode steps."""
    folder, _, hf = built(name)
    path = write_family_gguf(folder, tmp_path / f"{name}-q8.gguf", hf, qtype=8)
    cpu = CpuRunner(path, num_blocks=32, kv_dtype="f32")
    assert cpu.quantized and (cpu.model.decoder is not None) == (name == "qwen2")
    ref = _runner(path)
    tokens = _prompt(hf)
    got, want = _paged_logits(cpu, tokens, 30), _paged_logits(ref, tokens, 30)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("runtime", ["torch", "cpu"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_32_tokens_equal_transformers(name, runtime, built):
    folder, gguf, hf = built(name)
    r = (ModelRunner if runtime == "torch" else CpuRunner)(gguf, num_blocks=32, kv_dtype="f32")
    prompt = _prompt(hf, 36, seed=2)    # past the windows and phi3's original context
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                       pad_token_id=0)[0, len(prompt):].tolist()
    paged, got = Paged(r.num_blocks, r.block_size), []
    ids, pos, meta = paged.batch([(0, prompt)])
    for _ in range(32):
        got.append(int(r.execute(ids, pos, meta)[0].argmax()))
        ids, pos, meta = paged.batch([(0, [got[-1]])])
    assert got == want


def test_phi3_short_factors_inside_the_original_context(built):
    """A server whose context fits phi3's original one (32 positions) rotates with the short
    LongRoPE factors, as transformers does for sequences that short."""
    folder, gguf, hf = built("phi3")
    r = ModelRunner(gguf, num_blocks=2, kv_dtype="f32")      # 2 blocks of 16: a 32-token context
    assert r.max_model_len == 32
    tokens = _prompt(hf, 30, seed=3)
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (_paged_logits(r, tokens, 20) - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("name", NEW)
def test_triton_kernels_run_the_family(name, built):
    """The GPU path's attention (Triton, interpreted on CPU): per-layer windows, the score
    scale, gemma2's soft-capping, on a prefill batch and decode steps."""
    pytest.importorskip("triton")
    from edgepaged import kernels
    from edgepaged.model.torch.attention import backend_for
    if not kernels.is_available():
        pytest.skip("Triton has neither a GPU nor the interpreter here (conftest.py sets TRITON_INTERPRET=1)")
    folder, gguf, hf = built(name)
    r = _runner(folder)
    r.forward = TorchForward(r.model, backend_for("cuda", r.config, r.block_size, r.dtype), r.kv_cache)
    assert "Triton" in r.forward.name
    tokens = _prompt(hf, 36)   # past phi3's original context: transformers' long factors, as ours
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (_paged_logits(r, tokens, 33) - ref).abs().max().item() <= 1e-3


# ---------------------------------------------------------------- tokenizers and templates

CHATS = {
    "user": [{"role": "user", "content": "hello world, how are you?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße! 你好"}],
    "turns": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
              {"role": "user", "content": "the quick brown fox"}],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]


def _render(tok, messages, **kw):
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    except Exception as e:     # the template's own raise_exception: both must refuse alike
        return f"error: {e}"


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_template_renders_like_transformers(name, built):
    from transformers import AutoTokenizer
    folder, gguf, hf = built(name)
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    ours = {"gguf": Tokenizer.load(gguf), "folder": Tokenizer.load(folder)}
    cases = [(m, {}) for m in CHATS.values()]
    if name == "qwen3":
        cases.append((CHATS["user"], {"tools": TOOLS}))
        cases.append((CHATS["user"], {"enable_thinking": False}))
    for messages, kw in cases:
        want = _render(hf_tok, messages, **kw)
        for where, tok in ours.items():
            got = _render(tok, messages, **kw)
            assert got == want, (where, messages, kw)
            if not want.startswith("error"):
                assert tok.apply_chat_template(messages, **kw) == hf_tok(want, add_special_tokens=False)["input_ids"]
    if name == "gemma2":    # its template refuses a system message: it said so, through ours too
        assert _render(ours["gguf"], CHATS["system"]).startswith("error: System role not supported")
    if name == "qwen3":
        assert "get_weather" in _render(ours["gguf"], CHATS["user"], tools=TOOLS)


@pytest.mark.parametrize("name", FAMILIES)
def test_tokenizer_from_gguf_equals_tokenizers(name, built):
    """The GGUF's vocabulary (SentencePiece with byte fallback, or byte-level BPE with the
    family's pre-tokenizer) tokenizes a multilingual string as `tokenizers` does from the same
    vocabulary (tokenizer.json, for the SentencePiece ones converted by transformers)."""
    from tokenizers import Tokenizer as HFTokenizer
    folder, gguf, hf = built(name)
    ref = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok = Tokenizer.load(gguf)
    for text in (MULTILINGUAL, "hello world", " leading space", "<start_of_turn>user\nhi<|im_end|>"):
        want = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.decode(want) == ref.decode(want, skip_special_tokens=False), text
    fam = family(name)
    assert tok.tok.token_to_id(fam.end_of_turn) in tok.stop_token_ids
    assert Tokenizer.load(folder).tok.token_to_id(fam.end_of_turn) in Tokenizer.load(folder).stop_token_ids
    bos = tok.encode("hi")[0] == tok.bos_token_id
    assert bos == fam.add_bos


# ---------------------------------------------------------------- a family of the test's own

class Tinycap(Llama):
    """A family defined only here, a variant of llama: llama's tensors and metadata keys, a
    GELU-tanh MLP, attention scores soft-capped at the file's attn_logit_softcapping (2 when
    absent) and logits at 3. Nothing of it is in edgepaged/: the family file's hooks are the
    extension point."""
    name = "tinycap"

    def gguf_config(self, key, tensors, base):
        return {"attn_softcap": key("attn_logit_softcapping", 2.0), "final_softcap": 3.0}

    def layer(self, cfg, i):
        return families.pre_norm_layer(window=cfg.window(i), softcap=cfg.attn_softcap, activation="gelu_tanh")


@pytest.fixture
def tinycap():
    fam = families.register(Tinycap)
    yield fam
    families.unregister(fam.name)


def test_a_family_defined_in_a_test_runs_on_the_cpu_runtime_and_the_torch_reference(tinycap, built, tmp_path):
    """Registered from this file, written as a GGUF file under its own architecture name: the
    CPU runtime (numpy + Rust, layer by layer) and the torch reference give the same
    logits within 1e-4, and they are not llama's."""
    folder, llama_gguf, hf = built("llama")
    path = write_family_gguf(folder, tmp_path / "tinycap.gguf", hf, arch="tinycap")
    cpu = CpuRunner(path, num_blocks=32, kv_dtype="f32")
    spec = cpu.config.layer(1)
    assert cpu.config.arch == "tinycap" and spec.mlp.activation == "gelu_tanh" and spec.attention.softcap == 2.0
    assert cpu.model.decoder is None          # not llama's block: the one-call decoder stays out
    tokens = _prompt(hf)
    got = _paged_logits(cpu, tokens, 30)
    want = _paged_logits(_runner(path), tokens, 30)
    assert (got - want).abs().max().item() <= 1e-4
    assert got.abs().max().item() <= 3.0      # the family's logit cap
    llama = _paged_logits(CpuRunner(llama_gguf, num_blocks=32, kv_dtype="f32"), tokens, 30)
    assert (got - llama).abs().max().item() > 1e-2
    families.unregister("tinycap")
    with pytest.raises(ModelFileError, match="'tinycap'"):
        ModelFiles(path)


# ---------------------------------------------------------------- refused clearly

def test_unsupported_architecture_and_tensor_type_are_refused(tmp_path, built):
    import gguf
    folder, path, hf = built("qwen3")
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    with pytest.raises(ModelFileError, match="'falcon'.*gemma2, gemma3, llama, mistral, phi3, qwen2, qwen2vl, qwen25vl, qwen3"):
        ModelFiles(tmp_path / "falcon.gguf")
    # a tensor in a type without a kernel here (IQ4_XS): named, with what runs
    from gguf.gguf_reader import GGUFReader
    src = GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "qwen3")
    for field in src.fields.values():
        if field.name.startswith(("qwen3.", "tokenizer.")):
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        if t.name == "blk.0.ffn_down.weight":
            raw = np.zeros((t.shape[1], t.shape[0] // 256 * 136), np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
        else:
            w.add_tensor(t.name, np.array(t.data))
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    with pytest.raises(ModelFileError, match=r"blk\.0\.ffn_down\.weight is IQ4_XS.*Q4_K"):
        ModelFiles(tmp_path / "iq.gguf")
    # and the CLI says it in one line, no traceback
    r = subprocess.run([*CLI, "serve", "--model", str(tmp_path / "iq.gguf"), *SERVE_ARGS], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "IQ4_XS" in r.stderr and "Traceback" not in r.stderr + r.stdout
    # partial rotary (Phi-4-mini) from a Hugging Face folder
    cfg = json.loads((folder / "config.json").read_text())
    part = tmp_path / "partial"
    part.mkdir()
    (part / "config.json").write_text(json.dumps(dict(cfg, model_type="phi3", partial_rotary_factor=0.75)))
    with pytest.raises(ValueError, match="partial rotary"):
        ModelFiles(part)


# ---------------------------------------------------------------- serving

STOP_CHAT = [{"role": "user", "content": "hello world"}]


@pytest.mark.parametrize("name,source", [(n, "gguf") for n in FAMILIES] + [("qwen3", "safetensors")])
def test_serve_answers_and_stops_on_the_family_turn_token(name, source, tmp_path):
    """`edgepaged serve --model` on a tiny F16 GGUF of the family (kept as it is, on the CPU's
    block kernels), or on its safetensors folder (the CPU runtime too, widened to float32),
    whose end-of-turn token ends
    a greedy answer after a few tokens: the protocol's answer and the OpenAI API's stop there
    (finish_reason "stop"), without the token's text."""
    folder = tmp_path / name
    hf = make_family_model(folder, name, seed=1, stop_prompt=STOP_CHAT)
    path = write_family_gguf(folder, tmp_path / f"{name}.gguf", hf, qtype=1) if source == "gguf" else folder
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEPAGED_TOKEN", "EDGEPAGED_RUNTIME")}
    s = ServeProcess([*CLI, "serve", "--model", str(path), *SERVE_ARGS], env=env)
    try:
        m = s.wait_for(r"ready on ([\d.]+):(\d+)", timeout=120)
        assert any("numpy + Rust" in line for line in s.lines), "".join(s.lines)   # the CPU runtime, both formats
        http = s.wait_for(r"HTTP \(OpenAI API, chat page\) (http://127\.0\.0\.1:\d+)/", timeout=10).group(1)
        eot = family(name).end_of_turn
        r = subprocess.run([*CLI, "ask", "--server", f"{m.group(1)}:{m.group(2)}", "--json", "--max-tokens", "64",
                            "--repeat-penalty", "1", STOP_CHAT[0]["content"]], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["finish_reason"] == "stop" and out["usage"]["completion_tokens"] < 64, out
        assert eot not in out["text"]
        req = urllib.request.Request(f"{http}/v1/chat/completions", json.dumps(
            {"model": name, "messages": STOP_CHAT, "max_tokens": 64, "temperature": 0}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = json.loads(resp.read())
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < 64, body
        assert choice["message"]["content"] == out["text"] and eot not in choice["message"]["content"]
    finally:
        s.proc.kill()
        s.proc.wait()


def test_explicit_attention_equals_sdpa():
    """The soft-capping path's attention (scores in the open, a few query rows at a time)
    without a cap equals SDPA: GQA, a boolean mask, top-left causal, an additive bias."""
    import torch.nn.functional as F

    from edgepaged.model.torch.attention import explicit_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 70, 16, generator=g), torch.randn(2, 90, 16, generator=g), torch.randn(2, 90, 16, generator=g)
    mask = torch.rand(70, 90, generator=g) > 0.3
    mask[:, 0] = True
    for m, causal in ((mask, False), (None, True), (torch.where(mask, 0.0, float("-inf")), False)):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=0.3, enable_gqa=True)
        got = explicit_attention(q, k, v, m, causal, 0.3, None, rows=16)
        assert (got - want).abs().max().item() < 1e-5
    capped = explicit_attention(q, k, v, None, True, 0.3, 0.5, rows=16)
    assert (capped - explicit_attention(q, k, v, None, True, 0.3, None)).abs().max().item() > 1e-2
