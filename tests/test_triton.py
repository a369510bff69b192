"""Triton kernels against the PyTorch path: under TRITON_INTERPRET=1 on CPU tensors (set by conftest when
no GPU is present), or on the GPU when there is one; plus an ahead-of-time compile for sm_80 and sm_90,
which catches what the permissive interpreter accepts but the compiler rejects."""
import os
import subprocess
import sys

import pytest
import torch

from softtopk_fairseq.ops import soft_topk

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)


def _both(x, k, **kw):
    """(triton output, torch output, triton info, torch info) for the same call."""
    a, ia = soft_topk(x, k, backend="triton", return_info=True, **kw)
    b, ib = soft_topk(x, k, backend="torch", return_info=True, **kw)
    return a, b, ia, ib


@pytest.mark.parametrize("sorted", [False, True])
@pytest.mark.parametrize("epsilon, scaling", [(1.0, "none"), (0.1, "none"), (0.01, "none"), (0.1, "paper")])
def test_forward_matches_torch_path(sorted, epsilon, scaling):
    torch.manual_seed(0)
    x = torch.randn(4, 37, device=DEVICE)
    a, b, ia, ib = _both(x, 5, epsilon=epsilon, sorted=sorted, scaling=scaling)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert bool(ia.converged.all()) and bool(ib.converged.all())
    assert ia.iterations.max() <= 20


@pytest.mark.parametrize("sorted", [False, True])
def test_masks_short_and_empty_rows(sorted):
    torch.manual_seed(1)
    x = torch.randn(5, 9, device=DEVICE)
    mask = torch.ones(5, 9, dtype=torch.bool, device=DEVICE)
    mask[0, :3] = False
    mask[1, :7] = False   # 2 valid < k
    mask[2] = False       # empty
    x[3, 4] = -torch.inf
    a, b, _, _ = _both(x, 3, epsilon=0.4, sorted=sorted, mask=mask)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert bool((a[~mask] == 0).all()) and bool(torch.isfinite(a).all())


@pytest.mark.parametrize("sorted", [False, True])
def test_backward_matches_torch_path(sorted):
    torch.manual_seed(2)
    x = torch.randn(4, 23, device=DEVICE)
    mask = torch.rand(4, 23, device=DEVICE) > 0.2
    mask[3, 1:] = False  # a short row
    w = torch.randn(4, 23, 4, device=DEVICE) if sorted else torch.randn(4, 23, device=DEVICE)
    grads = []
    for backend in ("triton", "torch"):
        xg = x.clone().requires_grad_()
        (soft_topk(xg, 4, epsilon=0.3, sorted=sorted, mask=mask, backend=backend, scaling="paper") * w).sum().backward()
        grads.append(xg.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=2e-5, rtol=1e-4)


def test_long_rows_stream_in_several_blocks():
    torch.manual_seed(3)
    x = torch.randn(2, 3000, device=DEVICE)
    a, b, _, _ = _both(x, 5, epsilon=0.05, sorted=True)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_float64_is_refused_by_the_triton_backend():
    with pytest.raises(ValueError, match="float32"):
        soft_topk(torch.randn(2, 5, dtype=torch.float64, device=DEVICE), 2, backend="triton")


COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from softtopk_fairseq.ops import triton_kernels as tk

FWD = {"u_ptr": "*fp32", "valid_ptr": "*i1", "tz_ptr": "*fp32", "shift_ptr": "*fp32", "c_ptr": "*fp32",
       "mact_ptr": "*i32", "out_ptr": "*fp32", "info_ptr": "*fp32", "n": "i32", "k": "i32", "tol": "fp32",
       "max_iter": "i32", "max_halvings": "i32"}
BWD = {"out_ptr": "*fp32", "g_ptr": "*fp32", "valid_ptr": "*i1", "y_ptr": "*fp32", "mact_ptr": "*i32",
       "restc_ptr": "*i32", "eps_ptr": "*fp32", "grad_ptr": "*fp32", "n": "i32", "k": "i32"}
for arch in map(int, sys.argv[1:]):
    for fn, sig in ((tk.soft_topk_forward_kernel, FWD), (tk.soft_topk_backward_kernel, BWD)):
        for has_mask, sorted_ in ((True, True), (False, False)):
            consts = {"HAS_MASK": has_mask, "SORTED": sorted_, "MP": 8, "BLOCK_N": 256}
            signature = dict(sig, **{name: "constexpr" for name in consts})
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32))
            print("compiled", fn.__name__, arch, has_mask, sorted_)
"""


def test_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE, "80", "90"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("compiled") == 8


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error():
    code = ("import torch\nfrom softtopk_fairseq.ops import soft_topk\n"
            "try:\n    soft_topk(torch.randn(2, 5), 2, backend='triton')\n"
            "except ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "needs CUDA tensors" in out.stdout, out.stderr[-2000:]
