r"""Top-k sparse attention weights (paper App. I.3) and their baselines, from masked attention scores.

Given scores :math:`s_j` over the keys (``-inf`` = masked: padding, causal future), the weights are a softmax of
the scores with the selection of a relaxation applied (``mode``: a name of
:mod:`~softtopk_fairseq.modules.relaxations` that serves the attention):

* ``"softmax"``   -- plain attention, :math:`\mathrm{softmax}(s)`;
* ``"soft_topk"`` -- SOFT top-k attention, :math:`\mathrm{softmax}(s + \log A^\varepsilon(s))` with
  :math:`A^\varepsilon` the unsorted SOFT top-k of the scores over the keys (so mass concentrates on about k
  keys, and training stays end to end);
* ``"hard_topk"`` -- hard top-k attention (Explicit Sparse Transformer): softmax over the k largest scores;
* ``"perturbed"`` -- as ``"soft_topk"`` with ``A`` the perturbed top-k of Berthet et al. (``ops.perturbed_topk``:
  the hard top-k averaged over ``samples`` Gaussian perturbations of standard deviation ``epsilon``, a
  Monte-Carlo gradient). Random: each call draws fresh noise (torch's default generator).

Rows with at most k valid keys attend to all of them (``A = 1`` there, so every mode equals softmax); fully
masked rows get all-zero weights (plain softmax would give NaN). A row holding a NaN or ``+inf`` score (a float16
overflow of ``q.k``, say) gets NaN weights in every mode, as ``torch.softmax`` gives: the loss and gradients are
then non-finite, which fairseq's trainer handles as it does for its own attention -- the batch is skipped and the
loss scale lowered under ``--fp16`` / ``--amp``, a ``FloatingPointError`` with its NaN detector's report otherwise
-- where the operators' refusal (``ops.BadScoresError``) would end the run. The same holds compiled
(``torch.compile(..., fullgraph=True)``) in every mode but ``"perturbed"``, whose noise seed is drawn on the host:
it compiles with graph breaks only.
"""
from typing import List, Mapping

import torch
from torch import Tensor

from softtopk_fairseq import defaults
from softtopk_fairseq.modules import relaxations
from softtopk_fairseq.modules.relaxations import Relaxation
from softtopk_fairseq.ops.arguments import check_scores, count_problems

USE = "attention"
INFERENCE_SAME = "same"  # --topk-attn-inference: eval mode uses the training mode's weights


def weights_from(relaxation: Relaxation, scores: Tensor, dim: int = -1) -> Tensor:
    """Attention weights along ``dim`` (summing to 1 over the valid keys; 0 on masked keys) with ``relaxation``'s
    selection (:meth:`~softtopk_fairseq.modules.relaxations.Relaxation.attention_scores`). The computation runs
    in at least float32 and returns ``scores.dtype``."""
    x = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    valid = x != -torch.inf  # a NaN key counts: its row's weights come out NaN, as softmax's would
    if relaxation.k < x.shape[dim]:  # (with at most k keys every mode selects them all: softmax)
        x = relaxation.attention_scores(x, dim)
    # A fully masked row (e.g. a padding query) would be softmax(-inf, ...) = NaN: give it zeros instead.
    alive = valid.any(dim=dim, keepdim=True)
    weights = torch.softmax(torch.where(alive, x, torch.zeros_like(x)), dim=dim)
    return torch.where(alive & valid, weights, torch.zeros_like(weights)).to(scores.dtype)


def topk_attention_weights(scores: Tensor, k: int, *, mode: str = defaults.TOPK_ATTN_MODE,
                           epsilon: float = defaults.EPSILON, dim: int = -1,
                           samples: int = defaults.PERTURBED_SAMPLES) -> Tensor:
    """Attention weights along ``dim`` (summing to 1 over the valid keys; 0 on masked keys) in ``mode`` (module
    docstring).

    ``epsilon`` is the SOFT top-k temperature in the units of the scores (the noise's standard deviation for
    ``"perturbed"``, which draws ``samples`` perturbations). The computation runs in at least float32 and
    returns ``scores.dtype``.
    """
    check_scores("topk_attention_weights", scores, dim)
    problems = topk_option_problems(k, epsilon, mode, INFERENCE_SAME, samples, names=ARGUMENT_NAMES)
    if problems:
        raise ValueError("topk_attention_weights: " + "; ".join(problems))
    relaxation = relaxations.make(mode, USE, k, epsilon, samples=samples, where="topk_attention_weights: mode")
    return weights_from(relaxation, scores, dim)


