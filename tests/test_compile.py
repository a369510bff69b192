"""The operator is a torch.library custom op: a model using it compiles without graph breaks."""
import pytest
import torch

from softtopk_fairseq.ops import soft_topk


class TopKGate(torch.nn.Module):
    def __init__(self, sorted, scaling):
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)
        self.sorted, self.scaling = sorted, scaling

    def forward(self, x, mask):
        a = soft_topk(self.proj(x), 2, epsilon=0.3, sorted=self.sorted, mask=mask, scaling=self.scaling)
        return a.sum(-1) if self.sorted else a


@pytest.mark.parametrize("scaling", ["none", "paper"])
@pytest.mark.parametrize("sorted", [False, True])
def test_compiles_with_fullgraph_and_matches_eager(sorted, scaling):
    """Compiled: the custom op (and the paper temperature's PyTorch version); eager: the autograd.Function
    and the fused kernels. Same outputs and gradients."""
    torch.manual_seed(0)
    model = TopKGate(sorted, scaling)
    x = torch.randn(5, 6)
    mask = torch.rand(5, 6) > 0.2
    mask[:, :3] = True
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out_c = compiled(x, mask)
    out_e = model(x, mask)
    torch.testing.assert_close(out_c, out_e)
    g_c = torch.autograd.grad((out_c * torch.arange(6.0)).sum(), model.proj.weight)[0]
    g_e = torch.autograd.grad((out_e * torch.arange(6.0)).sum(), model.proj.weight)[0]
    torch.testing.assert_close(g_c, g_e)


def test_opcheck():
    x = torch.randn(3, 7, dtype=torch.float64)
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[0, 0] = False
    eps = torch.full((3,), 0.5, dtype=torch.float64, requires_grad=True)
    for sorted in (False, True):
        for check_errors in (True, False):
            torch.library.opcheck(torch.ops.softtopk_fairseq.soft_topk.default,
                                  (x.clone().requires_grad_(), valid, eps, 2, sorted, 1e-10, 50, "newton", "torch",
                                   check_errors))


def test_compiled_call_reports_the_temperature_like_eager():
    from softtopk_fairseq.ops import effective_epsilon

    torch.manual_seed(1)
    x = torch.randn(4, 9) * 3

    def temperature(scores):
        return soft_topk(scores, 2, epsilon=0.3, scaling="paper", return_info=True)[1].temperature

    got = torch.compile(temperature, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, effective_epsilon(x, 2, epsilon=0.3, scaling="paper"))
    torch.testing.assert_close(got, temperature(x))
