"""Helpers the tests and the benchmarks share (imported as `edgepaged.testing.*`, never by
the runtime): tiny models written in the real file formats, random GGUF files, the household
workloads, and a plain-Python reference of the block allocator.

- `tiny_models`: tiny random transformers models saved as safetensors + tokenizer.json;
- `gguf_models`: random llama GGUF files in chosen block formats;
- `workloads`: the household request mix and its arrival patterns;
- `alloc_reference`: the block allocator's contract in plain Python (property tests, alloc_bench).

They need the `test` extra (torch, transformers) where they build models.
"""
