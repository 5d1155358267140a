"""Torch's threads beside the kernels' own pool, and the fp32 path for long prefills.

Two pools on the same cores fight: an OpenMP worker that spins after torch's last op holds
the core a kernel helper needs. A forward over quantized weights therefore runs torch on one
thread (`kernel_threads_only`), and the few torch calls that do the heavy work themselves
(a long prefill's GEMM, SDPA over a long context) get torch's threads back for their
duration (`all_torch_threads`).
"""
from __future__ import annotations

import threading

import torch

_local = threading.local()
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_REORDER = _ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class torch_threads:
    """Set torch's intra-op thread count for a block (None: leave it)."""

    def __init__(self, n: int | None):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        if self.n is not None and self.n != self.saved:
            torch.set_num_threads(self.n)
        return self.saved

    def __exit__(self, *exc):
        if torch.get_num_threads() != self.saved:
            torch.set_num_threads(self.saved)


class kernel_threads_only:
    """Torch on one thread for a block while the kernels' pool does the parallel work;
    `active=False` leaves torch alone."""

    def __init__(self, active: bool):
        self.active = active

    def __enter__(self):
        if self.active:
            self._t = torch_threads(1)
            _local.saved_threads = self._t.__enter__()

    def __exit__(self, *exc):
        if self.active:
            _local.saved_threads = None
            self._t.__exit__(*exc)


def all_torch_threads() -> torch_threads:
    """Inside `kernel_threads_only`: torch's own thread count back for a block."""
    return torch_threads(_local.__dict__.get("saved_threads"))


def scratch(n: int) -> torch.Tensor:
    """A per-thread fp32 buffer of at least n elements, reused between calls."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _local.buf = torch.empty(n)
    return buf[:n]


def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T on all of torch's threads; oneDNN where torch has it (MKL's sgemm is several
    times slower on AMD CPUs), the weight re-laid out for it first."""
    with all_torch_threads():
        if _ONEDNN:
            if _REORDER:
                w = torch.ops.mkldnn._reorder_linear_weight(w)
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return torch.mm(x, w.t())
