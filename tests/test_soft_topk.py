"""SOFT top-k operator: definition, solver agreement, backward, masking, errors, dtypes."""
import warnings

import numpy as np
import pytest
import torch

from softtopk_fairseq.ops import (BadScoresError, SoftTopK, backends, bad_score_rows, divide_by_temperature,
                                  effective_epsilon, perturbed_topk, soft_topk, softmax_k_times, solvers)
from softtopk_fairseq.ops.paper_reference import paper_sorted_soft_topk

f64 = torch.float64


def unrolled_sinkhorn(x, k, epsilon, sorted, mask=None, iters=3000):
    """Autograd through a converged log-domain Sinkhorn on the same problem: the reference for values
    and gradients (independent of the Newton solver and of the closed-form backward)."""
    valid = torch.isfinite(x) if mask is None else torch.isfinite(x) & mask
    u = torch.where(valid, x / epsilon, torch.zeros_like(x))
    y, c = solvers.anchor_targets(valid.sum(-1), k, sorted, x.dtype)
    p, _ = solvers.sinkhorn(u, valid, y, c, iters)
    return p[:, :k].transpose(-1, -2) if sorted else p[:, 0]


@pytest.mark.parametrize("sorted", [False, True])
@pytest.mark.parametrize("epsilon", [1.0, 0.3, 0.1])
def test_newton_matches_converged_sinkhorn(sorted, epsilon):
    torch.manual_seed(0)
    x = torch.randn(4, 30, dtype=f64)
    ours, info = soft_topk(x, 5, epsilon=epsilon, sorted=sorted, return_info=True)
    ref, ref_info = soft_topk(x, 5, epsilon=epsilon, sorted=sorted, method="sinkhorn", tol=1e-13,
                              max_iter=20000, return_info=True)
    assert bool(ref_info.converged.all())
    assert bool(info.converged.all()) and info.iterations.max() <= 20
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("epsilon", [0.01, 0.001])
def test_newton_solves_small_epsilon_where_sinkhorn_crawls(epsilon):
    """At small epsilon Sinkhorn needs >1e5 iterations; Newton must still meet the optimality conditions:
    exact marginals and, for the sorted plan, P_il proportional to exp((x_i y_l + h_l)/eps)."""
    torch.manual_seed(0)
    x = torch.randn(4, 30, dtype=f64)
    a, info = soft_topk(x, 5, epsilon=epsilon, return_info=True)
    assert bool(info.converged.all()) and info.iterations.max() <= 20
    torch.testing.assert_close(a.sum(-1), torch.full((4,), 5.0, dtype=f64), atol=1e-10, rtol=0)
    s, info = soft_topk(x, 5, epsilon=epsilon, sorted=True, return_info=True)
    assert bool(info.converged.all()) and info.iterations.max() <= 30
    torch.testing.assert_close(s.sum(-2), torch.ones(4, 5, dtype=f64), atol=1e-10, rtol=0)
    # Adjacent-rank log-ratio log(P_il / P_i,l+1) = (x_i + h_l - h_{l+1}) / eps: x_i/eps + a row constant.
    big = (s[..., :-1] > 1e-20) & (s[..., 1:] > 1e-20)  # ratios < e^46: below the logit clamp
    ratio = torch.log(s[..., :-1]) - torch.log(s[..., 1:]) - (x / epsilon).unsqueeze(-1)
    ref = torch.where(big, ratio, torch.zeros_like(ratio)).sum(1) / big.sum(1).clamp_min(1)
    dev = torch.where(big, ratio - ref.unsqueeze(1), torch.zeros_like(ratio)).abs().max()
    assert dev < 1e-6


def test_shapes_sums_and_ranges():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 17)
    a = soft_topk(x, 4, epsilon=0.3)
    assert a.shape == x.shape and a.dtype == x.dtype
    assert bool(((a >= 0) & (a <= 1)).all())
    torch.testing.assert_close(a.sum(-1), torch.full((2, 3), 4.0), atol=1e-5, rtol=0)
    s = soft_topk(x, 4, epsilon=0.3, sorted=True)
    assert s.shape == (2, 3, 17, 4)
    torch.testing.assert_close(s.sum(-2), torch.ones(2, 3, 4), atol=1e-5, rtol=0)
    assert bool((s.sum(-1) <= 1 + 1e-6).all())


