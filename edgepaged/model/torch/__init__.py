"""The torch runtime: the GPU path (Triton kernels) and the tests' reference (runner.py:
`ModelRunner`; llama.py: the torch decoder of every family; forward.py,
attention.py, layers.py, quant_modules.py, quant_threads.py)."""
