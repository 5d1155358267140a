#!/usr/bin/env python3
"""Compile the Triton kernels for a CUDA target without a GPU (Triton ships ptxas).

Catches what the interpreter lets through (tl.dot minimum sizes, dtype mismatches, shared memory
overflows) on a CPU-only machine, and prints each kernel's shared memory, registers and spills.

    python bench/compile_check.py [--arch 90] [--dtype bf16]
"""
import argparse
import os
import re
import subprocess

os.environ.pop("TRITON_INTERPRET", None)  # compile for real
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from edgepaged.kernels import attention as A  # noqa: E402
from edgepaged.kernels import kv_cache as W  # noqa: E402
from edgepaged.kernels import norms as N  # noqa: E402
from edgepaged.kernels import quant as Q  # noqa: E402
from edgepaged.kernels import rope as R  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def build(fn, types, consts, target, num_warps=4, num_stages=2):
    """Compile fn: pointers and strides assumed 16-aligned as Triton specializes them at launch."""
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if n.endswith("_ptr") or (n.startswith("s_") and n != "s_os")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=target,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = subprocess.run([PTXAS, f"-arch=sm_{target.arch}{'a' if target.arch >= 90 else ''}", "-v", "-",
                            "-o", os.devnull], input=k.asm["ptx"], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", ptxas)
    spills = re.search(r"(\d+) bytes spill stores", ptxas)
    print(f"{fn.__name__:17s} shared {k.metadata.shared:6d} B  regs {regs and regs[1]}  spill {spills and spills[1]} B"
          f"  {', '.join(f'{a}={b}' for a, b in consts.items())}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    t = "*" + args.dtype
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    floats = dict(qk_scale="fp32")
    for D, G in [(128, 4), (64, 3), (128, 8)]:
        dc, pc = A.DECODE_CONFIG, A.PREFILL_CONFIG
        for splits in (1, 4):
            build(A._decode_kernel, dict(q_ptr=t, k_ptr=t, v_ptr=t, o_ptr="*fp32" if splits > 1 else t, lse_ptr="*fp32",
                                         bt_ptr="*i32", lens_ptr="*i32", **floats),
                  dict(G=G, G_PAD=16, D=D, BS=16, BLOCK_N=A._block_n(dc, dtype, D), NUM_SPLITS=splits,
                       USE_WINDOW=False, UPCAST=False), target, dc["num_warps"], dc["num_stages"])
        g_pad = triton.next_power_of_2(G)
        build(A._prefill_kernel, dict(q_ptr=t, k_ptr=t, v_ptr=t, o_ptr=t, bt_ptr="*i32", qsl_ptr="*i32",
                                      lens_ptr="*i32", **floats),
              dict(G=G, G_PAD=g_pad, D=D, BS=16, BLOCK_Q=max(pc["BLOCK_M"], 16, g_pad) // g_pad,
                   BLOCK_N=A._block_n(pc, dtype, D), B_PAD=8, USE_WINDOW=True, UPCAST=False),
              target, pc["num_warps"], pc["num_stages"])
    build(A._merge_kernel, dict(part_ptr="*fp32", lse_ptr="*fp32", o_ptr=t), dict(NUM_SPLITS=5, S_PAD=8, D=128), target)
    build(W._write_kv_kernel, dict(k_ptr=t, v_ptr=t, kc_ptr=t, vc_ptr=t, slot_ptr="*i64"), dict(BS=16, H_PAD=8, D=128),
          target)
    # GGUF weights kept quantized (kernels/quant.py): every format, the one-row and the tiled path
    for qt in Q.KEPT:
        wq = dict(codes_ptr="*i8" if qt == Q.Q8_0 else "*u8", scales_ptr="*fp16", mins_ptr="*fp16", sub_ptr="*u8",
                  sub_mins_ptr="*u8", high_ptr="*u8")
        for bm, bn in ((1, 32), (1, 128), (16, 64), (64, 64), (128, 128)):
            build(Q._qmatmul_kernel, dict(x_ptr=t, out_ptr=t, **wq),
                  dict(QT=qt, BLOCK_M=bm, BLOCK_N=bn, UNROLL=8 if bm == 1 else 1), target)
        build(Q._qgather_kernel, dict(ids_ptr="*i64", out_ptr=t, **wq), dict(QT=qt, BLOCK_T=16), target)
    build(R._rope_write_kv_kernel, dict(qkv_ptr=t, cos_ptr=t, sin_ptr=t, slot_ptr="*i64", q_ptr=t, kc_ptr=t,
                                        vc_ptr=t), dict(D=128, H_PAD=32, HKV_PAD=8, BS=16), target)
    build(N._add_rms_norm_kernel, dict(h_ptr=t, x_ptr=t, w_ptr=t, out_ptr=t, eps="fp32"), dict(BLOCK=4096), target)


if __name__ == "__main__":
    main()
