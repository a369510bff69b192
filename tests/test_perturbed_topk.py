"""The perturbed top-k (Berthet et al. 2020) against its definition: two-element rows, where the expectation
and its derivative are known in closed form (P(x1 + s Z1 > x2 + s Z2) = Phi((x1 - x2) / (s sqrt 2))), sums,
the sigma -> 0 limit, masks, reproducibility and bad input."""
import math

import pytest
import torch

from softtopk_fairseq.ops import perturbed_topk, soft_topk


def _phi(t):
    return 0.5 * (1 + math.erf(t / math.sqrt(2)))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("sorted", [False, True])
def test_two_elements_match_the_closed_form_expectation(sorted):
    x = torch.tensor([[0.3, 0.0], [1.0, -0.5]], dtype=torch.float64)
    sigma, samples = 0.4, 40000
    out = perturbed_topk(x, 1, sigma=sigma, samples=samples, sorted=sorted, generator=_gen())
    p = torch.tensor([_phi((r[0] - r[1]).item() / (sigma * math.sqrt(2))) for r in x], dtype=torch.float64)
    first = out[:, 0, 0] if sorted else out[:, 0]
    # Monte-Carlo standard error sqrt(p (1 - p) / S) <= 0.0025: 5 of them
    assert float((first - p).abs().max()) < 5 * 0.0025
    assert float((out[:, 1, 0] if sorted else out[:, 1]).sub(1 - p).abs().max()) < 5 * 0.0025


@pytest.mark.parametrize("control_variate", [True, False])
def test_gradient_matches_the_closed_form_derivative(control_variate):
    """d/dx1 P = phi(d) / (s sqrt 2), d/dx2 = -that. Tolerance: 5 standard errors of the estimate, measured
    from 20 independent estimates (seeds)."""
    sigma, samples = 0.5, 4000
    x0 = torch.tensor([[0.2, -0.1]], dtype=torch.float64)
    d = (0.3) / (sigma * math.sqrt(2))
    exact = math.exp(-d * d / 2) / math.sqrt(2 * math.pi) / (sigma * math.sqrt(2))
    grads = []
    for seed in range(20):
        x = x0.clone().requires_grad_()
        perturbed_topk(x, 1, sigma=sigma, samples=samples, generator=_gen(seed),
                       control_variate=control_variate)[0, 0].backward()
        grads.append(x.grad[0].clone())
    g = torch.stack(grads)
    se = g[:, 0].std() / math.sqrt(len(grads))
    assert abs(float(g[:, 0].mean()) - exact) < 5 * float(se) + 1e-3
    assert abs(float(g[:, 1].mean()) + exact) < 5 * float(g[:, 1].std() / math.sqrt(len(grads))) + 1e-3


def test_control_variate_lowers_the_variance():
    """With a loss whose weights do not average to 0 (<G, y> far from 0 on every sample), subtracting the
    mean inner product removes most of the estimator's spread."""
    x = torch.randn(1, 20, dtype=torch.float64, generator=_gen(3))
    w = 1 + 0.2 * torch.randn(1, 20, dtype=torch.float64, generator=_gen(4))
    spread = {}
    for cv in (False, True):
        grads = []
        for seed in range(10):
            xg = x.clone().requires_grad_()
            (perturbed_topk(xg, 5, sigma=0.3, samples=200, generator=_gen(seed), control_variate=cv) * w).sum().backward()
            grads.append(xg.grad)
        spread[cv] = float(torch.stack(grads).std(0).mean())
    assert spread[True] < 0.5 * spread[False]


@pytest.mark.parametrize("sorted", [False, True])
def test_sums_ranges_and_small_sigma_is_the_hard_topk(sorted):
    x = torch.randperm(12, generator=_gen(5)).float().view(2, 6)  # gaps >= 1
    out = perturbed_topk(x, 3, sigma=1e-4, samples=5, sorted=sorted, generator=_gen())
    hard = soft_topk(x.double(), 3, epsilon=1e-3, sorted=sorted).float()
    torch.testing.assert_close(out, hard, atol=1e-6, rtol=0)
    wide = perturbed_topk(torch.randn(4, 9), 3, sigma=2.0, samples=50, sorted=sorted, generator=_gen())
    assert bool(((wide >= 0) & (wide <= 1)).all())
    if sorted:
        torch.testing.assert_close(wide.sum(-2), torch.ones(4, 3))
        assert bool((wide.sum(-1) <= 1 + 1e-6).all())
    else:
        torch.testing.assert_close(wide.sum(-1), torch.full((4,), 3.0))