def test_dim_argument_is_equivalent_to_transposing():
    torch.manual_seed(2)
    x = torch.randn(6, 5, 3, dtype=f64)
    a = soft_topk(x, 2, dim=0, epsilon=0.2)
    torch.testing.assert_close(a, soft_topk(x.movedim(0, -1), 2, epsilon=0.2).movedim(-1, 0))
    s = soft_topk(x, 2, dim=1, epsilon=0.2, sorted=True)
    assert s.shape == (6, 5, 3, 2)
    torch.testing.assert_close(s, soft_topk(x.movedim(1, -1), 2, epsilon=0.2, sorted=True).movedim(-2, 1))


def test_unsorted_is_a_sigmoid_with_temperature_epsilon():
    """A_i = sigmoid((x_i - tau)/eps): logit(A) - x/eps is the same for every element."""
    torch.manual_seed(3)
    x = torch.randn(3, 12, dtype=f64)
    a = soft_topk(x, 3, epsilon=0.7)
    shift = torch.logit(a) - x / 0.7
    torch.testing.assert_close(shift, shift[:, :1].expand_as(shift), atol=1e-9, rtol=0)


def test_largest_false_selects_the_smallest():
    x = torch.tensor([[3.0, -1.0, 2.0, -5.0, 0.0]], dtype=f64)
    assert soft_topk(x, 2, epsilon=1e-3, largest=False).round().tolist() == [[0, 1, 0, 1, 0]]
    s = soft_topk(x, 2, epsilon=1e-3, largest=False, sorted=True)
    assert s.argmax(-2).tolist() == [[3, 1]]
    torch.testing.assert_close(soft_topk(x, 2, epsilon=0.5, largest=False), soft_topk(-x, 2, epsilon=0.5))


def test_paper_scaling_matches_authors_algorithm_run_to_convergence():
    torch.manual_seed(4)
    for n, k in ((10, 3), (200, 5)):
        x = torch.randn(1, n, dtype=f64) * 2 + 1
        ref = paper_sorted_soft_topk(x, k, epsilon=0.1, max_iter=20000)
        ours = soft_topk(x, k, sorted=True, epsilon=0.1, scaling="paper")
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)   # the spec
        torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)  # what we actually get in float64
        ours32 = soft_topk(x.float(), k, sorted=True, epsilon=0.1, scaling="paper")
        torch.testing.assert_close(ours32.double(), ref, atol=1e-4, rtol=0)


def test_paper_scaling_is_per_row_unlike_the_authors_code():
    torch.manual_seed(5)
    x = torch.randn(2, 20, dtype=f64)
    x[1] *= 10
    batched = soft_topk(x, 3, sorted=True, scaling="paper")
    one_by_one = torch.cat([soft_topk(x[i:i + 1], 3, sorted=True, scaling="paper") for i in range(2)])
    torch.testing.assert_close(batched, one_by_one, atol=1e-12, rtol=0)
    # The authors' batch-wide maximum makes row 0 depend on row 1 -- the defect we fix.
    theirs = paper_sorted_soft_topk(x, 3, max_iter=2000)
    alone = paper_sorted_soft_topk(x[:1], 3, max_iter=2000)
    assert (theirs[0] - alone[0]).abs().max() > 1e-2


@pytest.mark.parametrize("sorted", [False, True])
def test_gradcheck_finite_differences(sorted):
    torch.manual_seed(6)
    x = torch.randn(3, 9, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: soft_topk(z, 3, epsilon=0.4, sorted=sorted), (x,))
    assert torch.autograd.gradcheck(lambda z: soft_topk(z, 2, epsilon=0.4, sorted=sorted, scaling="paper"), (x,))


