r"""Top-k sparse attention weights (paper App. I.3) and the two baselines, from masked attention scores.

Given scores :math:`s_j` over the keys (``-inf`` = masked: padding, causal future):

* ``"softmax"`` -- plain attention, :math:`\mathrm{softmax}(s)`;
* ``"soft"``    -- SOFT top-k attention, :math:`\mathrm{softmax}(s + \log A^\varepsilon(s))` with
  :math:`A^\varepsilon` the unsorted SOFT top-k of the scores over the keys (so mass concentrates on about k
  keys, and training stays end to end);
* ``"hard"``    -- hard top-k attention (Explicit Sparse Transformer): softmax over the k largest scores;
* ``"perturbed"`` -- as ``"soft"`` with ``A`` the perturbed top-k of Berthet et al. (``ops.perturbed_topk``:
  the hard top-k averaged over ``samples`` Gaussian perturbations of standard deviation ``epsilon``, a
  Monte-Carlo gradient). Random: each call draws fresh noise (torch's default generator).

Rows with at most k valid keys attend to all of them (``A = 1`` there, so all three equal softmax); fully
masked rows get all-zero weights (plain softmax would give NaN). A row holding a NaN or ``+inf`` score (a float16
overflow of ``q.k``, say) gets NaN weights in every mode, as ``torch.softmax`` gives: the loss and gradients are
then non-finite, which fairseq's trainer handles as it does for its own attention -- the batch is skipped and the
loss scale lowered under ``--fp16`` / ``--amp``, a ``FloatingPointError`` with its NaN detector's report otherwise
-- where the operators' refusal (``ops.BadScoresError``) would end the run. ``log A``
is taken of ``A`` floored at ``LOG_FLOOR``: a key that far outside the top k gets weight
``<= 1e-30 * softmax``, and its gradient through ``log`` is cut instead of overflowing to NaN.
"""
import math
from typing import List

import torch
from torch import Tensor

from softtopk_fairseq.ops import BadScoresError, bad_score_rows, perturbed_topk, soft_topk

MODES = ("softmax", "soft", "hard", "perturbed")
LOG_FLOOR = 1e-30
DEFAULT_SAMPLES = 16  # Gaussian perturbations per call of the "perturbed" mode


def topk_attention_weights(scores: Tensor, k: int, *, mode: str = "soft", epsilon: float = 0.1,
                           dim: int = -1, samples: int = DEFAULT_SAMPLES) -> Tensor:
    """Attention weights along ``dim`` (summing to 1 over the valid keys; 0 on masked keys).

    ``epsilon`` is the SOFT top-k temperature in the units of the scores (the noise's standard deviation for
    ``"perturbed"``, which draws ``samples`` perturbations). The computation runs in at least float32 and
    returns ``scores.dtype``.
    """
    if mode not in MODES:
        raise ValueError(f"topk_attention_weights: mode must be one of {MODES}, got {mode!r}")
    if k < 1:
        raise ValueError(f"topk_attention_weights: k must be >= 1, got {k}")
    x = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    valid = x != -torch.inf  # a NaN key counts: its row's weights come out NaN, as softmax's would
    if mode == "softmax" or k >= x.shape[dim]:
        pass
    elif mode == "hard":
        kth = torch.topk(x, k, dim=dim).values.narrow(dim, k - 1, 1)
        x = x.masked_fill(x < kth, -torch.inf)
    else:
        # Both relaxations treat rows with <= k valid keys as "select all" (A = 1 on valid keys).
        def relaxed_topk(scores_: Tensor) -> Tensor:
            if mode == "soft":
                return soft_topk(scores_, k, dim=dim, epsilon=epsilon)
            return perturbed_topk(scores_, k, dim=dim, sigma=epsilon, samples=samples)

        try:
            a = relaxed_topk(x)
        except BadScoresError:  # NaN weights on the rows the operator refused, as softmax gives (module docstring)
            bad = bad_score_rows(x, dim)
            a = torch.where(bad, torch.nan, relaxed_topk(torch.where(bad, 0.0, x)))
        x = torch.where(valid, x + torch.log(a.clamp_min(LOG_FLOOR)), x)
    # A fully masked row (e.g. a padding query) would be softmax(-inf, ...) = NaN: give it zeros instead.
    alive = valid.any(dim=dim, keepdim=True)
    weights = torch.softmax(torch.where(alive, x, torch.zeros_like(x)), dim=dim)
    return torch.where(alive & valid, weights, torch.zeros_like(weights)).to(scores.dtype)


def topk_option_problems(k: int, epsilon: float, mode: str = "soft", inference: str = "same",
                         samples: int = DEFAULT_SAMPLES) -> List[str]:
    """What is wrong with the top-k attention options, one line each naming the flag (``--topk-attn-*``), its
    value and what it must be (empty when nothing is): the layers refuse such options, and the demo pipeline
    checks its own with it before anything runs."""
    problems = []
    if mode not in MODES:
        problems.append(f"--topk-attn-mode must be one of {MODES}, got {mode!r}")
    if inference not in MODES + ("same",):
        problems.append(f"--topk-attn-inference must be one of {MODES + ('same',)}, got {inference!r}")
    if k < 1:
        problems.append(f"--topk-attn-k must be >= 1, got {k}")
    if not (math.isfinite(epsilon) and epsilon > 0):
        problems.append(f"--topk-attn-epsilon must be a finite number > 0, got {epsilon}")
    if samples < 1:
        problems.append(f"--topk-attn-samples must be >= 1, got {samples}")
    return problems


class TopkAttentionMixin:
    """Mode switching shared by the top-k attention layers."""

    topk_k: int
    topk_epsilon: float
    topk_mode: str
    topk_inference: str
    topk_samples: int

    def configure_topk(self, k: int, epsilon: float, mode: str, inference: str, samples: int = DEFAULT_SAMPLES):
        problems = topk_option_problems(k, epsilon, mode, inference, samples)
        if problems:
            raise ValueError("top-k attention: " + "; ".join(problems))
        self.topk_k, self.topk_epsilon, self.topk_mode, self.topk_inference = k, epsilon, mode, inference
        self.topk_samples = samples
        return self

    @property
    def active_topk_mode(self) -> str:
        if self.training or self.topk_inference == "same":
            return self.topk_mode
        return self.topk_inference

    def topk_weights(self, scores: Tensor, dim: int) -> Tensor:
        return topk_attention_weights(scores, self.topk_k, mode=self.active_topk_mode, epsilon=self.topk_epsilon,
                                      dim=dim, samples=getattr(self, "topk_samples", DEFAULT_SAMPLES))