def test_masks_and_short_rows_get_zero_and_zero_gradient():
    x = torch.randn(3, 6, generator=_gen(6)).requires_grad_()
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, :2] = False
    mask[1, 2:] = False            # two valid entries, k = 2: all ones
    xi = x.detach().clone()
    xi[2, 5] = -torch.inf
    xi.requires_grad_()
    out = perturbed_topk(xi, 2, sigma=0.5, samples=64, mask=mask, generator=_gen())
    assert bool((out[~mask] == 0).all()) and float(out[2, 5]) == 0.0
    torch.testing.assert_close(out[1, :2], torch.ones(2))
    (out * torch.randn(3, 6, generator=_gen(7))).sum().backward()
    assert bool((xi.grad[~mask] == 0).all()) and float(xi.grad[2, 5]) == 0.0
    assert bool((xi.grad[1] == 0).all()) and bool(torch.isfinite(xi.grad).all())


@pytest.mark.parametrize("control_variate", [True, False])
def test_a_sorted_row_with_one_valid_entry_is_constant_and_gets_zero_gradient(control_variate):
    """Its one entry has rank 0 under any noise: the Monte-Carlo estimate was not 0 there (the noise's mean)."""
    x = torch.tensor([[0.3, -torch.inf, -torch.inf], [0.3, 0.1, -torch.inf]], requires_grad=True)
    out = perturbed_topk(x, 2, sorted=True, sigma=0.5, control_variate=control_variate, generator=_gen())
    torch.testing.assert_close(out[0], torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    (out * torch.randn(2, 3, 2, generator=_gen(3))).sum().backward()
    assert bool((x.grad[0] == 0).all()) and bool((x.grad[1, :2] != 0).all())


@pytest.mark.parametrize("control_variate", [True, False])
def test_second_derivatives_are_refused_not_estimated_wrong(control_variate):
    """The backward's Monte-Carlo estimate is not differentiable again: through the control variate a second
    derivative came out as a small wrong number (tending to 0 with the samples, not to the true -2.7 here); without
    it, as autograd's generic error."""
    x = torch.tensor([[0.3, 0.1]], dtype=torch.float64, requires_grad=True)
    out = perturbed_topk(x, 1, sigma=0.2, samples=64, control_variate=control_variate, generator=_gen())
    g, = torch.autograd.grad(out[0, 0], x, create_graph=True)
    first, = torch.autograd.grad(perturbed_topk(x, 1, sigma=0.2, samples=64, control_variate=control_variate,
                                                generator=_gen())[0, 0], x)
    torch.testing.assert_close(g.detach(), first)  # (the first derivative as without create_graph)
    with pytest.raises(RuntimeError, match="perturbed_topk: no second derivatives"):
        torch.autograd.grad(g[0, 0], x)


def test_reproducible_under_a_generator_dim_smallest_and_half_dtypes():
    x = torch.randn(4, 7, 3, generator=_gen(8))
    a = perturbed_topk(x, 2, dim=1, sigma=0.3, samples=32, generator=_gen(1))
    b = perturbed_topk(x, 2, dim=1, sigma=0.3, samples=32, generator=_gen(1))
    assert torch.equal(a, b) and a.shape == x.shape
    torch.testing.assert_close(a.sum(1), torch.full((4, 3), 2.0))
    small = perturbed_topk(x, 2, dim=1, sigma=1e-5, samples=2, largest=False, generator=_gen(1))
    torch.testing.assert_close(small, perturbed_topk(-x, 2, dim=1, sigma=1e-5, samples=2, generator=_gen(1)))
    for dtype in (torch.float16, torch.bfloat16):
        h = perturbed_topk(x.to(dtype), 2, dim=1, sigma=0.3, samples=32, generator=_gen(1))
        assert h.dtype == dtype
        torch.testing.assert_close(h.float(), a, atol=0.1, rtol=0)  # rounded scores: a few of 32 draws differ


@pytest.mark.parametrize("call, match", [
    (lambda: perturbed_topk(torch.tensor([1.0, float("nan")]), 1), "NaN"),
    (lambda: perturbed_topk(torch.tensor([1.0, float("inf")]), 1), "infinity"),
    (lambda: perturbed_topk(torch.randn(3), 4), "k must be"),
    (lambda: perturbed_topk(torch.randn(3), 1, sigma=0.0), "sigma"),
    (lambda: perturbed_topk(torch.randn(3), 1, samples=0), "samples"),
    (lambda: perturbed_topk(torch.arange(3), 1), "floating-point"),
    (lambda: perturbed_topk(torch.randn(3), 1, mask=torch.ones(3)), "mask"),
    (lambda: perturbed_topk(torch.randn(3), 1, largest=0), "largest must be True or False, got 0"),
    (lambda: perturbed_topk(torch.randn(3), 1, control_variate=None), "control_variate must be True or False"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
