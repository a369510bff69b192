"""Property-based tests of soft_topk over random shapes, dims, k, epsilon, both scalings, -inf patterns, ties,
magnitudes up to 1e30 and the four float dtypes -- through every backend: the PyTorch path, the C kernels
and the Triton kernels (on the GPU when there is one, else in the interpreter: fewer examples, it is slow).
The fused backends compute in float32, so float64 draws become float32 there."""
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from softtopk_fairseq.ops import backends, soft_topk

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# Largest magnitude each dtype can hold comfortably (float16 overflows past 65504).
MAX_MAG = {torch.float16: 3e4, torch.bfloat16: 1e30, torch.float32: 1e30, torch.float64: 1e30}
# Tolerance on sums and ranges after rounding to the output dtype.
TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4, torch.float64: 1e-9}


BACKENDS = ["torch", "cpu", pytest.param("triton", marks=pytest.mark.skipif(
    backends.TRITON.usable() is not None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"), reason="no triton runtime"))]
EXAMPLES = {"torch": 120, "cpu": 60, "triton": 15 if torch.cuda.is_available() else 8}  # (8: the interpreter)


def _run_on(backend, x):
    """The scores for ``backend``: float32 at most for the fused ones, on the GPU for Triton when present."""
    if backend != "torch" and x.dtype == torch.float64:
        x = x.float()
    if backend == "triton" and torch.cuda.is_available():
        x = x.cuda()
    return x


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    n = shape[dim]
    k = draw(st.integers(1, n))
    dtype = draw(st.sampled_from(DTYPES))
    magnitude = draw(st.sampled_from([1.0, 1e3, MAX_MAG[dtype]]))
    ties = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    values = rng.integers(-3, 4, size) if ties else rng.standard_normal(size)
    x = torch.tensor(values * magnitude / 3, dtype=torch.float64).view(shape)
    neg_inf = torch.tensor(rng.random(size) < draw(st.sampled_from([0.0, 0.3, 0.9]))).view(shape)
    x = x.masked_fill(neg_inf, -torch.inf)
    epsilon = draw(st.sampled_from([1e-3, 0.1, 1.0, 10.0]))
    scaling = draw(st.sampled_from(["none", "none", "paper"]))
    return x.to(dtype), k, dim, epsilon, scaling


def _sum_expectations(x, k, dim):
    n_valid = torch.isfinite(x.double()).sum(dim)
    return n_valid, torch.clamp(n_valid, max=k)


# Scores near 1e30 under the paper scaling overflow the squared-distance cost, so the temperature is +inf by
# design (test_fused_kernels.test_scores_too_large_for_the_paper_scaling_raise_instead_of_nan: there every backend's
# output and gradient at 1e30 equal the PyTorch path's).
# Triton's interpreter runs the kernels in numpy, which reports that IEEE overflow (and the inf / inf it leads to,
# masked afterwards) as RuntimeWarnings the compiled kernels and the other paths do not print.
INTERPRETER_IEEE_REPORTS = pytest.mark.filterwarnings(
    "ignore:overflow encountered in multiply:RuntimeWarning", "ignore:invalid value encountered in divide:RuntimeWarning")


@INTERPRETER_IEEE_REPORTS
@pytest.mark.parametrize("backend", BACKENDS)
def test_unsorted_properties(backend):
    _for_cases(backend, _check_unsorted)


@INTERPRETER_IEEE_REPORTS
@pytest.mark.parametrize("backend", BACKENDS)
def test_sorted_properties(backend):
    _for_cases(backend, _check_sorted)


def _for_cases(backend, check):
    @settings(max_examples=EXAMPLES[backend], deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(cases())
    def run(case):
        x, k, dim, epsilon, scaling = case
        check(_run_on(backend, x), k, dim, dict(epsilon=epsilon, scaling=scaling, backend=backend))

    run()


def _check_unsorted(x, k, dim, kw):
    tol = TOL[x.dtype]
    xg = x.clone().requires_grad_()
    a = soft_topk(xg, k, dim=dim, **kw)
    x = x.cpu()
    a = a.cpu()
    assert a.shape == x.shape and a.dtype == x.dtype
    af = a.double()
    assert bool(torch.isfinite(af).all())
    assert bool(((af >= -tol) & (af <= 1 + tol)).all())
    assert bool((af[~torch.isfinite(x.double())] == 0).all())
    n_valid, target = _sum_expectations(x, k, dim)
    assert bool(((af.sum(dim) - target).abs() <= tol * (1 + target)).all())
    # Monotone in the score: a larger score never gets less mass (within rounding).
    xs, order = x.double().movedim(dim, -1).sort(-1)
    as_ = af.movedim(dim, -1).gather(-1, order)
    finite = torch.isfinite(xs)
    pair_ok = ~(finite[..., 1:] & finite[..., :-1]) | (as_[..., 1:] >= as_[..., :-1] - tol)
    assert bool(pair_ok.all())
    _check_grad(xg, a)


def _check_grad(xg, out):
    """A linear loss's gradient is finite, and exactly 0 on the excluded (-inf) entries."""
    w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64, device=out.device).view(out.shape)
    (out.double() * w).sum().backward()
    grad = xg.grad.double().cpu()
    assert bool(torch.isfinite(grad).all())
    assert bool((grad[~torch.isfinite(xg.detach().double().cpu())] == 0).all())


def _check_sorted(x, k, dim, kw):
    tol = TOL[x.dtype]
    xg = x.clone().requires_grad_()
    s = soft_topk(xg, k, dim=dim, sorted=True, **kw)
    x = x.cpu()
    s = s.cpu()
    d = dim % x.dim()
    assert s.shape == (*x.shape, k) and s.dtype == x.dtype
    sf = s.double()
    assert bool(torch.isfinite(sf).all())
    assert bool(((sf >= -tol) & (sf <= 1 + tol)).all())
    # Rank columns: sum to 1 for reachable ranks (l < n_valid), 0 otherwise; an element is used at most once.
    n_valid, _ = _sum_expectations(x, k, dim)
    col = sf.sum(d)
    reachable = torch.arange(k) < n_valid.unsqueeze(-1)
    assert bool(((col - reachable.double()).abs() <= tol * 4).all())
    assert bool((sf.sum(-1) <= 1 + tol * 4).all())
    _check_grad(xg, s)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 30), st.data())
def test_sorted_sums_to_unsorted_as_epsilon_vanishes(n, data):
    k = data.draw(st.integers(1, n))
    seed = data.draw(st.integers(0, 2**31 - 1))
    x = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).double().unsqueeze(0)  # gaps >= 1
    s = soft_topk(x, k, epsilon=0.02, sorted=True).sum(-1)
    a = soft_topk(x, k, epsilon=0.02)
    assert (s - a).abs().max() < 1e-9


@pytest.mark.parametrize("sorted", [False, True])
def test_huge_magnitudes_give_hard_topk(sorted):
    x = torch.tensor([[1e30, -1e30, 3e29, 0.0, 2e30]], dtype=torch.float32)
    out = soft_topk(x, 2, epsilon=0.1, sorted=sorted)
    hard = torch.tensor([[0, 0, 0, 0, 1], [1, 0, 0, 0, 0]], dtype=torch.float32).T.unsqueeze(0) if sorted \
        else torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(out, hard, atol=1e-20, rtol=0)
