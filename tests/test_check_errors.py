"""``soft_topk(..., check_errors=False)``: nothing read back from the device -- a refused row comes out NaN (its
gradient too), the other rows exactly as without it, and no max_iter warning -- on every backend (Triton under
TRITON_INTERPRET=1 on CPU tensors, set by conftest) and through the compiled custom op."""
import os
import warnings

import pytest
import torch

from host_reads import HostReads

from softtopk_fairseq.ops import BadScoresError, soft_topk


def _triton_usable():
    from softtopk_fairseq.ops import backends

    if backends.TRITON.usable() is not None:  # triton missing, or older than the kernels support
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


TRITON = pytest.param("triton", marks=pytest.mark.skipif(not _triton_usable(), reason="no triton runtime"))
BACKENDS = ["torch", "cpu", TRITON]


def _device(backend):
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _scores(scaling, device):
    """Five rows of 12: 1 holds a NaN, 3 a +inf, 4 a -inf (excluded: a valid row); under the paper scaling row 2's
    range overflows float32 through the temperature (refused too). Returns the scores and the refused rows."""
    torch.manual_seed(0)
    x = torch.randn(5, 12) * 2
    x[1, 3], x[3, 0], x[4, 2] = torch.nan, torch.inf, -torch.inf
    refused = [1, 3]
    if scaling == "paper":
        x[2, 0], x[2, 1] = 3e38, -3e38
        refused = [1, 2, 3]
    return x.to(device), refused


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("scaling", ["none", "paper"])
@pytest.mark.parametrize("sorted", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_refused_rows_are_nan_and_the_others_are_solved_as_alone(backend, sorted, scaling, compiled):
    x, refused = _scores(scaling, _device(backend))
    kept = [r for r in range(5) if r not in refused]
    w = torch.randn(5, 12, 3 if sorted else 1, device=x.device).squeeze(-1)

    def call(scores, check_errors):
        return soft_topk(scores, 3, sorted=sorted, scaling=scaling, backend=backend, check_errors=check_errors)

    if compiled:
        torch.compiler.reset()  # (one code object across the parameters: each would count as a recompile)
        call = torch.compile(call, fullgraph=True, backend="aot_eager")
    with pytest.raises((BadScoresError, ValueError)):
        call(x, True)
    scores = x.clone().requires_grad_()
    out = call(scores, False)
    (out * w).nansum().backward()
    rows = out.reshape(5, -1)
    assert bool(torch.isnan(rows[refused]).all()) and not bool(torch.isnan(rows[kept]).any())
    assert bool(torch.isnan(scores.grad[refused]).all()) and bool(torch.isfinite(scores.grad[kept]).all())
    alone = x[kept].clone().requires_grad_()
    expected = call(alone, True)
    (expected * w[kept]).sum().backward()
    torch.testing.assert_close(out[kept], expected)  # (the PyTorch path iterates a batch until all converge)
    torch.testing.assert_close(scores.grad[kept], alone.grad)


@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("sorted", [True, False])
def test_the_triton_path_reads_nothing_back(sorted, bad):
    """A Triton call (forward and backward) checked reads back once (the rows' status bits, which also say whether
    a row hit max_iter); unchecked, never -- with a refused row in the batch too."""
    if not _triton_usable():
        pytest.skip("no triton runtime")
    x, _ = _scores("paper", _device("triton"))
    x = x if bad else x.nan_to_num(0.0, 1.0, -1.0).clamp(-5, 5)

    def reads(check_errors):
        scores = x.clone().requires_grad_()
        with HostReads() as mode:
            try:
                out = soft_topk(scores, 3, sorted=sorted, scaling="paper", backend="triton",
                                check_errors=check_errors)
            except (BadScoresError, ValueError):
                return mode.count
            out.nansum().backward()
        return mode.count

    assert reads(False) == 0
    assert reads(True) >= 1 if bad else reads(True) == 1


@pytest.mark.parametrize("sorted", [True, False])
def test_the_unchecked_triton_path_adds_no_operation(sorted):
    """The Triton kernels write a refused row's output and gradient as NaN themselves: without the checks a call
    issues the checked call's operations less its checks -- nothing added in their place."""
    if not _triton_usable():
        pytest.skip("no triton runtime")
    x = torch.randn(6, 20, device=_device("triton"))

    def counted(check_errors):
        scores = x.clone().requires_grad_()
        with HostReads() as mode:
            soft_topk(scores, 3, sorted=sorted, scaling="paper", backend="triton", check_errors=check_errors).sum(
                ).backward()
        return mode.operations, mode.count

    (unchecked, _), (checked, checked_reads) = counted(False), counted(True)
    assert checked_reads and unchecked <= checked - checked_reads  # each read an operation of its own


def test_capped_rows_are_reported_in_the_info_not_warned_about():
    torch.manual_seed(0)
    x = torch.randn(4, 30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, info = soft_topk(x, 5, epsilon=0.05, sorted=True, max_iter=1, check_errors=False, return_info=True)
    assert bool((info.iterations == 1).all()) and not bool(info.converged.any())
    with pytest.warns(RuntimeWarning, match="hit max_iter=1"):
        soft_topk(x, 5, epsilon=0.05, sorted=True, max_iter=1)