@pytest.mark.parametrize("sorted", [False, True])
def test_second_derivatives_on_the_pytorch_path_and_a_clear_error_elsewhere(sorted):
    """backend="torch" differentiates its backward again (gradgradcheck; float32 as float64). Where the second
    derivative would be wrong -- through a fused kernel's backward (it was 0 without a word), or with the paper
    scaling, whose temperature's share of the gradient is first-order (it was wrong, or an in-place error) -- the
    first derivatives under create_graph are the same, and differentiating them raises, naming the fix."""
    torch.manual_seed(8)
    x = torch.randn(2, 6, dtype=f64)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 0] = False
    weights = torch.randn((2, 6, 2) if sorted else (2, 6), dtype=f64)

    def op(z, backend="torch", scaling="none"):
        return soft_topk(z, 2, epsilon=0.5, sorted=sorted, scaling=scaling, mask=mask, backend=backend)

    assert torch.autograd.gradgradcheck(op, (x.requires_grad_(),))
    want = torch.autograd.functional.hessian(lambda z: (op(z) * weights).sum(), x.detach())
    got = torch.autograd.functional.hessian(lambda z: (op(z) * weights.float()).sum(), x.detach().float())
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)
    kernel = "soft_topk: the backward of backend='{}' is a kernel, not differentiable again: for second " \
             "derivatives use backend='torch'"
    paper = r"{}: no second derivatives with scaling='paper' \(the temperature's share of the gradient is taken " \
            r"to first order\); use scaling='none' with backend='torch'"
    fused = ["cpu"] + (["triton"] if backends.TRITON.usable() is None else [])  # (triton missing, or too old)
    cases = [(b, "none", kernel.format(b)) for b in fused]
    cases += [(b, "paper", paper.format("soft_topk")) for b in (*fused, "torch")]
    for backend, scaling, message in cases:
        z = x.detach().float().requires_grad_()
        grad, = torch.autograd.grad((op(z, backend, scaling) * weights.float()).sum(), z, create_graph=True)
        plain, = torch.autograd.grad((op(z, backend, scaling) * weights.float()).sum(), z)
        assert torch.equal(grad.detach(), plain)
        with pytest.raises(RuntimeError, match=message):
            torch.autograd.grad(grad.square().sum(), z)
    z = x.detach().requires_grad_()
    grad, = torch.autograd.grad(effective_epsilon(z, 2, scaling="paper").sum(), z, create_graph=True)
    with pytest.raises(RuntimeError, match=paper.format("effective_epsilon")):
        torch.autograd.grad(grad.square().sum(), z)


@pytest.mark.parametrize("sorted", [False, True])
def test_gradcheck_with_masks_short_and_empty_rows(sorted):
    torch.manual_seed(7)
    x = torch.randn(4, 8, dtype=f64)
    mask = torch.ones(4, 8, dtype=torch.bool)
    mask[0, :3] = False      # n_valid = 5 > k
    mask[1, :6] = False      # n_valid = 2 < k: soft sort of the valid entries / all ones
    mask[2, :] = False       # all masked
    x[3, 2] = -torch.inf     # -inf excluded
    xg = x.clone().requires_grad_()
    fn = lambda z: soft_topk(z, 3, epsilon=0.5, sorted=sorted, mask=mask)  # noqa: E731
    out = fn(xg)
    assert bool(torch.isfinite(out).all())
    # gradcheck perturbs entries; keep -inf out of the perturbed set by masking it too.
    mask[3, 2] = False
    xf = torch.where(mask, x, torch.zeros_like(x)).requires_grad_()
    assert torch.autograd.gradcheck(fn, (xf,))
    (out * torch.randn_like(out)).sum().backward()
    assert bool((xg.grad[~mask] == 0).all()) and bool(torch.isfinite(xg.grad).all())


@pytest.mark.parametrize("sorted", [False, True])
def test_implicit_backward_matches_autograd_through_sinkhorn(sorted):
    torch.manual_seed(8)
    x = torch.randn(3, 15, dtype=f64)
    mask = torch.rand(3, 15) > 0.2
    w = torch.randn(3, 15, 4, dtype=f64) if sorted else torch.randn(3, 15, dtype=f64)
    x1 = x.clone().requires_grad_()
    (soft_topk(x1, 4, epsilon=0.3, sorted=sorted, mask=mask) * w).sum().backward()
    x2 = x.clone().requires_grad_()
    (unrolled_sinkhorn(x2, 4, 0.3, sorted, mask) * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-8, rtol=0)


def test_masked_entries_are_exactly_zero_and_do_not_count():
    x = torch.tensor([[5.0, -torch.inf, 1.0, 3.0, 2.0]], dtype=f64)
    a = soft_topk(x, 2, epsilon=0.2)
    assert a[0, 1] == 0
    torch.testing.assert_close(a[:, [0, 2, 3, 4]], soft_topk(x[:, [0, 2, 3, 4]], 2, epsilon=0.2))
    mask = torch.tensor([[True, True, False, True, True]])
    b = soft_topk(torch.nan_to_num(x, neginf=0.0), 2, epsilon=0.2, mask=mask)
    assert b[0, 2] == 0
    s = soft_topk(x, 2, epsilon=0.2, sorted=True)
    assert bool((s[0, 1] == 0).all())


