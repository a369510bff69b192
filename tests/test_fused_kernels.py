"""The fused kernels against the PyTorch path: Triton (on the GPU when there is one, else under
TRITON_INTERPRET=1 on CPU tensors, set by conftest) and the C kernels for CPU tensors (cpu_kernels)."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from softtopk_fairseq.ops import BadScoresError, backends, cpu_kernels, soft_topk

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Valid inputs must not make a kernel compute inf - inf or overflow, even on lanes it discards: the Triton
# interpreter reports those as numpy RuntimeWarnings, which this turns into failures.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _triton_usable():
    if backends.TRITON.usable() is not None:  # triton missing, or older than the kernels support
        return False
    return TRITON_DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


BACKENDS = [pytest.param("triton", marks=pytest.mark.skipif(not _triton_usable(), reason="no triton runtime")),
            "cpu"]


def _device(backend):
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _both(x, k, backend, **kw):
    """(fused output, torch output, fused info, torch info) for the same call."""
    a, ia = soft_topk(x, k, backend=backend, return_info=True, **kw)
    b, ib = soft_topk(x, k, backend="torch", return_info=True, **kw)
    return a, b, ia, ib


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sorted", [False, True])
@pytest.mark.parametrize("epsilon, scaling", [(1.0, "none"), (0.1, "none"), (0.01, "none"), (0.1, "paper")])
def test_forward_matches_torch_path(backend, sorted, epsilon, scaling):
    torch.manual_seed(0)
    x = torch.randn(4, 37, device=_device(backend))
    a, b, ia, ib = _both(x, 5, backend, epsilon=epsilon, sorted=sorted, scaling=scaling)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert bool(ia.converged.all()) and bool(ib.converged.all())
    assert ia.iterations.max() <= 20


@pytest.mark.parametrize("backend", BACKENDS)
def test_paper_temperature_matches_the_torch_path(backend):
    """The fused backends' paper-scaling temperature (one kernel pass): the same (eps, at, slope) per row as the
    PyTorch path's, with masks, a row of one valid entry and an all-masked row, over several tiles."""
    from softtopk_fairseq.ops import backends

    torch.manual_seed(5)
    device = _device(backend)
    x = (torch.randn(6, 300) * 3 + torch.linspace(-4, 4, 6)[:, None]).to(device)
    valid = torch.rand(6, 300, device=device) > 0.3
    valid[4] = False
    valid[4, 250] = True  # one valid entry, in the second tile
    valid[5] = False      # all masked
    for anchor_top in (1.0, 3.0):
        got = backends.FUSED[backend].paper_temperature(x, valid, anchor_top, 0.1)
        want = backends.TORCH.paper_temperature(x, valid, anchor_top, 0.1)
        torch.testing.assert_close(got[0], want[0])
        assert torch.equal(got[1].cpu()[:5], want[1].cpu()[:5])  # the all-masked row's index is arbitrary
        torch.testing.assert_close(got[2], want[2])
        assert float(got[2][5]) == 0.0 and float(got[0][5]) == pytest.approx(0.1)


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("sorted", [False, True])
@pytest.mark.parametrize("scaling", ["none", "paper"])
def test_info_reports_the_temperature_each_row_was_solved_at(backend, sorted, scaling):
    """SolverInfo.temperature: effective_epsilon of each row (masks and -inf entries excluded), without autograd
    -- callers reuse it (soft beam search's pruned-mass bound) instead of computing it again."""
    from softtopk_fairseq.ops import effective_epsilon

    torch.manual_seed(6)
    x = (torch.randn(2, 5, 40) * 4).to(_device(backend))
    x[0, 1, :7] = -torch.inf
    mask = torch.rand(2, 5, 40, device=x.device) > 0.2
    xg = x.clone().requires_grad_()
    _, info = soft_topk(xg, 3, dim=-1, epsilon=0.2, sorted=sorted, scaling=scaling, mask=mask, backend=backend,
                        return_info=True)
    want = effective_epsilon(x, 3, epsilon=0.2, sorted=sorted, scaling=scaling, mask=mask)
    assert info.temperature.shape == (2, 5) and not info.temperature.requires_grad
    torch.testing.assert_close(info.temperature, want)
    if scaling == "paper":
        assert float(want.std()) > 0  # rows differ: a constant would not pass for a reason


@pytest.mark.parametrize("sorted", [False, True])
@pytest.mark.parametrize("n", [30, 100])  # unsorted: rows solved 16 at a time (n <= 64), and one by one
def test_cpu_forward_computes_the_paper_temperature_it_solves_at(n, sorted):
    """Under the paper scaling the C forwards compute the temperature in their own pass over the scores
    (``CpuBackend.solve_paper``): the same (eps, at, slope) as the PyTorch path's definition -- ties at a row's
    maximum or minimum (the first occurrence), masks, -inf, a row of one valid entry and an empty row -- and
    the same output and info as solving at that temperature given."""
    from softtopk_fairseq.ops import backends

    if backends.CPU.usable() is not None:
        pytest.skip("no C compiler")
    torch.manual_seed(12)
    x = torch.randn(37, n) * 2 + torch.linspace(-3, 3, 37)[:, None]
    mask = torch.rand(37, n) > 0.2
    x[1, ::4] = -torch.inf
    x[3, 5] = x[3, 9] = x[3, 20] = x[3].max() + 12.0  # tied maximum, far above: the cost's maximum sits there
    mask[3, [9, 20]] = True
    mask[3, 5] = False                                 # the first of the tied maxima is masked out
    x[4, 2] = x[4, 7] = x[4].min() - 8.0              # tied minimum, far below: the cost's maximum sits there
    mask[4, [2, 7]] = True
    mask[6] = False
    mask[6, 11] = True                                 # one valid entry
    mask[8] = False                                    # nothing valid
    x[36, :] = 0.5                                     # all equal (a row past the last full group)
    for k in (1, 3):  # the paper scaling's top anchor: k sorted, 1 unsorted
        opts = backends.SolveOptions(k, sorted, 1e-6, 50)
        anchor_top = opts.anchor_top
        got = backends.CPU.solve_paper(x, mask, 0.1, opts)
        eps, at, slope = backends.TORCH.paper_temperature(x, mask, anchor_top, 0.1)
        torch.testing.assert_close(got[2], eps)
        keep = torch.arange(37) != 8  # the empty row's index is arbitrary
        assert torch.equal(got[3][keep], at[keep])
        torch.testing.assert_close(got[4], slope)
        assert float(got[2][8]) == pytest.approx(0.1) and float(got[4][8]) == 0.0
        out, info = backends.CPU.solve(x, mask, got[2], opts)
        assert torch.equal(got[0], out) and torch.equal(got[1], info)


