r"""Closed-form implicit backward of SOFT top-k (the paper's Theorem 3 / Algorithm 4), O(n m) per row.

In the normalised units of :mod:`softtopk_fairseq.ops.solvers` (``u = x / eps``, plan
:math:`P_{il} = \operatorname{softmax}_l(u_i y_l + h_l)`, potentials ``h(u)`` defined implicitly by the
anchor masses :math:`\sum_i P_{il} = c_l`, one of them pinned), let :math:`G_{il} = \partial L/\partial
P_{il}` (0 on columns that are not returned). Differentiating the softmax and the constraint gives

.. math::

    \frac{\partial L}{\partial x_i} = \frac1\varepsilon \sum_l P_{il}\,(y_l - \bar y_i)\,(G_{il} - w_l),
    \qquad \bar y_i = \sum_l P_{il} y_l,

where ``w`` solves :math:`M w = v` on the free anchors (``w = 0`` elsewhere) with
:math:`M = \operatorname{diag}(P^\top\mathbf 1) - P^\top P` -- the paper's :math:`n\,\mathcal K` -- and
:math:`v_l = \sum_i P_{il}(G_{il} - \bar G_i)`, :math:`\bar G_i = \sum_l P_{il} G_{il}`. Derivation: the
softmax gives :math:`dL = \sum_{il} P_{il}(G_{il} - \bar G_i)\,dz_{il}` with
:math:`dz_{il} = y_l\,du_i + dh_l`; the constraint gives :math:`M\,dh = -B^\top du`,
:math:`B_{il} = P_{il}(y_l - \bar y_i)`; substitute.

Masked elements have :math:`P_{i\cdot} = 0` and so get exactly zero gradient. Nothing from the forward
iterations is needed: only the plan, which is rebuilt from the operator's output.
"""
import torch

from softtopk_fairseq.ops.solvers import free_anchors, hessian_solve

Tensor = torch.Tensor


def implicit_grad(p: Tensor, grad_p: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """dL/du (rows, n) from the converged plan ``p`` (rows, n, m) and ``grad_p`` = dL/dP (rows, n, m)."""
    g_bar = (p * grad_p).sum(-1, keepdim=True)                     # (rows, n, 1)
    v = (p * (grad_p - g_bar)).sum(-2)                             # (rows, m)
    s = p.sum(-2)
    w = hessian_solve(p, s, free_anchors(c), v)                    # (rows, m)
    y_bar = (p * y).sum(-1, keepdim=True)
    return (p * (y - y_bar) * (grad_p - w.unsqueeze(-2))).sum(-1)