def test_rows_with_few_or_no_valid_entries_are_defined():
    x = torch.tensor([[1.0, -torch.inf, 0.0, -torch.inf], [-torch.inf] * 4], dtype=f64)
    a = soft_topk(x, 3, epsilon=0.1)
    assert a.tolist() == [[1.0, 0.0, 1.0, 0.0], [0.0] * 4]
    s = soft_topk(x, 3, epsilon=0.1, sorted=True)
    assert bool(torch.isfinite(s).all()) and bool((s[1] == 0).all())
    torch.testing.assert_close(s[0, [0, 2]].sum(0), torch.tensor([1.0, 1.0, 0.0], dtype=f64))  # ranks 0, 1 filled
    assert s[0, 0, 0] > 0.99 and s[0, 2, 1] > 0.99


def test_sorted_and_unsorted_agree_as_epsilon_goes_to_zero():
    torch.manual_seed(9)
    x = torch.randperm(40).to(f64).view(2, 20)  # distinct, gaps >= 1
    for eps in (0.05, 0.01):
        s = soft_topk(x, 6, epsilon=eps, sorted=True).sum(-1)
        a = soft_topk(x, 6, epsilon=eps)
        # exp(-1/eps) from the entropic bias; 2e-28 is the sorted solver's saturation floor (LOGIT_CLAMP).
        assert (s - a).abs().max() < 50 * torch.exp(torch.tensor(-1 / eps)) + 2e-28


