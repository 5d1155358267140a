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