# How topk_option_problems names the options: the layers' flags, or topk_attention_weights' arguments.
TOPK_FLAGS = {"k": "--topk-attn-k", "epsilon": "--topk-attn-epsilon", "samples": "--topk-attn-samples",
              "mode": "--topk-attn-mode", "inference": "--topk-attn-inference"}
ARGUMENT_NAMES = {"k": "k", "epsilon": "epsilon", "samples": "samples", "mode": "mode", "inference": "inference"}


def topk_option_problems(k: int, epsilon: float, mode: str = defaults.TOPK_ATTN_MODE,
                         inference: str = defaults.TOPK_ATTN_INFERENCE, samples: int = defaults.PERTURBED_SAMPLES,
                         names: Mapping[str, str] = TOPK_FLAGS) -> List[str]:
    """What is wrong with the top-k attention options, one line each naming the option by ``names`` (the flags
    ``--topk-attn-*`` by default), its value and what it must be (empty when nothing is): the layers refuse such
    options, and the demo pipeline checks its own with it before anything runs. Old names of the modes are
    accepted (with a warning); ``epsilon`` and ``samples`` follow every relaxation's rule
    (:func:`~softtopk_fairseq.modules.relaxations.option_problems`)."""
    problems = []
    for option, value, extra in (("mode", mode, ()), ("inference", inference, (INFERENCE_SAME,))):
        if str(value) not in extra + relaxations.accepted_names(USE):
            problems.append(f"{names[option]} must be one of {extra + relaxations.names(USE)}, got {value!r}")
    problems += count_problems(names["k"], k)
    problems += relaxations.option_problems(epsilon, samples=samples,
                                            names=dict(relaxations.ARGUMENT_NAMES, epsilon=names["epsilon"],
                                                       samples=names["samples"]))
    return problems


def check_topk_options(k: int, epsilon: float, mode: str, inference: str,
                       samples: int = defaults.PERTURBED_SAMPLES) -> None:
    """Raise ValueError, naming each flag, its value and what it must be, for :func:`topk_option_problems`."""
    problems = topk_option_problems(k, epsilon, mode, inference, samples)
    if problems:
        raise ValueError("top-k attention: " + "; ".join(problems))


class TopkAttentionMixin:
    """Mode switching shared by the top-k attention layers: one relaxation for training, one for eval mode. The
    options are set by :meth:`configure_topk` (the architectures call it from their flags), not kept in the state
    dict: a layer loaded on its own keeps the options it was built with."""

    topk_k: int
    topk_epsilon: float
    topk_mode: str
    topk_inference: str
    topk_samples: int

    def configure_topk(self, k: int, epsilon: float, mode: str, inference: str,
                       samples: int = defaults.PERTURBED_SAMPLES):
        check_topk_options(k, epsilon, mode, inference, samples)
        mode = relaxations.resolve(mode, USE, "--topk-attn-mode")
        if inference != INFERENCE_SAME:
            inference = relaxations.resolve(inference, USE, "--topk-attn-inference")
        self.topk_k, self.topk_epsilon, self.topk_mode, self.topk_inference = k, epsilon, mode, inference
        self.topk_samples = samples
        return self

    def extra_repr(self) -> str:
        """The options, in the model printout fairseq-train logs."""
        options = f"k={self.topk_k}, mode={self.topk_mode}, inference={self.topk_inference}"
        options += f", epsilon={self.topk_epsilon}"
        return options + (f", samples={self.topk_samples}" if "perturbed" in (self.topk_mode, self.topk_inference)
                          else "")

    @property
    def active_topk_mode(self) -> str:
        if self.training or self.topk_inference == INFERENCE_SAME:
            return self.topk_mode
        return self.topk_inference

    def topk_weights(self, scores: Tensor, dim: int) -> Tensor:
        return weights_from(self._topk_relaxation(self.active_topk_mode), scores, dim)

    def _topk_relaxation(self, mode: str) -> Relaxation:
        """The relaxation of ``mode`` at the layer's options, made once (the options may be set after
        :meth:`configure_topk`, e.g. by a tool that switches the inference mode)."""
        key = (mode, self.topk_k, self.topk_epsilon, self.topk_samples)
        cache = self.__dict__.setdefault("_topk_relaxations", {})
        if key not in cache:
            cache[key] = relaxations.make(mode, USE, self.topk_k, self.topk_epsilon, samples=self.topk_samples,
                                          where="--topk-attn-mode")
        return cache[key]