def test_ties_split_mass_evenly():
    x = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=f64)
    a = soft_topk(x, 2, epsilon=1e-3)
    torch.testing.assert_close(a, torch.tensor([[1.0, 0.5, 0.5, 0.0]], dtype=f64), atol=1e-9, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes_round_trip(dtype):
    x = torch.randn(3, 10).to(dtype).requires_grad_()
    for sorted in (False, True):
        out = soft_topk(x, 3, epsilon=0.5, sorted=sorted)
        assert out.dtype == dtype
        out.float().sum().backward()
        assert x.grad.dtype == dtype and bool(torch.isfinite(x.grad).all())
        x.grad = None


def test_module_wrapper():
    m = SoftTopK(2, epsilon=0.2, sorted=True)
    x = torch.randn(4, 7)
    torch.testing.assert_close(m(x), soft_topk(x, 2, epsilon=0.2, sorted=True))
    assert "k=2" in repr(m)
    with pytest.raises(ValueError, match=r"SoftTopK: k must be an int >= 1, got 0; epsilon must be a finite number "
                                         r"> 0, got -1.0; scaling must be one of \('none', 'paper'\), got 'x'"):
        SoftTopK(0, epsilon=-1.0, scaling="x")
    with pytest.raises(ValueError, match=r"SoftTopK: the fused kernels \(backend='cpu'\) solve by Newton's method"):
        SoftTopK(2, method="sinkhorn", backend="cpu")


@pytest.mark.parametrize("bad, exc, match", [
    (dict(scores=torch.tensor([[1.0, float("nan")]])), ValueError, "NaN"),
    (dict(scores=torch.tensor([[1.0, float("inf")]])), ValueError, "infinity"),
    (dict(scores=torch.tensor([[1.0, -float("inf")]]), largest=False), ValueError, "infinity"),
    (dict(k=0), ValueError, "k must be in"),
    (dict(k=4), ValueError, "k must be in"),
    (dict(k=1.5), TypeError, "k must be an int"),
    (dict(epsilon=0.0), ValueError, "epsilon"),
    (dict(epsilon=-1.0), ValueError, "epsilon"),
    (dict(epsilon=float("nan")), ValueError, "epsilon"),
    (dict(scores=torch.tensor([[1, 2, 3]])), TypeError, "floating-point"),
    (dict(mask=torch.ones(1, 3)), TypeError, "bool"),
    (dict(mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, "broadcast"),
    (dict(scaling="batch"), ValueError, "scaling"),
    (dict(method="lbfgs"), ValueError, "method"),
    (dict(tol=-1e-6), ValueError, r"tol must be a finite number >= 0 \(0: up to max_iter steps, Newton stopping "
                                  r"earlier at its rounding floor\), got -1e-06"),
    (dict(tol=float("nan")), ValueError, "tol must be"),
    (dict(max_iter=-1), ValueError, "max_iter must be an int >= 0, got -1"),
    (dict(max_iter=2.5), ValueError, "max_iter must be an int"),
    (dict(dim=2), ValueError, r"dim=2 is out of range for scores with 2 dimension\(s\) \(valid: -2..1\)"),
    (dict(dim=-3), ValueError, "dim=-3 is out of range"),
    (dict(dim=np.int64(0)), TypeError, r"dim must be an int, got .*\(a int64: pass int\(dim\)\)"),  # (numpy's repr)
    (dict(dim=np.int64(-1)), TypeError, r"\(a int64: pass int\(dim\)\)"),  # (the thin path's dim too)
    (dict(dim=1.0), TypeError, r"\(a float: pass int\(dim\)\)"),
    (dict(epsilon=10**400), ValueError, r"epsilon=1000.* is outside float32's range"),  # (no OverflowError)
    # any other value would be read as true or false without a word: largest=None selected the smallest
    (dict(largest=None), TypeError, "soft_topk: largest must be True or False, got None"),
    (dict(sorted="no"), TypeError, "soft_topk: sorted must be True or False, got 'no'"),
    (dict(check_errors=1), TypeError, "soft_topk: check_errors must be True or False, got 1"),
    (dict(return_info=None), TypeError, "soft_topk: return_info must be True or False, got None"),
])
def test_clear_errors(bad, exc, match):
    kwargs = dict(scores=torch.tensor([[1.0, 2.0, 3.0]]), k=2)
    kwargs.update(bad)
    scores, k = kwargs.pop("scores"), kwargs.pop("k")
    with pytest.raises(exc, match=match):
        soft_topk(scores, k, **kwargs)


@pytest.mark.parametrize("op, temperature", [(soft_topk, "epsilon"), (softmax_k_times, "epsilon"),
                                             (perturbed_topk, "sigma")])
@pytest.mark.parametrize("bad, exc, match", [
    (dict(scores=torch.tensor(1.0)), ValueError, "scores must have at least one dimension"),
    (dict(scores=torch.ones(2, 3, dtype=torch.bool)), TypeError, "scores must be a floating-point tensor, got torch.bool"),
    (dict(k=2.0), TypeError, r"k must be an int, got 2.0 \(a float: pass int\(k\)\)"),
    (dict(k=torch.tensor(2)), TypeError, r"k must be an int, got tensor\(2\) \(a Tensor"),
    (dict(k=4), ValueError, r"k must be in 1..n = 1..3 along dim -1, got k=4"),
    (dict(scores=torch.ones(2, 0), k=1), ValueError,
     r"scores have no entries along dim -1 \(shape \(2, 0\)\): nothing to select from"),
    (dict(dim=2), ValueError, r"dim=2 is out of range for scores with 2 dimension\(s\)"),
    (dict(temperature=torch.tensor(0.1)), TypeError, "{t} must be a Python float, got a Tensor"),
    (dict(temperature="0.1"), ValueError, r"{t} must be a Python float, got '0.1' \(a str: pass float\(...\)\)"),
    (dict(temperature=float("inf")), ValueError, "{t} must be a finite number > 0, got inf"),
    # beyond float32, the type all but float64 scores are computed in: NaN outputs below it, overflow above
    (dict(temperature=1e-46), ValueError, r"{t}=1e-46 is outside float32's range 1.18e-38..3.4e\+38"),
    (dict(temperature=1e39), ValueError, r"{t}=1e\+39 is outside float32's range"),
    (dict(scores=torch.randn(2, 3, dtype=torch.float16), temperature=1e-46), ValueError,
     "{t}=1e-46 is outside float32's range"),
    (dict(mask=torch.ones(2, 3)), TypeError, r"mask must be a bool tensor \(True = keep\), got torch.float32"),
    (dict(mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, r"mask of shape \(2, 2\) does not broadcast"),
    (dict(mask=torch.ones(4, 2, 3, dtype=torch.bool)), ValueError, r"mask of shape \(4, 2, 3\) does not broadcast"),
])
def test_every_operator_refuses_bad_arguments_by_one_rule(op, temperature, bad, exc, match):
    """soft_topk, softmax_k_times and perturbed_topk check their shared arguments with one function
    (ops/arguments.py): the same errors, each naming the operator (softmax_k_times once took dim=2 of a 2-D
    tensor for dim 0, and both others let torch's own errors through)."""
    kwargs = dict(scores=torch.randn(2, 3), k=2, dim=-1, temperature=0.1, mask=None)
    kwargs.update(bad)
    with pytest.raises(exc, match=f"{op.__name__}: {match.format(t=temperature)}"):
        op(kwargs["scores"], kwargs["k"], dim=kwargs["dim"], mask=kwargs["mask"],
           **{temperature: kwargs["temperature"]})


@pytest.mark.parametrize("op, temperature", [(soft_topk, "epsilon"), (softmax_k_times, "epsilon"),
                                             (perturbed_topk, "sigma")])
def test_a_temperature_is_refused_only_outside_the_range_of_the_type_it_is_computed_in(op, temperature):
    """float64 scores are computed in float64: a temperature below float32's range is theirs to use (finite
    outputs and gradients), while the same value on float32 scores -- rounded to 0 there, NaN outputs -- is
    refused."""
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    out = op(x, 2, **{temperature: 1e-300})
    out.sum().backward()
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(x.grad).all())
    with pytest.raises(ValueError, match=f"{op.__name__}: {temperature}=1e-300 is outside float32's range"):
        op(x.detach().float(), 2, **{temperature: 1e-300})


def test_the_public_temperature_helpers_check_their_arguments():
    """effective_epsilon checks what soft_topk checks (a negative epsilon was returned as the temperature);
    divide_by_temperature wants one temperature per row (torch's broadcasting error, or a wrong broadcast, else)."""
    x = torch.randn(3, 6)
    with pytest.raises(ValueError, match="effective_epsilon: epsilon must be a finite number > 0, got -1.0"):
        effective_epsilon(x, 2, epsilon=-1.0)
    with pytest.raises(ValueError, match=r"effective_epsilon: scaling must be one of \('none', 'paper'\), got 'x'"):
        effective_epsilon(x, 2, scaling="x")
    with pytest.raises(ValueError, match=r"effective_epsilon: k must be in 1..n = 1..6"):
        effective_epsilon(x, 7)
    with pytest.raises(ValueError, match=r"divide_by_temperature: temperature must be a tensor shaped like the "
                                         r"scores without their last dimension, \(3,\), got \(1,\)"):
        divide_by_temperature(x, torch.ones(1))
    assert torch.equal(divide_by_temperature(x, torch.full((3,), 2.0)), x / 2)
    # a zero temperature gave +-finfo.max, a negative one flipped the order; a NaN one (a bad row's) is handed on
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"divide_by_temperature: temperatures must be > 0, got {bad}"):
            divide_by_temperature(x, torch.tensor([1.0, bad, 2.0]))
    assert bool(divide_by_temperature(x, torch.tensor([1.0, torch.nan, 2.0]))[1].isnan().all())
    with pytest.raises(TypeError, match="divide_by_temperature: scores and temperature must be floating point, got "
                                        "torch.int64 and torch.float32"):
        divide_by_temperature(torch.ones(3, 6, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match=r"divide_by_temperature: valid must be a bool tensor shaped like the scores, "
                                         r"\(3, 6\), got torch.float32 \(3, 6\)"):
        divide_by_temperature(x, torch.ones(3), torch.ones(3, 6))
    with pytest.raises(TypeError, match="effective_epsilon: largest must be True or False, got None"):
        effective_epsilon(x, 2, largest=None)
    with pytest.raises(ValueError, match="SoftTopK: sorted must be True or False, got 'yes'"):
        SoftTopK(2, sorted="yes")


@pytest.mark.parametrize("scaling, scale, epsilon", [("none", 1.0, 1e-8), ("paper", 300.0, 0.1)])
def test_effective_epsilon_of_half_scores_is_the_float32_temperature_soft_topk_uses(scaling, scale, epsilon):
    """float16/bfloat16 scores are computed in float32: their temperature too (in float16, 1e-8 was 0 and the paper
    temperature of scores in the hundreds inf)."""
    x = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.1, -0.2]]) * scale
    for dtype in (torch.float16, torch.bfloat16):
        got = effective_epsilon(x.to(dtype), 2, epsilon=epsilon, scaling=scaling)
        used = soft_topk(x.to(dtype), 2, epsilon=epsilon, scaling=scaling, return_info=True)[1].temperature
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all()) and bool((got > 0).all())
        torch.testing.assert_close(got, used)


