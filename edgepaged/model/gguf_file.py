"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

gguf-py's `GGUFReader` builds a numpy view for every part of every field: a 49k-token
vocabulary with its merges takes it ~6 s. This reads the same header with `struct` in
~0.1 s and maps the tensors' bytes lazily. Little-endian GGUF, versions 2 and 3.

    f = GgufFile(path)
    f.fields["general.architecture"]   # python values: str, int, float, bool, lists
    for t in f.tensors: t.name, t.tensor_type, t.shape, t.n_bytes, t.data_offset, t.data
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format (scalars); 8 is a string, 9 an array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
         10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
# tensor element types kept as typed arrays (the rest are block formats: bytes per row)
ELEMENTS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GgufError(ValueError):
    """The bytes are not a GGUF file this reader can take (with the reason)."""


@dataclass
class GgufTensor:
    name: str
    tensor_type: object          # gguf.GGMLQuantizationType
    shape: np.ndarray            # GGUF's order: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int             # from the start of the file
    _file: "GgufFile" = field(repr=False, default=None)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, mapped (not copied): typed [outer .. inner] for element
        types, uint8 [outer .., bytes per row] for block formats (as gguf-py gives them)."""
        dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        kind = int(self.tensor_type)
        if kind in ELEMENTS:
            dtype, count = ELEMENTS[kind], self.n_elements
        else:
            from gguf.constants import GGML_QUANT_SIZES
            block, size = GGML_QUANT_SIZES[self.tensor_type]
            dtype, count = np.uint8, self.n_bytes
            dims = (*dims[:-1], dims[-1] // block * size)
        return np.frombuffer(self._file._map, dtype, count, self.data_offset).reshape(dims)


class GgufFile:
    def __init__(self, path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:                       # an empty file cannot be mapped
                raise GgufError("the file is empty") from None
        self.size = len(self._map)
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GgufError(f"the header ends early or is damaged ({type(e).__name__}: {e})") from None

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != MAGIC:
            raise GgufError(f"it does not start with {MAGIC!r} (it starts with {bytes(buf[:4])!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0 and version:
            raise GgufError("big-endian GGUF files are not supported")
        if version not in VERSIONS:
            raise GgufError(f"GGUF version {version}: this reader takes versions {VERSIONS}")
        self.version = version
        n_tensors, n_fields = struct.unpack_from("<QQ", buf, 8)
        self._off = 24
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._str()
            (kind,) = struct.unpack_from("<I", buf, self._off)
            self._off += 4
            self.fields[key] = self._value(kind)
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            (n_dims,) = struct.unpack_from("<I", buf, self._off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._off + 4)
            kind, offset = struct.unpack_from("<IQ", buf, self._off + 4 + 8 * n_dims)
            self._off += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, offset))
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GgufError(f"general.alignment {align!r} is not a power of two")
        self.data_offset = -(-self._off // align) * align
        self.tensors: list[GgufTensor] = []
        seen = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise GgufError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise GgufError(f"tensor {name!r} has an unknown type {kind}") from None
            n = int(np.prod(dims)) if dims else 1
            block, size = GGML_QUANT_SIZES[qtype]
            self.tensors.append(GgufTensor(name, qtype, np.array(dims, np.uint64), n, n * size // block,
                                           self.data_offset + offset, self))
        # a model file with its vision tower inside (Ollama's single-file Gemma 3, Qwen2.5-VL):
        # the tower's tensors (v.*) and projector's (mm.*) apart from the text model's, which the
        # loaders read (model/vision.py reads these)
        self.vision_tensors: list[GgufTensor] = []
        if self.fields.get("general.architecture") != "clip":
            self.vision_tensors = [t for t in self.tensors if t.name.startswith(("v.", "mm."))]
            if self.vision_tensors:
                self.tensors = [t for t in self.tensors if not t.name.startswith(("v.", "mm."))]

    def _str(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._off)
        start = self._off + 8
        if start + n > self.size:
            raise IndexError("a string runs past the end of the file")
        self._off = start + n
        return self._map[start:start + n].decode("utf-8")

    def _value(self, kind: int):
        buf = self._map
        if kind == STRING:
            return self._str()
        if kind in SCALARS:
            fmt = "<" + SCALARS[kind]
            (v,) = struct.unpack_from(fmt, buf, self._off)
            self._off += struct.calcsize(fmt)
            return v
        if kind == ARRAY:
            sub, n = struct.unpack_from("<IQ", buf, self._off)
            self._off += 12
            if sub in NUMPY:
                width = np.dtype(NUMPY[sub]).itemsize
                if self._off + n * width > self.size:
                    raise IndexError("an array runs past the end of the file")
                v = np.frombuffer(buf, NUMPY[sub], n, self._off).tolist()
                self._off += n * width
                return v
            return [self._value(sub) for _ in range(n)]
        raise GgufError(f"unknown metadata value type {kind}")

    def close(self) -> None:
        self._map.close()
