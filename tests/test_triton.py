"""Triton kernels: an ahead-of-time compile for sm_80 and sm_90, which catches what the permissive
interpreter accepts but the compiler rejects. Their results against the PyTorch path are checked in
test_fused_kernels.py (under TRITON_INTERPRET=1 on CPU tensors, set by conftest when no GPU is present)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from softtopk_fairseq.ops import triton_kernels as tk
from softtopk_fairseq.ops.kernel_interface import REFUSAL_BITS
from softtopk_fairseq.ops.solvers import (BACKWARD_KERNEL_CONSTANTS, KERNEL_CONSTANTS, SATURATION,
                                          UNSORTED_KERNEL_CONSTANTS)

FWD = {"x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32", "at_ptr": "*i64", "slope_ptr": "*fp32",
       "out_ptr": "*fp32", "info_ptr": "*fp32", "status_ptr": "*i32", "n": "i32", "k": "i32", "bound": "fp32",
       "tol": "fp32", "max_iter": "i32", "max_halvings": "i32", "anchor_top": "fp32", "epsilon": "fp32"}
BWD = {"out_ptr": "*fp32", "g_ptr": "*fp32", "x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32",
       "grad_ptr": "*fp32", "grad_eps_ptr": "*fp32", "n": "i32", "k": "i32"}
UFWD = {"x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32", "at_ptr": "*i64", "slope_ptr": "*fp32",
        "out_ptr": "*fp32", "info_ptr": "*fp32", "status_ptr": "*i32", "n": "i32", "k": "i32", "bound": "fp32",
        "tol": "fp32", "max_iter": "i32", "anchor_top": "fp32", "epsilon": "fp32"}
UBWD = {"out_ptr": "*fp32", "g_ptr": "*fp32", "x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32",
        "grad_ptr": "*fp32", "grad_eps_ptr": "*fp32", "n": "i32"}
TEMP = {"x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32", "at_ptr": "*i64", "slope_ptr": "*fp32",
        "n": "i32", "anchor_top": "fp32", "epsilon": "fp32"}
STATUS = {"SATURATION": SATURATION, **REFUSAL_BITS}
KERNELS = (  # kernel, signature, its flag (or None), constexprs
    (tk.soft_topk_forward_kernel, FWD, "PAPER", {**KERNEL_CONSTANTS, **STATUS, "MP": 8}),
    (tk.soft_topk_backward_kernel, BWD, "EPS_GRAD", {**BACKWARD_KERNEL_CONSTANTS, "MP": 8}),
    (tk.soft_topk_unsorted_forward_kernel, UFWD, "PAPER", {**UNSORTED_KERNEL_CONSTANTS, **STATUS}),
    (tk.soft_topk_unsorted_backward_kernel, UBWD, "EPS_GRAD", {}),
    (tk.paper_temperature_kernel, TEMP, None, {}))
for arch in map(int, sys.argv[1:]):
    for fn, sig, flag, extra in KERNELS:
        for has_mask, on in ((True, True), (False, False)):
            consts = {"HAS_MASK": has_mask, "BLOCK_N": 256, **extra, **({flag: on} if flag else {})}
            signature = dict(sig, **{name: "constexpr" for name in consts})
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32))
            print("compiled", fn.__name__, arch, has_mask, on)
"""


def test_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE, "80", "90"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("compiled") == 20


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error():
    code = ("import torch\nfrom softtopk_fairseq.ops import soft_topk\n"
            "try:\n    soft_topk(torch.randn(2, 5), 2, backend='triton')\n"
            "except ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "needs CUDA tensors" in out.stdout, out.stderr[-2000:]
