"""Triton kernels: an ahead-of-time compile for sm_80 and sm_90, which catches what the permissive
interpreter accepts but the compiler rejects. Their results against the PyTorch path are checked in
test_fused_kernels.py (under TRITON_INTERPRET=1 on CPU tensors, set by conftest when no GPU is present)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
from softtopk_fairseq.ops import backends  # noqa: E402

if backends.TRITON.usable() is not None:  # (older than the kernels support)
    pytest.skip(backends.TRITON.usable(), allow_module_level=True)


COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from softtopk_fairseq.ops import triton_kernels as tk
from softtopk_fairseq.ops.kernel_interface import CAPPED, REFUSAL_BITS
from softtopk_fairseq.ops.solvers import (BACKWARD_KERNEL_CONSTANTS, KERNEL_CONSTANTS, SATURATION,
                                          UNSORTED_KERNEL_CONSTANTS)

FWD = {"x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32", "at_ptr": "*i64", "slope_ptr": "*fp32",
       "out_ptr": "*fp32", "info_ptr": "*fp32", "status_ptr": "*i32", "n": "i32", "k": "i32", "bound": "fp32",
       "tol": "fp32", "max_iter": "i32", "max_halvings": "i32", "anchor_top": "fp32", "epsilon": "fp32"}
BWD = {"out_ptr": "*fp32", "g_ptr": "*fp32", "x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32",
       "at_ptr": "*i64", "slope_ptr": "*fp32", "grad_ptr": "*fp32", "grad_eps_ptr": "*fp32", "n": "i32", "k": "i32",
       "epsilon": "fp32"}
UFWD = {"x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32", "at_ptr": "*i64", "slope_ptr": "*fp32",
        "out_ptr": "*fp32", "info_ptr": "*fp32", "status_ptr": "*i32", "n": "i32", "k": "i32", "bound": "fp32",
        "tol": "fp32", "max_iter": "i32", "anchor_top": "fp32", "epsilon": "fp32"}
UBWD = {"out_ptr": "*fp32", "g_ptr": "*fp32", "x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32",
        "at_ptr": "*i64", "slope_ptr": "*fp32", "grad_ptr": "*fp32", "grad_eps_ptr": "*fp32", "n": "i32",
        "epsilon": "fp32"}
TEMP = {"x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32", "at_ptr": "*i64", "slope_ptr": "*fp32",
        "n": "i32", "anchor_top": "fp32", "epsilon": "fp32"}
SPLIT_START = {"x_ptr": "*fp32", "valid_ptr": "*i1", "eps_ptr": "*fp32", "at_ptr": "*i64", "slope_ptr": "*fp32",
               "state_ptr": "*fp32", "istate_ptr": "*i32", "n": "i32", "k": "i32", "bound": "fp32",
               "anchor_top": "fp32", "epsilon": "fp32"}
SPLIT_EVALUATE = {"x_ptr": "*fp32", "valid_ptr": "*i1", "state_ptr": "*fp32", "istate_ptr": "*i32",
                  "partial_ptr": "*fp32", "n": "i32", "bound": "fp32", "chunk": "i32"}
SPLIT_STEP = {"state_ptr": "*fp32", "istate_ptr": "*i32", "partial_ptr": "*fp32", "info_ptr": "*fp32",
              "status_ptr": "*i32", "parts": "i32", "tol": "fp32", "max_iter": "i32", "max_halvings": "i32"}
SPLIT_OUTPUT = {"x_ptr": "*fp32", "valid_ptr": "*i1", "state_ptr": "*fp32", "istate_ptr": "*i32", "out_ptr": "*fp32",
                "n": "i32", "k": "i32", "bound": "fp32", "chunk": "i32"}
STATUS = {"SATURATION": SATURATION, "CAPPED": CAPPED, **REFUSAL_BITS}
STEP = {name: KERNEL_CONSTANTS[name] for name in ("MAX_STEP", "NEAR_FLOOR", "SECOND_START_ERROR", "RIDGE_ULPS")}
# Each kernel's variants: the mask, and where the temperature comes from (per row, one number, the paper
# scaling's) -- in the backward with or without dL/deps, stored or added to dL/dx.
FORWARDS = ({"HAS_MASK": True, "PAPER": True, "EPS_PER_ROW": False},
            {"HAS_MASK": False, "PAPER": False, "EPS_PER_ROW": True},
            {"HAS_MASK": False, "PAPER": False, "EPS_PER_ROW": False})
BACKWARDS = ({"HAS_MASK": True, "EPS_PER_ROW": True, "EPS_GRAD": True, "PAPER": False},
             {"HAS_MASK": False, "EPS_PER_ROW": False, "EPS_GRAD": True, "PAPER": True},
             {"HAS_MASK": False, "EPS_PER_ROW": False, "EPS_GRAD": False, "PAPER": False})
KERNELS = (  # kernel, signature, variants, constexprs
    (tk.soft_topk_forward_kernel, FWD, FORWARDS, {**KERNEL_CONSTANTS, **STATUS, "MP": 8}),
    (tk.soft_topk_backward_kernel, BWD, BACKWARDS, {**BACKWARD_KERNEL_CONSTANTS, "MP": 8}),
    (tk.soft_topk_unsorted_forward_kernel, UFWD, FORWARDS, {**UNSORTED_KERNEL_CONSTANTS, **STATUS}),
    (tk.soft_topk_unsorted_backward_kernel, UBWD, BACKWARDS, {}),
    (tk.paper_temperature_kernel, TEMP, ({"HAS_MASK": True}, {"HAS_MASK": False}), {}),
    (tk.sorted_split_start_kernel, SPLIT_START, FORWARDS, {"MP": 8, "SATURATION": SATURATION, **REFUSAL_BITS}),
    (tk.sorted_split_evaluate_kernel, SPLIT_EVALUATE, ({"HAS_MASK": True}, {"HAS_MASK": False}),
     {"MP": 8, "LOGIT_CLAMP": KERNEL_CONSTANTS["LOGIT_CLAMP"]}),
    (tk.sorted_split_step_kernel, SPLIT_STEP, ({},), {"MP": 8, "CAPPED": CAPPED, **STEP}),
    (tk.sorted_split_output_kernel, SPLIT_OUTPUT, ({"HAS_MASK": True}, {"HAS_MASK": False}),
     {"MP": 8, "LOGIT_CLAMP": KERNEL_CONSTANTS["LOGIT_CLAMP"]}))
for arch in map(int, sys.argv[1:]):
    for fn, sig, variants, extra in KERNELS:
        for variant in variants:
            consts = {**({"BLOCK_N": 256} if "BLOCK_N" in fn.arg_names else {}), **extra, **variant}
            signature = dict(sig, **{name: "constexpr" for name in consts})
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32))
            print("compiled", fn.__name__, arch, variant)
"""


def test_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE, "80", "90"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("compiled") == 2 * (4 * 3 + 2 + 3 + 2 + 1 + 2)


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error():
    code = ("import torch\nfrom softtopk_fairseq.ops import soft_topk\n"
            "try:\n    soft_topk(torch.randn(2, 5), 2, backend='triton')\n"
            "except ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "needs CUDA tensors" in out.stdout, out.stderr[-2000:]