@pytest.mark.parametrize("largest", [True, False])
def test_the_temperature_of_a_row_soft_topk_refuses_is_nan(largest):
    """effective_epsilon gives NaN (no error, nothing read back) on exactly the rows soft_topk refuses as bad scores
    -- a NaN, an infinity on the selected side that the mask keeps -- an infinite temperature on scores too large for
    the paper scaling, and on the others the temperature soft_topk reports (a +inf row once got epsilon itself, a NaN
    one a number); divide_by_temperature leaves an infinite score as it is, for the relaxation to refuse (it
    clamped +inf to a valid finite score)."""
    sign = 1.0 if largest else -1.0
    x = sign * torch.tensor([[0.5, 1.0, 2.0, -1.0], [torch.nan, 1.0, 2.0, -1.0], [torch.inf, 1.0, 2.0, -1.0],
                             [3e38, -3e38, 1.0, 0.0], [torch.inf, 1.0, 2.0, -1.0], [-torch.inf, 1.0, 2.0, -1.0]])
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[4, 0] = False  # the masked infinity is excluded, not refused
    got = effective_epsilon(x, 2, epsilon=0.1, largest=largest, scaling="paper", mask=mask)
    assert torch.isnan(got).tolist() == [False, True, True, False, False, False]
    assert float(got[3]) == torch.inf
    fine = [0, 4, 5]
    want = soft_topk(x[fine], 2, epsilon=0.1, largest=largest, scaling="paper", mask=mask[fine],
                     return_info=True)[1].temperature
    torch.testing.assert_close(got[fine], want)
    assert torch.isnan(effective_epsilon(x, 2, epsilon=0.1, largest=largest, mask=mask)).tolist() == \
        [False, True, True, False, False, False]  # (a constant temperature does not overflow)
    scaled = divide_by_temperature(torch.tensor([[torch.inf, 1.0, -torch.inf, 3e38]]), torch.tensor([0.5]))
    assert scaled.tolist() == [[torch.inf, 2.0, -torch.inf, torch.finfo(torch.float32).max]]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_fused_backend_named_with_sinkhorn_is_refused_and_auto_runs_it(backend):
    """The fused kernels solve by Newton only: naming one with method="sinkhorn" raises (it ran the PyTorch path
    silently, a float64 call included, which the same backend refuses with Newton); auto and torch run it."""
    x = torch.randn(2, 6)
    for scores in (x, x.double()):
        with pytest.raises(ValueError, match=f"soft_topk: the fused kernels \\(backend='{backend}'\\) solve by "
                                             "Newton's method, not method='sinkhorn'; use backend='torch' or 'auto'"):
            soft_topk(scores, 2, method="sinkhorn", backend=backend)
    torch.testing.assert_close(soft_topk(x, 2, method="sinkhorn"), soft_topk(x, 2, method="sinkhorn", backend="torch"))


