"""The softmax-k-times relaxation (the paper's App. C baseline): its definition, its temperature scaling,
degenerate rows and bad input."""
import pytest
import torch

from softtopk_fairseq.ops import effective_epsilon, soft_topk, softmax_k_times


def _by_definition(x, k, T):
    """Rank l: softmax of x / T over the entries outside the hard top-l, one row at a time."""
    cols = []
    order = torch.argsort(x, descending=True)
    for rank in range(k):
        logits = (x / T).clone()
        logits[order[:rank]] = -torch.inf
        cols.append(torch.softmax(logits, -1))
    return torch.stack(cols, -1)


def test_matches_the_definition_and_columns_sum_to_one():
    torch.manual_seed(0)
    x = torch.randn(4, 9, dtype=torch.float64)
    A = softmax_k_times(x, 3, epsilon=0.3)
    assert A.shape == (4, 9, 3)
    for i in range(4):
        torch.testing.assert_close(A[i], _by_definition(x[i], 3, 0.3))
    torch.testing.assert_close(A.sum(-2), torch.ones(4, 3, dtype=torch.float64))


def test_dim_keeps_its_place():
    x = torch.randn(5, 7, dtype=torch.float64)
    A = softmax_k_times(x, 2, dim=0, epsilon=0.5)
    assert A.shape == (5, 7, 2)
    torch.testing.assert_close(A, softmax_k_times(x.t(), 2, epsilon=0.5).transpose(0, 1))


def test_paper_scaling_uses_the_ot_operators_temperature():
    """With scaling="paper", row r is the plain relaxation at soft_topk's temperature for that row."""
    torch.manual_seed(1)
    x = torch.randn(6, 11, dtype=torch.float64) * torch.tensor([0.1, 1, 3, 10, 30, 100], dtype=torch.float64)[:, None]
    x[2, 4] = -torch.inf
    k = 3
    T = effective_epsilon(x, k, epsilon=0.1, sorted=True, scaling="paper")
    assert T.shape == (6,) and bool((T > 0).all()) and len(set(T.tolist())) == 6  # per row, not one number
    A = softmax_k_times(x, k, epsilon=0.1, scaling="paper")
    for r in range(6):
        torch.testing.assert_close(A[r], softmax_k_times(x[r], k, epsilon=float(T[r])))
    # The two relaxations at one setting now see the same temperature: similar rank-0 columns when the
    # top score stands out, not one soft and one hard.
    y = torch.tensor([[5.0, 1.0, 0.5, 0.0, -1.0, -2.0]], dtype=torch.float64)
    ot = soft_topk(y, 2, sorted=True, epsilon=0.1, scaling="paper")
    skt = softmax_k_times(y, 2, epsilon=0.1, scaling="paper")
    assert abs(float(ot[0, 0, 0] - skt[0, 0, 0])) < 0.5
    assert float(softmax_k_times(y, 2, epsilon=0.1)[0, 0, 0]) > 1 - 1e-12  # 0.1 nats: one-hot


@pytest.mark.parametrize("scaling", ["none", "paper"])
def test_gradient_matches_finite_differences(scaling):
    torch.manual_seed(2)
    x = (torch.randn(3, 6, dtype=torch.float64) * 2).requires_grad_()
    w = torch.randn(3, 6, 2, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda s: (softmax_k_times(s, 2, epsilon=0.7, scaling=scaling) * w).sum(),
                                    (x,))


def test_divide_by_temperature_gradients_and_a_temperature_whose_square_underflows():
    """divide_by_temperature: gradcheck in both arguments with -inf and masked entries (zero gradient there);
    and under the paper scaling at epsilon 1e-30 (T ~ 1e-29, T**2 = 0 in float32) the saturated softmaxes'
    zero gradient stays 0 instead of 0 * inf = NaN (what x / T's own backward, -g x / T**2, gave)."""
    from softtopk_fairseq.ops import divide_by_temperature

    torch.manual_seed(2)
    x = torch.randn(3, 7, dtype=torch.float64)
    x[0, 2] = -torch.inf
    valid = torch.rand(3, 7) > 0.2
    T = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    xg = x.clone().requires_grad_()
    keep = valid & (x > -torch.inf)
    torch.autograd.gradcheck(lambda a, t: divide_by_temperature(a, t, keep).masked_fill(~keep, 0.0), (xg, T))
    out = divide_by_temperature(xg, T)
    assert out[0, 2] == -torch.inf and torch.equal(out[1], x[1] / T[1].detach())
    out.masked_fill(out == -torch.inf, 0).sum().backward()
    assert float(xg.grad[0, 2]) == 0 and bool(torch.isfinite(T.grad).all())
    # A NaN score is not an excluded entry: it stays NaN, for the relaxation it goes to to refuse.
    assert bool(torch.isnan(divide_by_temperature(torch.tensor([[1.0, torch.nan]]), torch.ones(1))[0, 1]))
    x32 = torch.randn(3, 20).requires_grad_()
    A = softmax_k_times(x32, 5, epsilon=1e-30, scaling="paper")
    (A * torch.randn(A.shape)).sum().backward()
    assert bool(torch.isfinite(x32.grad).all()) and float(x32.grad.abs().max()) == 0


