"""A faithful re-implementation of the authors' released sorted SOFT top-k (App. H code listing).

For comparison only -- benchmarks and compatibility tests. It keeps their behaviour on purpose, defects
included: the cost is divided by a *batch-wide* maximum, ``-inf`` is filled with a batch-wide value (so rows
of a batch change each other's output, and masked entries can be selected), and it always runs a fixed
number of Sinkhorn iterations with no convergence check. Only the ``.cuda()`` calls became ``device=``.
Use :func:`softtopk_fairseq.ops.soft_topk` for real work.
"""
import torch
import torch.nn.functional as F
from torch.autograd import Function


def sinkhorn_forward(C, mu, nu, epsilon, max_iter):
    bs, n, k_ = C.size()
    v = torch.ones([bs, 1, k_], dtype=C.dtype, device=C.device) / k_
    G = torch.exp(-C / epsilon)
    for _ in range(max_iter):
        u = mu / (G * v).sum(-1, keepdim=True)
        v = nu / (G * u).sum(-2, keepdim=True)
    return u * G * v


def sinkhorn_forward_stablized(C, mu, nu, epsilon, max_iter):
    bs, n, k_ = C.size()
    f = torch.zeros([bs, n, 1], dtype=C.dtype, device=C.device)
    g = torch.zeros([bs, 1, k_], dtype=C.dtype, device=C.device)
    epsilon_log_mu = epsilon * torch.log(mu)
    epsilon_log_nu = epsilon * torch.log(nu)

    def min_epsilon_row(Z, epsilon):
        return -epsilon * torch.logsumexp((-Z) / epsilon, -1, keepdim=True)

    def min_epsilon_col(Z, epsilon):
        return -epsilon * torch.logsumexp((-Z) / epsilon, -2, keepdim=True)

    for _ in range(max_iter):
        f = min_epsilon_row(C - g, epsilon) + epsilon_log_mu
        g = min_epsilon_col(C - f, epsilon) + epsilon_log_nu
    return torch.exp((-C + f + g) / epsilon)


def sinkhorn_backward(grad_output_Gamma, Gamma, mu, nu, epsilon):
    nu_ = nu[:, :, :-1]
    Gamma_ = Gamma[:, :, :-1]
    bs, n, k_ = Gamma.size()
    inv_mu = 1.0 / (mu.view([1, -1]))
    Kappa = torch.diag_embed(nu_.squeeze(-2)) - torch.matmul(Gamma_.transpose(-1, -2) * inv_mu.unsqueeze(-2), Gamma_)
    inv_Kappa = torch.inverse(Kappa)
    Gamma_mu = inv_mu.unsqueeze(-1) * Gamma_
    L = Gamma_mu.matmul(inv_Kappa)
    G1 = grad_output_Gamma * Gamma
    g1 = G1.sum(-1)
    G21 = (g1 * inv_mu).unsqueeze(-1) * Gamma
    g1_L = g1.unsqueeze(-2).matmul(L)
    G22 = g1_L.matmul(Gamma_mu.transpose(-1, -2)).transpose(-1, -2) * Gamma
    G23 = -F.pad(g1_L, pad=(0, 1), mode="constant", value=0) * Gamma
    G2 = G21 + G22 + G23
    g2 = G1.sum(-2).unsqueeze(-1)
    g2 = g2[:, :-1, :]
    G31 = -L.matmul(g2) * Gamma
    G32 = F.pad(inv_Kappa.matmul(g2).transpose(-1, -2), pad=(0, 1), mode="constant", value=0) * Gamma
    G3 = G31 + G32
    return (-G1 + G2 + G3) / epsilon


class TopKFunc(Function):
    @staticmethod
    def forward(ctx, C, mu, nu, epsilon, max_iter):
        with torch.no_grad():
            if epsilon > 1e-2:
                Gamma = sinkhorn_forward(C, mu, nu, epsilon, max_iter)
                if bool(torch.any(Gamma != Gamma)):
                    Gamma = sinkhorn_forward_stablized(C, mu, nu, epsilon, max_iter)
            else:
                Gamma = sinkhorn_forward_stablized(C, mu, nu, epsilon, max_iter)
            ctx.save_for_backward(mu, nu, Gamma)
            ctx.epsilon = epsilon
        return Gamma

    @staticmethod
    def backward(ctx, grad_output_Gamma):
        mu, nu, Gamma = ctx.saved_tensors
        with torch.no_grad():
            grad_C = sinkhorn_backward(grad_output_Gamma, Gamma, mu, nu, ctx.epsilon)
        return grad_C, None, None, None, None


def paper_sorted_soft_topk(scores, k, epsilon=0.1, max_iter=200):
    """The authors' ``TopK_custom(k, epsilon, max_iter)(scores)``: (bs, n) -> A (bs, n, k), rank 0 largest."""
    bs, n = scores.size()
    anchors = torch.tensor([k - i for i in range(k + 1)], dtype=scores.dtype, device=scores.device).view(1, 1, k + 1)
    scores = scores.view([bs, n, 1])
    scores_ = scores.clone().detach()
    max_scores = torch.max(scores_).detach()
    scores_[scores_ == float("-inf")] = float("inf")
    min_scores = torch.min(scores_).detach()
    filled_value = min_scores - (max_scores - min_scores)
    mask = scores == float("-inf")
    scores = scores.masked_fill(mask, filled_value)
    C = (scores - anchors) ** 2
    C = C / (C.max().detach())
    mu = torch.ones([1, n, 1], dtype=scores.dtype, device=scores.device) / n
    nu = [1.0 / n for _ in range(k)]
    nu.append((n - k) / n)
    nu = torch.tensor(nu, dtype=scores.dtype, device=scores.device).view([1, 1, k + 1])
    Gamma = TopKFunc.apply(C, mu, nu, epsilon, max_iter)
    return Gamma[:, :, :k] * n