@pytest.mark.parametrize("backend", [*BACKENDS, "torch"])
@pytest.mark.parametrize("sorted", [False, True])
def test_bad_scores_raise_the_same_error_on_every_backend(backend, sorted):
    """NaN anywhere (also under the mask) and +inf on a kept entry raise; +inf under the mask does not. The C
    backend checks the unsorted operator's scores inside its kernel: the same errors as the other paths."""
    device = _device(backend)
    mask = torch.ones(3, 6, dtype=torch.bool, device=device)
    mask[1, 2] = False
    for row, value, message in ((0, float("nan"), "scores contain NaN"), (1, float("nan"), "scores contain NaN"),
                                (2, float("inf"), "infinity on the selected side")):
        x = torch.randn(3, 6, device=device)
        x[row, 2] = value
        with pytest.raises(BadScoresError, match=message):  # a ValueError callers can tell from the others
            soft_topk(x, 2, sorted=sorted, mask=mask, backend=backend)
    x = torch.randn(3, 6, device=device)
    x[1, 2] = float("inf")  # masked out: excluded, no error
    out = soft_topk(x, 2, sorted=sorted, mask=mask, backend=backend)
    assert bool(torch.isfinite(out).all()) and float(out[1, 2].abs().sum()) == 0.0


@pytest.mark.parametrize("backend, row", [  # the C unsorted forward: a row of a group of 16, and one alone
    pytest.param("triton", 1, marks=BACKENDS[0].marks),  # (Triton: one program per row, either way)
    ("cpu", 1), ("cpu", 32), ("torch", 1), ("torch", 32)])