def test_scores_far_apart_saturate_the_softmaxes_instead_of_nan():
    """x / T beyond float32's range: the largest scores once overflowed to +inf (a NaN softmax), the paper
    temperature's infinite limit to inf / inf, and its overflowing slope to a NaN gradient. Now the softmaxes
    saturate -- one-hot ranks in order --, an infinite temperature gives its limit (uniform softmaxes), and the
    gradients are finite."""
    x = torch.tensor([[1e30, 2e30, 0.0, 1.0], [200.0, 100.0, -1e30, 0.0]], requires_grad=True)
    for epsilon in (0.1, 1e-30):
        A = softmax_k_times(x, 2, epsilon=epsilon)
        expected = torch.zeros(2, 4, 2)
        expected[0, 1, 0] = expected[0, 0, 1] = expected[1, 0, 0] = expected[1, 1, 1] = 1.0
        assert torch.equal(A.detach(), expected)
        (A * torch.randn(A.shape)).sum().backward()
        assert bool(torch.isfinite(x.grad).all())
        x.grad = None
    y = torch.tensor([[3e38, -3e38, 0.0]], requires_grad=True)  # cost and range overflow: T = inf
    A = softmax_k_times(y, 2, epsilon=0.1, scaling="paper")
    torch.testing.assert_close(A.detach(), torch.tensor([[[1 / 3, 0.0], [1 / 3, 0.5], [1 / 3, 0.5]]]))
    (A * torch.randn(A.shape)).sum().backward()
    z = torch.tensor([[1e37, 0.0, 1.0]], requires_grad=True)  # d T / d z = epsilon z overflows
    B = softmax_k_times(z, 2, epsilon=100.0, scaling="paper")
    (B * torch.randn(B.shape)).sum().backward()
    assert bool(torch.isfinite(y.grad).all()) and bool(torch.isfinite(z.grad).all())


def test_masked_and_minus_inf_entries_get_zero_and_short_rows_zero_columns():
    x = torch.tensor([[1.0, -torch.inf, 0.5, 2.0], [0.3, -torch.inf, -torch.inf, -torch.inf],
                      [-torch.inf] * 4], requires_grad=True)
    mask = torch.tensor([[True, True, False, True], [True] * 4, [True] * 4])
    for scaling in ("none", "paper"):
        A = softmax_k_times(x, 2, epsilon=0.5, mask=mask, scaling=scaling)
        assert torch.isfinite(A).all()
        assert float(A[0, 1].detach().abs().sum()) == 0 and float(A[0, 2].detach().abs().sum()) == 0
        torch.testing.assert_close(A[0].sum(0), torch.ones(2))
        torch.testing.assert_close(A[1, :, 0], torch.tensor([1.0, 0, 0, 0]))  # one valid entry: rank 1 empty
        assert float(A[1, :, 1].detach().abs().sum()) == 0 and float(A[2].detach().abs().sum()) == 0
        A.sum().backward()
        assert torch.isfinite(x.grad).all()
        x.grad = None


@pytest.mark.parametrize("call, match", [
    (lambda: softmax_k_times(torch.tensor([1.0, float("nan")]), 1), "NaN"),
    (lambda: softmax_k_times(torch.tensor([1.0, float("inf")]), 1), "infinity on the selected side"),
    (lambda: softmax_k_times(torch.randn(3), 4), "k=4"),
    (lambda: softmax_k_times(torch.randn(3), 1, epsilon=0.0), "epsilon"),
    (lambda: softmax_k_times(torch.randn(3), 1, scaling="log"), "scaling"),
    (lambda: softmax_k_times(torch.arange(3), 1), "float"),
])
def test_bad_input_is_refused(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