def test_perturbed_topk_refuses_a_generator_that_is_not_one():
    with pytest.raises(TypeError, match="perturbed_topk: generator must be a torch.Generator or None, got int"):
        perturbed_topk(torch.randn(2, 4), 2, generator=3)


@pytest.mark.parametrize("op, largest", [(soft_topk, True), (soft_topk, False), (softmax_k_times, True),
                                         (perturbed_topk, True), (perturbed_topk, False)])  # smk: largest only
def test_every_operator_refuses_nan_and_a_selected_infinity_unless_masked_by_one_rule(op, largest):
    """NaN scores and an infinity on the selected side are refused by all three operators with the same words
    (ops/arguments.py), a NaN even under the mask; a masked infinity is excluded, as the error advises ("use
    mask=False to exclude") -- perturbed_topk once refused it anyway, softmax_k_times let +inf through to NaN
    gradients."""
    kwargs = {} if op is softmax_k_times else dict(largest=largest)
    inf = torch.inf if largest else -torch.inf
    x = torch.tensor([[1.0, inf, 2.0, 3.0]])
    keep = torch.tensor([[True, False, True, True]])
    with pytest.raises(BadScoresError, match=f"{op.__name__}: scores contain an infinity on the selected side"):
        op(x, 2, **kwargs)
    out = op(x, 2, mask=keep, **kwargs)
    assert bool(torch.isfinite(out).all()) and float(out[0, 1].abs().sum()) == 0
    nan = torch.tensor([[1.0, torch.nan, 2.0, 3.0]])
    for mask in (None, keep):
        with pytest.raises(BadScoresError, match=f"{op.__name__}: scores contain NaN .*ops.bad_score_rows"):
            op(nan, 2, mask=mask, **kwargs)
    # The rows a BadScoresError is about (kept as a dimension): not one whose infinity is the excluded side's.
    bad_rows = torch.cat([x, nan, torch.where(torch.isinf(x), -x, x)])
    assert bad_score_rows(bad_rows, largest=largest).tolist() == [[True], [True], [False]]
    assert bad_score_rows(bad_rows.t(), dim=0, largest=largest).tolist() == [[True, True, False]]


