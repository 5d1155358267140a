"""Our GGUF header reader (edgepaged/model/gguf_file.py) against gguf-py's on real files,
and on damaged ones."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from edgepaged.model.gguf_file import GgufError, GgufFile
from edgepaged.model.loader import ModelFileError, default_model_path, open_gguf
from edgepaged.testing.gguf_models import write_random_gguf


def same_as_gguf_py(path) -> None:
    ours, theirs = GgufFile(path), GGUFReader(str(path))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == want and list(ours.fields) == list(want)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_elements, b.n_bytes,
                                                                           b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_the_embedded_model_and_a_k_quant_file_read_as_gguf_py_reads_them(tmp_path):
    same_as_gguf_py(default_model_path())      # 49k-token vocabulary and merges, Q4_1, Q8_0, F32
    path = write_random_gguf(tmp_path / "k.gguf", hidden=256, layers=1, heads=4, kv_heads=2, inter=512,
                             qtypes=dict(token_embd=14, output=30, attn_q=12, attn_k=13, attn_v=6, attn_output=7,
                                         ffn_gate=1, ffn_up=8, ffn_down=3), tied=False)
    same_as_gguf_py(path)                      # every format the kernels read, BF16 and F16 among them


def test_a_synthetic_file_holds_what_llama_cpp_asks_for_and_gpu_bench_says_why_it_has_no_llama_cpp(
        tmp_path, monkeypatch):
    """The synthetic files the benchmarks write (bench/gpu_bench.py's Llama-shaped ones) are
    read by llama.cpp's llama-bench beside edgepaged: its BPE vocabulary must hold merges (it
    refuses one without: "cannot find tokenizer merges"), and its byte tokens load in our own
    tokenizer. Without llama.cpp's build, gpu_bench's llama_cpp_* figures are null and its
    note says why."""
    from bench.gpu_bench import llama_cpp
    from edgepaged.model.tokenizer import Tokenizer
    path = write_random_gguf(tmp_path / "s.gguf", hidden=64, layers=1, heads=2, kv_heads=1, inter=96,
                             qtypes=dict.fromkeys(("token_embd", "attn_q", "attn_k", "attn_v", "attn_output",
                                                   "ffn_gate", "ffn_up", "ffn_down"), 0), vocab=300)
    f = GgufFile(path)
    assert f.fields["tokenizer.ggml.merges"] == ["\u0120 \u0120"] and len(f.fields["tokenizer.ggml.tokens"]) == 300
    tok = Tokenizer.load(path)
    assert tok.decode(tok.encode("a  b")) == "a  b"
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    res = llama_cpp(path, 4, 16)
    assert res["llama_cpp_tok_s_b1"] is None and res["llama_cpp_prefill_tok_s"] is None
    assert "not carried" in res["llama_cpp_note"] and "bench/llama_cuda.sh" in res["llama_cpp_note"]
    monkeypatch.setenv("LLAMA_BENCH", str(tmp_path / "missing" / "llama-bench"))
    res = llama_cpp(path, 4, 16)
    assert res["llama_cpp_tok_s_b1"] is None and res["llama_cpp_note"].startswith("llama-bench did not run")


def test_damaged_files_give_one_clear_error(tmp_path):
    src = default_model_path().read_bytes()
    cases = {"empty": b"", "not gguf": b"PK\x03\x04" + src[4:4096], "cut in the vocabulary": src[:200_000],
             "cut in the header": src[:30], "version 9": src[:4] + (9).to_bytes(4, "little") + src[8:4096]}
    for what, data in cases.items():
        p = tmp_path / "bad.gguf"
        p.write_bytes(data)
        with pytest.raises(GgufError):
            GgufFile(p)
        with pytest.raises(ModelFileError, match="not a readable GGUF file") as e:
            open_gguf(p)
        assert "bad.gguf" in str(e.value) and "\n" not in str(e.value), what
    with pytest.raises(ModelFileError, match="truncated"):   # the header whole, tensors cut
        p.write_bytes(src[: len(src) // 2])
        open_gguf(p)