@pytest.mark.parametrize("sorted", [False, True])
def test_scores_too_large_for_the_paper_scaling_raise_instead_of_nan(backend, sorted, row):
    """Past |x| ~ 1.8e19 the paper scaling's temperature overflows float32 (the cost squares the scores): it is
    +inf, every normalised score 0 -- the limit, a uniform output, as at 1e30 --, unless the row's range itself
    overflows (x - centre = inf: inf / inf = NaN). There every backend raises, naming the cause and the fix. Before
that, the temperature's slope (epsilon x) can overflow too: the gradient stays finite."""
    warnings.simplefilter("ignore", RuntimeWarning)  # overflowing scores are the input here (pytest restores)
    torch.manual_seed(row)
    x = torch.randn(33 if backend != "triton" else 3, 6, device=_device(backend))  # (the interpreter: few rows)
    x[row, 3] = 1e30
    xg = x.clone().requires_grad_()
    out = soft_topk(xg, 2, sorted=sorted, scaling="paper", backend=backend)
    assert bool(torch.isfinite(out).all())
    ref_x = x.cpu().clone().requires_grad_()  # and the same values and gradient as the PyTorch path there
    ref = soft_topk(ref_x, 2, sorted=sorted, scaling="paper", backend="torch")
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=2e-5, rtol=0)  # the other rows: float32 solves
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(row))
    (out * g.to(out.device)).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), ref_x.grad, atol=2e-5, rtol=0)
    assert float(out[row].abs().sum()) > 0 and bool((out[row].cpu() == ref[row].detach()).all())  # the +inf one
    # d eps / d x = epsilon x overflows too (dL/deps = 0 at an infinite temperature): the gradient is no 0 * inf.
    x[row, 3] = 1e37
    xg = x.clone().requires_grad_()
    out = soft_topk(xg, 2, sorted=sorted, scaling="paper", epsilon=100.0, backend=backend)
    (out * torch.randn_like(out)).sum().backward()
    assert bool(torch.isfinite(xg.grad).all())
    x[row, 4] = -3e38
    x[row, 3] = 3e38
    with pytest.raises(ValueError, match="scores too large for scaling='paper'.*scaling='none'"):
        soft_topk(x, 2, sorted=sorted, scaling="paper", backend=backend)
    out = soft_topk(x, 2, sorted=sorted, backend=backend)  # a given temperature: nothing overflows
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sorted", [False, True])
def test_masks_short_and_empty_rows(backend, sorted):
    torch.manual_seed(1)
    device = _device(backend)
    x = torch.randn(5, 9, device=device)
    mask = torch.ones(5, 9, dtype=torch.bool, device=device)
    mask[0, :3] = False
    mask[1, :7] = False   # 2 valid < k
    mask[2] = False       # empty
    x[3, 4] = -torch.inf
    a, b, _, _ = _both(x, 3, backend, epsilon=0.4, sorted=sorted, mask=mask)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert bool((a[~mask] == 0).all()) and bool(torch.isfinite(a).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sorted", [False, True])
def test_backward_matches_torch_path(backend, sorted):
    torch.manual_seed(2)
    device = _device(backend)
    x = torch.randn(4, 23, device=device)
    mask = torch.rand(4, 23, device=device) > 0.2
    mask[3, 1:] = False  # a short row
    w = torch.randn(4, 23, 4, device=device) if sorted else torch.randn(4, 23, device=device)
    grads = []
    for b in (backend, "torch"):
        xg = x.clone().requires_grad_()
        (soft_topk(xg, 4, epsilon=0.3, sorted=sorted, mask=mask, backend=b, scaling="paper") * w).sum().backward()
        grads.append(xg.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_sorted_gradient_is_zero_where_the_clamped_forward_is_flat(backend):
    """At epsilon = 1e-30 every gap between the scores is far past LOGIT_CLAMP in units of eps: the forward is
    constant in x, its plan's off entries at the clamp's floor (exp(-64) ~ 1.6e-28). The backward must give 0
    there; weighing the floor entries by 1 / eps, as the closed form alone does, gave gradients of ~300."""
    torch.manual_seed(0)
    device = _device(backend)
    x = torch.randperm(36, device=device).float().view(3, 12).requires_grad_()  # gaps >= 1
    out = soft_topk(x, 3, epsilon=1e-30, sorted=True, backend=backend)
    assert bool(((out > 0) & (out < 1e-27)).any())  # the floor entries are there
    nudged = soft_topk(x.detach() + 0.1 * torch.rand_like(x), 3, epsilon=1e-30, sorted=True, backend=backend)
    assert torch.equal(out.detach(), nudged)  # flat: the true gradient is 0
    (out * torch.randn_like(out)).sum().backward()
    assert float(x.grad.abs().max()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scaling", ["none", "paper"])
def test_sorted_ties_and_excluded_entries_among_the_top_scores(backend, scaling):
    """Tied scores at and around the k-th largest (the centre and the starting thresholds come from the
    top-(k+1), which the Triton kernel finds one distinct value per pass), -inf among them, a row whose valid
    entries are all tied, and a row of 3 valid entries for k = 4: the same output and gradient as the PyTorch
    path."""
    device = _device(backend)
    x = torch.tensor([[2.0, 1.0, 2.0, 1.0, 1.0, 0.0, 2.0, -1.0, 1.0, 0.0, 3.0, 0.5],
                      [0.5, -torch.inf, 0.5, 0.5, -torch.inf, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
                      [1.0, 1.0, -torch.inf, 4.0, 4.0, -torch.inf, 1.0, 2.0, 2.0, 2.0, -torch.inf, -5.0],
                      [-torch.inf] * 9 + [1.0, 1.0, 0.0]], device=device)
    w = torch.randn(4, 12, 4, generator=torch.Generator().manual_seed(0)).to(device)
    results = []
    for b in (backend, "torch"):
        xg = x.clone().requires_grad_()
        out = soft_topk(xg, 4, epsilon=0.3, sorted=True, backend=b, scaling=scaling)
        (out * w).sum().backward()
        results.append((out.detach(), xg.grad))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-5, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scaling", ["none", "paper"])
@pytest.mark.parametrize("k", [1, 3, 37, 64, 299])
def test_unsorted_centre_and_start_for_any_k(backend, scaling, k):
    """The unsorted kernels find the centre x_(k) and the (k+1)-th score themselves (Triton: a bisection on the
    scores' order, 32 passes for any k; C: an insertion into the top-(k+1) up to k = 63, a radix selection
    above, select_kth_pair): rows of negative, positive, tied, signed-zero and -inf scores, masked
    entries, a row of fewer than k valid entries, over two blocks; output and gradients (dL/deps included
    under the paper scaling) as the PyTorch path's."""
    device = _device(backend)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(6, 300, generator=gen) * 3
    x[1] = torch.randint(-2, 3, (300,), generator=gen).float()          # ties everywhere
    x[2, ::2] = -0.0                                                   # signed zeros around the centre
    x[2, 1::2] = 0.0
    x[2, :5] = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5])
    x[3] = -(torch.rand(300, generator=gen) + 1)                        # all negative
    x[4, torch.rand(300, generator=gen) < 0.5] = -torch.inf
    mask = torch.ones(6, 300, dtype=torch.bool)
    mask[5, k // 2 + 1:] = False                                       # fewer than k valid (k > 1)
    mask[0, :17] = False
    x, mask = x.to(device), mask.to(device)
    w = torch.randn(6, 300, generator=gen).to(device)
    results = []
    for b in (backend, "torch"):
        xg = x.clone().requires_grad_()
        out, info = soft_topk(xg, k, epsilon=0.3, mask=mask, backend=b, scaling=scaling, return_info=True)
        (out * w).sum().backward()
        results.append((out.detach(), xg.grad, info.iterations))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-5, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=2e-5, rtol=1e-4)
    assert float((results[0][2].cpu() - results[1][2].cpu()).abs().max()) <= 1


@pytest.mark.parametrize("backend", [*BACKENDS, "torch"])
@pytest.mark.parametrize("scaling", ["none", "paper"])
@pytest.mark.parametrize("rows, n, k", [(8, 300, 280), (8, 300, 299), (8, 1000, 995), (32, 12, 7)])
def test_unsorted_rows_selecting_almost_everything_converge(backend, scaling, rows, n, k):
    """Near k = n the unsorted search evaluates f from the unselected side (n - k - sum_i sigmoid(tau - u_i)):
    summed as sum_i A_i - k, float32 rounding of a total near k stopped the rows at an error of 3e-5..1e-4 of
    n - k, reported not converged (tol 1e-6), after more steps on the C path. Every row converges, and the
    unselected mass, summed in float64 from the output, is n - k. (12 x 7, 32 rows: the C path's groups.)"""
    gen = torch.Generator().manual_seed(n + k)
    x = (torch.randn(rows, n, generator=gen) * 2).to(_device(backend))
    out, info = soft_topk(x, k, epsilon=0.1, scaling=scaling, backend=backend, return_info=True)
    assert bool(info.converged.all()), info.error.max()
    unselected = (1 - out.double()).sum(-1)
    torch.testing.assert_close(unselected, torch.full_like(unselected, n - k), atol=1e-5 * (n - k), rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_stream_in_several_blocks(backend):
    torch.manual_seed(3)
    x = torch.randn(2, 3000, device=_device(backend))
    a, b, _, _ = _both(x, 5, backend, epsilon=0.05, sorted=True)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_is_refused_by_the_fused_backends(backend):
    with pytest.raises(ValueError, match="float32"):
        soft_topk(torch.randn(2, 5, dtype=torch.float64, device=_device(backend)), 2, backend=backend)


# ---- the C kernels only: cheap enough for harder cases -------------------------------------------------


@pytest.mark.parametrize("sorted", [False, True])
@pytest.mark.parametrize("case", ["huge", "tiny_eps", "ties", "smallest", "many_ranks"])
def test_cpu_kernels_on_hard_inputs(sorted, case):
    torch.manual_seed(4)
    x, k, kw = torch.randn(6, 300), 5, dict(epsilon=0.1)
    if case == "huge":
        x = x * 1e30
        kw = dict(epsilon=1e29)
    elif case == "tiny_eps":
        kw = dict(epsilon=1e-3)
    elif case == "ties":
        x = torch.randint(0, 4, (6, 300)).float()
    elif case == "smallest":
        kw = dict(epsilon=0.2, largest=False)
    else:
        k = 40
    a, b, ia, ib = _both(x, k, "cpu", sorted=sorted, **kw)
    assert bool(torch.isfinite(a).all())
    torch.testing.assert_close(a, b, atol=5e-5, rtol=0)
    assert float(ia.error.max()) <= max(float(ib.error.max()) * 10, 1e-5)
    xg = [x.clone().requires_grad_() for _ in range(2)]
    w = torch.randn(a.shape)
    for xi, backend in zip(xg, ("cpu", "torch")):
        (soft_topk(xi, k, sorted=sorted, backend=backend, **kw) * w).sum().backward()
    assert bool(torch.isfinite(xg[0].grad).all())
    scale = float(xg[1].grad.abs().max()) + 1e-30
    # (at eps = 1e-3 the gradient moves by 1/eps times the float32 rounding of the thresholds)
    torch.testing.assert_close(xg[0].grad / scale, xg[1].grad / scale, atol=1e-3, rtol=0)


def test_auto_uses_the_cpu_kernels_for_float32(monkeypatch):
    """float32 on CPU: the C kernels -- without a mask (and sorted, at a constant temperature) through their fused
    fast path, with a mask or the sorted paper scaling through the backend interface --; float64 and Sinkhorn:
    the PyTorch path."""
    calls = []
    names = ("forward", "unsorted_forward", "unsorted_fused_forward", "sorted_fused_forward")
    for name in names:
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    x = torch.randn(3, 20)
    soft_topk(x, 3, sorted=True)
    soft_topk(x, 3, sorted=True, scaling="paper")
    soft_topk(x, 3, sorted=False)
    soft_topk(x, 3, sorted=False, mask=x > -1)
    expected = ["sorted_fused_forward", "forward", "unsorted_fused_forward", "unsorted_forward"]
    assert calls == expected
    soft_topk(x.double(), 3, sorted=True)   # float64: the PyTorch path
    soft_topk(x, 3, sorted=True, method="sinkhorn", tol=0, max_iter=20)  # (tol=0: exactly max_iter, no warning)
    soft_topk(x, 3, sorted=False, backend="torch")
    assert calls == expected


def test_cpu_backend_on_cuda_tensors_is_a_clear_error():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA tensor")
    with pytest.raises(ValueError, match="CPU tensors"):
        soft_topk(torch.randn(2, 5, device="cuda"), 2, backend="cpu", sorted=True)


CACHE_PROBE = r"""
import os, sys, warnings
import torch
from softtopk_fairseq.ops import cpu_kernels, soft_topk
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = soft_topk(torch.randn(2, 8), 3, sorted=True)
print("sum", round(float(out.sum()), 4))
print("fallback" if any("falling back" in str(w.message) for w in caught) else "fused")
try:
    soft_topk(torch.randn(2, 8), 3, sorted=True, backend="cpu")
except RuntimeError as e:
    print("error:", str(e).splitlines()[0])
print(sorted(os.listdir(cpu_kernels.cache_dir())))
"""


def test_kernels_are_built_once_into_the_cache_dir(tmp_path):
    env = dict(os.environ, SOFTTOPK_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", CACHE_PROBE], env=env, capture_output=True, text=True)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        assert "sum 6.0" in run.stdout and "fused" in run.stdout and "error" not in run.stdout
    libs = [f for f in os.listdir(tmp_path) if f.endswith(".so")]
    assert len(libs) == 1 and libs[0].startswith("soft_topk_cpu_")  # no leftover temporary file either
    assert runs[0].stdout.splitlines()[-1] == runs[1].stdout.splitlines()[-1]


def test_without_a_compiler_auto_falls_back_and_cpu_backend_says_why(tmp_path):
    env = dict(os.environ, SOFTTOPK_CACHE_DIR=str(tmp_path), CC=str(tmp_path / "no-such-cc"))
    run = subprocess.run([sys.executable, "-c", CACHE_PROBE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sum 6.0" in run.stdout and "fallback" in run.stdout
    assert "error: soft_topk: backend='cpu' cannot run: the fused CPU kernels could not be built" in run.stdout


@pytest.mark.parametrize("scaling", ["none", "paper"])
@pytest.mark.parametrize("sorted", [False, True])
def test_cpu_rows_solved_in_groups_match_rows_solved_alone(sorted, scaling):
    """Many short rows (n <= 64, k + 1 <= 8) go through the C kernels 16 at a time, one per SIMD lane; the
    rows past the last full group, and a row solved alone, go one by one (sorted: also a group's rows with at
    most k valid scores). Same outputs, to the solver's tolerance (the sorted groups add the sums in another
    order), and iteration counts within one, with masks, -inf, short and empty rows, ties and far-apart scores
    among the lanes; the same for the gradients through them; and a row's bad score inside a group raises as it
    does alone."""
    torch.manual_seed(11)
    x = torch.randn(37, 30)  # two groups of 16 and 5 rows alone
    mask = torch.rand(37, 30) > 0.2
    mask[2] = False                    # empty
    mask[5, 3:] = False                # 3 valid <= k: all ones
    x[7, ::3] = -torch.inf
    x[9] = torch.randint(0, 3, (30,)).float()  # ties
    x[12] *= 1e4                       # far apart (rounding floor)
    x[20, :] = 0.0                     # all equal
    kw = dict(epsilon=0.3, sorted=sorted, scaling=scaling, mask=mask, backend="cpu", return_info=True)
    xg = x.clone().requires_grad_()
    out, info = soft_topk(xg, 4, **kw)
    gout = torch.randn_like(out)
    out.backward(gout)
    out = out.detach()
    for r in range(37):
        xr = x[r:r + 1].clone().requires_grad_()
        alone, info_r = soft_topk(xr, 4, **{**kw, "mask": mask[r:r + 1]})
        alone.backward(gout[r:r + 1])
        torch.testing.assert_close(out[r:r + 1], alone.detach(), atol=2e-6, rtol=0)
        torch.testing.assert_close(xg.grad[r:r + 1], xr.grad, atol=1e-5, rtol=1e-5)
        assert abs(float(info.iterations[r] - info_r.iterations[0])) <= 1
    ref = soft_topk(x, 4, **{**kw, "backend": "torch"})[0]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    assert bool((out[~mask] == 0).all()) and bool(info.converged.all())
    for value, message in ((float("nan"), "scores contain NaN"), (float("inf"), "infinity on the selected side")):
        bad = x.clone()
        bad[17, 4] = value
        with pytest.raises(BadScoresError, match=message):
            soft_topk(bad, 4, epsilon=0.3, sorted=sorted, backend="cpu")


# ---- one interface: iteration counts, fallback ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sorted", [False, True])
@pytest.mark.parametrize("case", ["generic", "ties", "large_u", "masked", "paper", "two_clusters"])
def test_iteration_counts_agree_with_the_torch_path(backend, sorted, case):
    """Same solver, same damping rule: per row, the fused kernels take the Newton steps the PyTorch solver
    takes (within one: float rounding differs between languages), and few rows differ at all. At tol 1e-5,
    above float32's rounding floor (rows stopping at the floor stop after a rounding-dependent count). The
    two-clusters case is one where the trust region matters: without it the kernels take fewer steps on
    half of the rows (sorted; the unsorted operator is one safeguarded scalar root per row everywhere)."""
    torch.manual_seed(6)
    device = _device(backend)
    x, kw = torch.randn(16, 60, device=device), dict(epsilon=0.1)
    if case == "ties":
        x = torch.randint(0, 3, (16, 60), device=device).float()
    elif case == "large_u":
        x, kw = x * 1e4, dict(epsilon=1e-2)
    elif case == "masked":
        x[torch.rand(16, 60, device=device) < 0.4] = -torch.inf
        x[3, 2:] = -torch.inf
    elif case == "paper":
        kw = dict(epsilon=0.1, scaling="paper")
    elif case == "two_clusters":
        x[:, :30] += 8
        kw = dict(epsilon=1.0)
    k = 4
    _, fused = soft_topk(x, k, sorted=sorted, backend=backend, return_info=True, tol=1e-5, **kw)
    _, ref = soft_topk(x, k, sorted=sorted, backend="torch", return_info=True, tol=1e-5, **kw)
    diff = (fused.iterations.cpu() - ref.iterations.cpu()).abs()
    assert float(diff.max()) <= 1 and int((diff > 0).sum()) <= 2, (fused.iterations, ref.iterations)
    assert bool(fused.converged.all())


def test_auto_falls_back_to_torch_when_a_triton_launch_fails(monkeypatch):
    """A compile or driver error in the Triton kernels under backend='auto': one warning that says why, the
    PyTorch path's result; naming backend='triton' raises the error instead."""
    if not _triton_usable():
        pytest.skip("no triton runtime")
    from softtopk_fairseq.ops import backends, triton_kernels

    def broken(*args, **kwargs):
        raise RuntimeError("ptxas fatal: simulated failure")

    monkeypatch.setattr(triton_kernels, "forward", broken)
    monkeypatch.setattr(backends.TritonBackend, "auto_device", lambda self, x: True)  # as if x were on CUDA ...
    monkeypatch.setattr(backends, "on_cpu_kernels", lambda backend: False)  # ... so not the C kernels' fast path
    monkeypatch.setattr(backends, "_disabled", {})
    x = torch.randn(3, 12, device=TRITON_DEVICE)
    with pytest.warns(RuntimeWarning, match="triton kernels are not used.*ptxas fatal: simulated failure"):
        out = soft_topk(x, 3, sorted=True)
    torch.testing.assert_close(out, soft_topk(x, 3, sorted=True, backend="torch"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second call is silent, and still right
        torch.testing.assert_close(soft_topk(x, 3, sorted=True), out)
    with pytest.raises(backends.KernelError, match="ptxas fatal"):
        soft_topk(x, 3, sorted=True, backend="triton")


def test_missing_triton_auto_warns_and_named_backend_raises(monkeypatch):
    if not _triton_usable():
        pytest.skip("no triton runtime")
    from softtopk_fairseq.ops import backends

    monkeypatch.setattr(backends.TritonBackend, "usable", lambda self: "triton is not installed (test)")
    monkeypatch.setattr(backends.TritonBackend, "auto_device", lambda self, x: True)  # as if x were on CUDA ...
    monkeypatch.setattr(backends, "on_cpu_kernels", lambda backend: False)  # ... so not the C kernels' fast path
    monkeypatch.setattr(backends, "_disabled", {})
    x = torch.randn(2, 9, device=TRITON_DEVICE)
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        out = soft_topk(x, 2, sorted=True)
    torch.testing.assert_close(out, soft_topk(x, 2, sorted=True, backend="torch"))
    with pytest.raises(backends.KernelError, match="triton is not installed"):
        soft_topk(x, 2, sorted=True, backend="triton")


# ---- the criterion and the top-k attention end to end on each fused backend ----------------------------


def _forced(backend, fn):
    from softtopk_fairseq.ops import use_backend

    with use_backend(backend):
        return fn()


@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_beam_criterion_on_the_fused_backend_matches_the_torch_path(backend, monkeypatch):
    """The whole criterion (tiny LSTM, float32, rho 0.5) with every soft_topk call forced onto the backend
    (Triton in the interpreter on CPU): same loss and gradients as on the PyTorch path, and the forced
    backend's kernels really ran."""
    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion
    from softtopk_fairseq.ops import backends
    from tiny_models import TinyTask, batch, build, dictionary

    calls = []
    real = backends.select
    monkeypatch.setattr(backends, "select", lambda *a: (lambda impl: calls.append(impl.name) or impl)(real(*a)))
    d = dictionary(12)
    device = _device(backend)
    sample = batch(d)
    sample = {k: ({kk: vv.to(device) for kk, vv in v.items()} if isinstance(v, dict)
                  else v.to(device) if torch.is_tensor(v) else v) for k, v in sample.items()}
    results = []
    for b in (backend, "torch"):
        model = build("lstm", d, dtype=torch.float32).to(device)
        criterion = SoftBeamSearchCriterion(TinyTask(d), SoftBeamSearchConfig(
            sentence_avg=False, label_smoothing=0.1, teacher_forcing_ratio=0.5, soft_beam_size=3))
        loss, _, _ = _forced(b, lambda: criterion(model, sample))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        if b == backend:  # every soft_topk call of the forced run, forward and backward, on the backend
            assert calls and set(calls) == {backend}
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-4, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


# (under the interpreter, the Triton variant is slow: one program per attention row, in Python)
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=[*BACKENDS[0].marks, *(
    [] if torch.cuda.is_available() else [pytest.mark.slow])]), "cpu"])
def test_topk_attention_model_on_the_fused_backend_matches_the_torch_path(backend, monkeypatch):
    """A tiny transformer_topk_attn (SOFT top-k in all three attentions, unsorted operator) forward and
    backward with its soft_topk calls forced onto the backend: same output and gradients as the PyTorch path."""
    from softtopk_fairseq.ops import backends
    from tiny_models import batch, build, dictionary

    calls = []
    real = backends.select
    monkeypatch.setattr(backends, "select", lambda *a: (lambda impl: calls.append(impl.name) or impl)(real(*a)))
    fused = cpu_kernels.unsorted_fused_forward  # the C kernels' thin path (unsorted, no mask): no select
    monkeypatch.setattr(cpu_kernels, "unsorted_fused_forward", lambda *a: calls.append("cpu") or fused(*a))
    thin = backends.TritonBackend.thin_forward  # the Triton kernels' thin path: no select either
    monkeypatch.setattr(backends.TritonBackend, "thin_forward", lambda self, *a: calls.append("triton") or thin(self, *a))
    d = dictionary(12)
    device = _device(backend)
    ni = {k: v.to(device) for k, v in batch(d)["net_input"].items()}
    results = []
    for b in (backend, "torch"):
        model = build("transformer_topk_attn", d, dtype=torch.float32, topk_attn_k=2, topk_attn_mode="soft_topk",
                      topk_attn_layers="encoder-decoder,decoder-self,encoder-self").to(device)
        out, _ = _forced(b, lambda: model(**ni))
        out.float().pow(2).mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        if b == backend:  # every soft_topk call of the forced run, forward and backward, on the backend
            assert calls and set(calls) == {backend}
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-4, rtol=1e-4)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_use_backend_rejects_unknown_names_and_restores():
    from softtopk_fairseq.ops import backends, use_backend

    with pytest.raises(ValueError, match="use_backend"):
        with use_backend("gpu"):
            pass
    with use_backend("torch"):
        with use_backend("cpu"):
            assert backends.resolve("auto") == "cpu"
        assert backends.resolve("auto") == "torch" and backends.resolve("cpu") == "cpu"
    assert backends.resolve("auto") == "auto"


def _allocations(fn):
    """The sizes of the CPU allocations of one call of ``fn`` (after a warm-up call), each counted once: at the
    profiler event that made it, not again at the events around it."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sorted(e.cpu_memory_usage for e in prof.events()
                  if e.cpu_memory_usage > 0 and not any(c.cpu_memory_usage > 0 for c in e.cpu_children))


@pytest.mark.parametrize("paper", [False, True])
def test_the_common_unsorted_call_on_cpu_allocates_its_output_and_gradient_only(paper):
    """soft_topk(scores, k, epsilon=...) on float32 CPU scores, the most common call, is one C call each way
    around which nothing else is allocated: the output, the gradient and -- under the paper scaling -- the
    per-row temperature, where its maximum sits and d eps / d x there (the backward's)."""
    x, w = torch.randn(3, 64, 100), torch.randn(3, 64, 100)
    scaling = "paper" if paper else "none"
    temperature = [2 * 192 * 4, 192 * 8] if paper else []  # (eps and slope: one float32 tensor; where: int64)
    assert _allocations(lambda: soft_topk(x, 5, epsilon=0.1, scaling=scaling)) == sorted([x.nbytes, *temperature])

    def forward_backward():
        soft_topk(x.detach().requires_grad_(), 5, epsilon=0.1, scaling=scaling).backward(w)

    assert _allocations(forward_backward) == sorted([x.nbytes, x.nbytes, *temperature])


@pytest.mark.parametrize("sorted", [False, True])
def test_the_common_call_on_cpu_matches_the_general_path_bit_for_bit(sorted):
    """The thin path (defaults for tol and max_iter, scores contiguous and selected along their last dimension)
    and the general ones (the same tolerance spelled out; the scores transposed; the backend interface, which a
    mask of all True takes) compute the same bits, forward and backward, and report the same refusals."""
    from softtopk_fairseq import defaults

    x = torch.randn(4, 7, 40)
    w = torch.randn(4, 7, 40, 3) if sorted else torch.randn(4, 7, 40)
    results = []
    for call in (lambda s: soft_topk(s, 3, epsilon=0.2, sorted=sorted),
                 lambda s: soft_topk(s, 3, epsilon=0.2, sorted=sorted, tol=defaults.TOL_FLOAT32),
                 lambda s: soft_topk(s.transpose(1, 2), 3, epsilon=0.2, sorted=sorted, dim=1).transpose(1, 2),
                 lambda s: soft_topk(s, 3, epsilon=0.2, sorted=sorted, mask=torch.ones_like(s, dtype=torch.bool))):
        xg = x.detach().requires_grad_()
        out = call(xg)
        out.backward(w)
        results.append((out.detach(), xg.grad))
    for out, grad in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(grad, results[0][1])
    bad = x.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        soft_topk(bad, 3, epsilon=0.2, sorted=sorted)
    with pytest.raises(ValueError, match="k must be in"):
        soft_topk(x, 41, epsilon=0.2, sorted=sorted)


class _Launches(TorchDispatchMode):
    """Counts the Triton kernels launched (each kernel object of ``triton_kernels`` wrapped) and records every
    torch operation issued outside them (the interpreter's own tensor work inside a launch is not the caller's)."""

    def __init__(self, monkeypatch):
        super().__init__()
        from softtopk_fairseq.ops import triton_kernels

        self.launches, self.operations, self._inside = [], [], False
        for name in dir(triton_kernels):
            if name.endswith("_kernel"):
                monkeypatch.setattr(triton_kernels, name, self._counted(name, getattr(triton_kernels, name)))

    def _counted(self, name, kernel):
        mode = self

        class Counted:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    mode.launches.append(name)
                    mode._inside = True
                    try:
                        return kernel[grid](*args, **kwargs)
                    finally:
                        mode._inside = False
                return launch

        return Counted()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside:
            self.operations.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def take(self):
        taken = self.launches[:], self.operations[:]
        self.launches.clear()
        self.operations.clear()
        return taken


# Operations that launch nothing on a device: allocations and views (metadata only).
_NO_LAUNCH = {"empty", "view", "select", "detach", "alias", "_unsafe_view", "as_strided"}


@pytest.mark.parametrize("check_errors", [True, False])
@pytest.mark.parametrize("scaling", ["none", "paper"])
@pytest.mark.parametrize("sorted", [False, True])
def test_the_triton_call_is_one_launch_each_way(sorted, scaling, check_errors, monkeypatch):
    """The Triton kernels' thin path: forward one launch (checks, temperature, centre, start, solve), backward one
    launch (the paper scaling's share of the gradient included), and around them only the outputs' allocations
    and views -- no fill, no reduction, no element-wise kernel; checked, one copy of the rows' status to the
    host, unchecked nothing read back. Counted on CPU tensors under the interpreter: on a GPU each counted
    operation would be a launch."""
    if not _triton_usable():
        pytest.skip("no triton runtime")
    from host_reads import HostReads

    x = torch.randn(2, 2, 12).requires_grad_()  # (any batch shape: selected along the last dimension)
    grad = torch.randn(2, 2, 12, 3) if sorted else torch.randn(2, 2, 12)
    with _Launches(monkeypatch) as mode, HostReads() as reads:
        out = soft_topk(x, 3, epsilon=0.5, sorted=sorted, scaling=scaling, check_errors=check_errors,
                        backend="triton")
        forward = mode.take()
        out.backward(grad)
        backward = mode.take()
    kind = "forward" if sorted else "unsorted_forward"
    assert forward[0] == [f"soft_topk_{kind}_kernel"], forward
    assert backward[0] == [f"soft_topk_{kind.replace('forward', 'backward')}_kernel"], backward
    copies = forward[1].count("_to_copy")
    assert copies == reads.count == (1 if check_errors else 0)
    assert set(forward[1]) - {"_to_copy"} <= _NO_LAUNCH and set(backward[1]) <= _NO_LAUNCH, (forward, backward)
    alone = x.detach().requires_grad_()
    expected = soft_topk(alone, 3, epsilon=0.5, sorted=sorted, scaling=scaling, backend="torch")
    expected.backward(grad)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(x.grad, alone.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("paper", [False, True])
def test_triton_sorted_forward_split_across_programs_matches_one_program_per_row(paper):
    """A few long rows go to several programs each (``triton_kernels.split_parts``): every evaluation is
    rows x parts programs storing partial sums, then one program per row adds them up and takes the
    single-program kernel's decision (second start, step, halving, stop). The same output (to float rounding:
    the partial sums are added in another order), iterations, status and temperature as one program per row --
    with a mask, -inf, a bad row (reported, its output NaN), far-apart scores -- and the same capped rows at a
    small ``max_iter``."""
    if not _triton_usable():
        pytest.skip("no triton runtime")
    from softtopk_fairseq.ops import triton_kernels as tk
    from softtopk_fairseq.ops.backends import score_bound, top_anchor
    from softtopk_fairseq.ops.kernel_interface import BAD_NAN, CAPPED

    torch.manual_seed(21)
    x = torch.randn(4, 1100, device=TRITON_DEVICE)  # (3 parts of 2, 2 and 1 blocks of 256)
    mask = torch.rand(4, 1100, device=TRITON_DEVICE) > 0.1
    x[1, ::7] = -torch.inf
    x[2, 5] = float("nan")
    x[3] *= 50.0
    k = 5
    eps, temperature = (None, (top_anchor(k, True), 0.1)) if paper else (0.1, None)
    args = (x, mask, eps, k, score_bound(torch.float32, k))
    for tol, max_iter in ((1e-6, 50), (1e-12, 1), (1e-6, 0)):  # (max_iter 0: the start, reported capped)
        one = tk.forward(*args, tol, max_iter, temperature, parts=1)
        split = tk.forward(*args, tol, max_iter, temperature, parts=3)
        assert torch.equal(one[2], split[2])  # status: the same bits per row
        assert bool(split[2][2] & BAD_NAN) and bool(split[0][2].isnan().all())
        assert bool((split[2][[0, 1]] & CAPPED != 0).all()) == (max_iter <= 1)
        torch.testing.assert_close(split[0], one[0], atol=2e-6, rtol=0, equal_nan=True)
        assert (one[1][:, 0] - split[1][:, 0]).abs().max() <= 1
        for a, b in zip(one[3:], split[3:]):  # the paper scaling's eps, at, slope
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_sorted_forward_splits_rows_only_when_they_are_few_and_long(monkeypatch):
    """One program per row unless the rows are too few for half of the GPU's SMs and long enough for four blocks a
    program (then about two programs per SM); never on CPU tensors (the interpreter)."""
    from types import SimpleNamespace

    if not _triton_usable():
        pytest.skip("no triton runtime")
    from softtopk_fairseq.ops import triton_kernels as tk

    assert tk.split_parts(8, 50000, 256, torch.device("cpu")) == 1
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")
    assert tk.split_parts(8, 50000, 256, cuda) == 33  # 2 x 132 programs over 8 rows
    assert tk.split_parts(2, 5000, 256, cuda) == 5  # 4 blocks a program
    assert tk.split_parts(66, 50000, 256, cuda) == 1 and tk.split_parts(8, 1000, 256, cuda) == 1


def test_the_split_sorted_forward_launches_by_rounds_and_reads_one_flag_per_check(monkeypatch):
    """The split solve's launches: the start, rounds of (evaluate, step) in checks of ``SPLIT_ROUNDS``, the
    output; one value read back per check (whether a row is still going), nothing else; and it stops at the
    first check that finds every row stopped. Counted on CPU tensors under the interpreter."""
    if not _triton_usable():
        pytest.skip("no triton runtime")
    from host_reads import HostReads

    from softtopk_fairseq.ops import triton_kernels as tk
    from softtopk_fairseq.ops.backends import score_bound

    x = torch.randn(2, 600, device=TRITON_DEVICE)
    with _Launches(monkeypatch) as mode, HostReads() as reads:
        out, info, *_ = tk.forward(x, None, 0.1, 3, score_bound(torch.float32, 3), 1e-6, 50, parts=3)
        launches, _ = mode.take()
    rounds = launches[1:-1]
    assert launches[0] == "sorted_split_start_kernel" and launches[-1] == "sorted_split_output_kernel"
    assert rounds == ["sorted_split_evaluate_kernel", "sorted_split_step_kernel"] * (len(rounds) // 2)
    checks = len(rounds) // 2 // tk.SPLIT_ROUNDS
    assert len(rounds) // 2 == checks * tk.SPLIT_ROUNDS and reads.count == checks
    # the longest row evaluated at least the start and each Newton step once, at most the two starts and
    # MAX_HALVINGS tries per step: the loop ran those rounds, and stopped within a check of them
    steps = int(info[:, 0].max())
    assert checks * tk.SPLIT_ROUNDS >= 1 + steps and (checks - 1) * tk.SPLIT_ROUNDS < 2 + steps * tk.MAX_HALVINGS
    assert bool(torch.isfinite(out).all())


def test_cpu_sorted_groups_follow_the_row_by_row_solve_without_halvings():
    """``max_halvings`` 0 allows no try of a Newton step: the grouped sorted solve stops after one counted step at
    its start, as the row-by-row solve does (and the same output)."""
    from softtopk_fairseq.ops import backends, cpu_kernels
    from softtopk_fairseq.ops.backends import score_bound

    if backends.CPU.usable() is not None:
        pytest.skip("no C compiler")
    torch.manual_seed(5)
    x = torch.randn(16, 32)  # one group
    eps = torch.full((16,), 0.1)
    args = (None, eps, 3, score_bound(torch.float32, 3), 1e-6, 50)
    out, info = cpu_kernels.forward(x, *args, max_halvings=0)[:2]
    assert bool((info[:, 0] == 1).all()), info[:, 0]
    for r in range(16):
        alone, info_r = cpu_kernels.forward(x[r:r + 1], None, eps[r:r + 1], *args[2:], max_halvings=0)[:2]
        torch.testing.assert_close(out[r:r + 1], alone, atol=1e-6, rtol=0)
        assert float(info_r[0, 0]) == 1.0


def test_the_triton_backend_refuses_a_triton_older_than_the_kernels_support(monkeypatch):
    """A triton older than backends.TRITON_OLDEST (torch 2.4 pins 3.0, whose compiler and interpreter fail in the
    kernels) makes the Triton backend unusable, saying which version and why, so that ``auto`` runs the PyTorch
    path with a warning instead of failing inside a kernel; the answer is found once per process."""
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", "3.0.0")
    backends._triton_problem.cache_clear()
    try:
        why = backends.TRITON.usable()
        assert why is not None and "triton 3.0.0 is older than 3.6" in why
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        assert backends.TRITON.usable() == why  # (cached: the version is read once)
        backends._triton_problem.cache_clear()
        assert backends.TRITON.usable() is None
    finally:
        backends._triton_problem.cache_clear()