def test_warns_when_iteration_cap_is_hit():
    torch.manual_seed(10)
    x = torch.randn(2, 50, dtype=f64)
    with pytest.warns(RuntimeWarning, match="marginal error") as record:
        _, info = soft_topk(x, 5, epsilon=0.05, sorted=True, max_iter=1, return_info=True)
    assert not bool(info.converged.all())
    assert record[0].filename == __file__  # the warning names the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        soft_topk(x, 5, epsilon=0.05, sorted=True)


def test_fixed_iteration_sinkhorn_runs_exactly_max_iter():
    x = torch.randn(2, 20, dtype=f64)
    _, info = soft_topk(x, 3, sorted=True, method="sinkhorn", tol=0, max_iter=17, return_info=True)
    assert info.iterations.tolist() == [17.0, 17.0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32 on CPU: the C kernel's version
@pytest.mark.parametrize("sorted", [False, True])
def test_paper_temperature_and_its_gradient_match_the_cost_maximum_over_the_whole_row(sorted, dtype):
    """effective_epsilon's paper scaling computes M = max cost from the row's extremes with a one-entry
    derivative; check value and gradient against the definition (max over every valid entry and anchor of
    (x_i - y_l)^2, autograd through it), with masks, a row of one valid entry and an all-masked row."""
    from softtopk_fairseq.ops import effective_epsilon

    torch.manual_seed(3)
    k = 3
    x = (torch.randn(6, 9, dtype=torch.float64) * 3 + torch.linspace(-4, 4, 6, dtype=torch.float64)[:, None])
    mask = torch.rand(6, 9) > 0.3
    mask[4] = False
    mask[4, 2] = True   # one valid entry
    mask[5] = False     # all masked
    xg = x.clone().to(dtype).requires_grad_()
    eps = effective_epsilon(xg, k, epsilon=0.1, sorted=sorted, scaling="paper", mask=mask)
    anchors = torch.arange(k + 1 if sorted else 2, dtype=torch.float64)
    x2 = x.clone().requires_grad_()
    cost = (x2.unsqueeze(-1) - anchors).square().amax(-1)
    m = torch.where(mask, cost, torch.zeros_like(cost)).amax(-1)
    want = torch.where(m > 0, 0.1 * m / 2, torch.full_like(m, 0.1))
    torch.testing.assert_close(eps, want.to(dtype))
    w = torch.randn(6, dtype=torch.float64)
    (eps * w.to(dtype)).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(xg.grad, x2.grad.to(dtype))
    assert float(xg.grad[5].abs().sum()) == 0 and int((xg.grad != 0).sum(-1).max()) == 1


def test_unsorted_root_steps_in_log_space_from_the_tail(monkeypatch):
    """For k small against n (LOG_STEP_FRACTION) the unsorted root takes Newton steps on log(sum A) - log k:
    the same root as plain Newton, in fewer steps where the temperature is broad (the paper scaling)."""
    from softtopk_fairseq.ops import solvers

    torch.manual_seed(4)
    x = torch.randn(64, 1000, dtype=f64)
    default, results = solvers.LOG_STEP_FRACTION, {}
    for fraction in (default, 0.0):  # 0: plain Newton everywhere
        monkeypatch.setattr(solvers, "LOG_STEP_FRACTION", fraction)
        results[fraction] = soft_topk(x, 5, epsilon=0.1, scaling="paper", backend="torch", return_info=True)
    (a_log, info_log), (a_plain, info_plain) = results[default], results[0.0]
    assert bool(info_log.converged.all()) and bool(info_plain.converged.all())
    torch.testing.assert_close(a_log, a_plain, atol=1e-9, rtol=0)
    assert float(info_log.iterations.mean()) + 2 <= float(info_plain.iterations.mean())
