"""The CPU runtime: numpy and the Rust kernels, no torch (runner.py: `CpuRunner`, a GGUF file
or a safetensors folder; encoder.py: the embedding models)."""
