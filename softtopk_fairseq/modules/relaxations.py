r"""The relaxations of top-k, in one registry: what the soft beam search and the top-k attention select with.

Each relaxation is one class, registered under one name; the criterion (``--soft-beam-relaxation``), the
attention architectures (``--topk-attn-mode``, ``--topk-attn-inference``) and the Python functions
(``soft_beam_search(relaxation=...)``, ``topk_attention_weights(mode=...)``) all take these names:

* ``soft_topk`` -- SOFT top-k, entropic optimal transport (:func:`~softtopk_fairseq.ops.soft_topk`): beam search
  (sorted) and attention (unsorted);
* ``softmax_k_times`` -- k successive softmaxes (:func:`~softtopk_fairseq.ops.softmax_k_times`): beam search;
* ``perturbed`` -- the hard top-k under Gaussian noise (:func:`~softtopk_fairseq.ops.perturbed_topk`): beam search
  (sorted) and attention (unsorted);
* ``hard_topk`` -- the hard top-k itself, no relaxation: attention (softmax over the k largest scores);
* ``softmax`` -- no top-k at all: attention (plain softmax, the baseline).

``epsilon`` is every relaxation's smoothing scale: the temperature of SOFT top-k and of softmax-k-times, the
standard deviation of the perturbed top-k's noise. ``samples``: the perturbed top-k's Gaussian draws.

Adding a relaxation is one class here -- a subclass of :class:`Relaxation` with a ``name``, the ``uses`` it
serves and the hooks of those uses -- and one line: :func:`register` (a decorator; also for relaxations defined
outside this package). The hooks:

* the beam search (``uses`` has ``"search"``): :meth:`Relaxation._relax` -- the sorted relaxed top-k of a
  step's candidate scores -- and the pruning bound's :meth:`Relaxation.pruned_terms` /
  :meth:`Relaxation.pruned_bound`;
* the attention (``"attention"``): :meth:`Relaxation.attention_scores` -- the masked attention scores with the
  selection applied, which a softmax turns into weights (by default ``s + log A`` with ``A``
  :meth:`Relaxation.indicator`, the unsorted relaxed top-k of the scores).

Names of earlier versions are kept as aliases (:data:`ALIASES`: ``ot`` and ``soft`` for ``soft_topk``, ``hard``
for ``hard_topk``), accepted everywhere with a one-time ``FutureWarning``.
"""
import math
import warnings
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple, Type

import torch
from torch import Tensor

from softtopk_fairseq import defaults
from softtopk_fairseq.ops import (BadScoresError, bad_score_rows, divide_by_temperature, effective_epsilon,
                                  perturbed_topk, soft_topk, softmax_k_times)
from softtopk_fairseq.ops.arguments import count_problems, solver_option_problems, temperature_problems
from softtopk_fairseq.ops.soft_topk import SCALINGS

USES = ("search", "attention")
# log A is taken of A floored here in the attention: a key that far outside the top k gets weight <= 1e-30 *
# softmax, and its gradient through log is cut instead of overflowing to NaN.
LOG_FLOOR = 1e-30


# How option_problems names the options: the Python arguments (the criterion and the attention layers pass
# their flags' names).
ARGUMENT_NAMES = {"epsilon": "epsilon", "scaling": "scaling", "tol": "tol", "max_iter": "max_iter",
                  "samples": "samples"}


def option_problems(epsilon, scaling=defaults.OPERATOR_SCALING, tol=None, max_iter=None,
                    samples=defaults.PERTURBED_SAMPLES, names: Mapping[str, str] = ARGUMENT_NAMES) -> List[str]:
    """What is wrong with a relaxation's options, one line each naming the option by ``names``, its value and what
    it must be (empty when nothing is): ``epsilon`` a Python number > 0 (within float64's range: the scores' type,
    unknown here, sets the range the operators then hold it to -- ``ops.arguments.temperature_problems``),
    ``scaling`` one of ``ops.soft_topk.SCALINGS``, ``tol`` and ``max_iter`` the OT solver's (None: its defaults),
    ``samples`` an int >= 1. One rule for every relaxation, whether or not it uses the option, so that a bad value
    is refused before anything runs rather than ignored."""
    problems = temperature_problems(names["epsilon"], epsilon, torch.float64)
    problems += count_problems(names["samples"], samples)
    if str(scaling) not in SCALINGS:
        problems.append(f"{names['scaling']} must be one of {SCALINGS}, got {scaling!r}")
    return problems + solver_option_problems(tol, max_iter, names["tol"], names["max_iter"])


class Relaxed(NamedTuple):
    """What a relaxation computed for one beam-search step's kept candidate scores (rows, M)."""

    A: Tensor                    # (rows, M, k) the relaxed sorted top-k
    temperature: Tensor          # (rows,) the smoothing scale each row used (:meth:`Relaxation.temperature`; detached)
    iterations: Optional[Tensor]  # (rows,) the solver's iterations (None without a solver)
    error: Optional[Tensor]       # (rows,) its marginal error (None without a solver)
    capped: Optional[Tensor] = None  # (rows,) stopped at its iteration cap unconverged (None without a solver)


class Relaxation:
    """A top-k and how it is relaxed; subclasses set ``name`` and ``uses`` and override the hooks of their uses
    (module docstring). ``epsilon`` is the smoothing scale, per row through :meth:`temperature` in the search: in
    the units of the scores with ``scaling="none"``, normalised per row (per sentence) with ``"paper"``; ``tol``
    and ``max_iter`` are the OT solver's, ``samples`` the perturbed top-k's."""

    name = ""
    uses = frozenset()
    solves = False  # whether it runs the iterative OT solver, whose iterations, error and capped rows are reported

    def __init__(self, k: int, epsilon: float = defaults.EPSILON, scaling: str = defaults.OPERATOR_SCALING, *,
                 tol: Optional[float] = None, max_iter: Optional[int] = None,
                 samples: int = defaults.PERTURBED_SAMPLES):
        problems = count_problems("k", k) + option_problems(epsilon, scaling, tol, max_iter, samples)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.k, self.epsilon, self.scaling = k, epsilon, scaling
        self.tol, self.max_iter = tol, max_iter  # the OT solver's
        self.samples = samples                   # the perturbed top-k's

    def config(self) -> tuple:
        """What the relaxation computes with (its class and options): a step's CUDA graphs are keyed by it."""
        return (type(self).__name__, self.k, self.epsilon, self.scaling, self.tol, self.max_iter, self.samples)

    # ------------------------------------------------------------------------------------ the beam search ----

    def capturable(self) -> bool:
        """Whether :meth:`relax` can run inside a CUDA graph (:mod:`~softtopk_fairseq.modules.cuda_graphs`): it
        reads nothing back to the host, and gives the same result for the same scores (the graphs' backward runs
        it again). Not by default: the others read their checks back, the perturbed top-k draws noise."""
        return False

    def temperature(self, scores: Tensor) -> Tensor:
        """(rows,) the smoothing scale of each row (:func:`~softtopk_fairseq.ops.effective_epsilon`)."""
        return effective_epsilon(scores, self.k, epsilon=self.epsilon, sorted=True, scaling=self.scaling)

    def relax(self, kept: Tensor) -> Relaxed:
        """The sorted relaxed top-k of a step's kept candidate scores (-inf entries excluded). A row the operator
        refuses -- a NaN score, from a model whose output went NaN or overflowed float16 -- gets a NaN ``A``, and
        so a NaN loss and gradients, as fairseq's own criteria give: its trainer then skips the batch and lowers
        the loss scale under ``--fp16`` / ``--amp``, or raises ``FloatingPointError`` with its NaN detector's
        report, where the operator's error would end the run. Costs nothing while no row is bad: the operator's
        own check, and for :class:`OptimalTransport` not even that (it asks ``soft_topk`` for NaN rows instead of
        an error)."""
        try:
            return self._relax(kept)
        except BadScoresError:
            bad = bad_score_rows(kept)  # (rows, 1)
            relaxed = self._relax(torch.where(bad, 0.0, kept))
            return relaxed._replace(A=torch.where(bad.unsqueeze(-1), torch.nan, relaxed.A))

    def _relax(self, kept: Tensor) -> Relaxed:
        """:meth:`relax` on scores the operator accepts."""
        raise NotImplementedError(f"the {self.name} relaxation has no sorted top-k for the beam search")

    def pruned_mass(self, relaxed: Relaxed, kept: Tensor, rest: Tensor) -> Tensor:
        """(rows,) an upper bound on the rank mass (out of ``k``) the pruned candidates ``rest`` (-inf where
        kept; overwritten) would get. ``kept``: the kept scores, best first, ``relaxed`` their relaxation
        (:meth:`relax`); called under ``torch.no_grad()``. The variants split it in two hooks:
        :meth:`pruned_terms` and :meth:`pruned_bound`."""
        return self.pruned_bound(*self.pruned_terms(relaxed, kept, rest))

    def pruned_terms(self, relaxed: Relaxed, kept: Tensor, rest: Tensor) -> Tuple[Tensor, ...]:
        """What :meth:`pruned_bound` needs of one step, each term (rows, ...): the reductions over the step's
        pruned candidates. The search keeps them and bounds all its steps at once (stacked along a leading
        dimension), a few operations per update instead of per step."""
        raise NotImplementedError

    def pruned_bound(self, *terms: Tensor) -> Tensor:
        """The bound (leading dimensions, rows) from :meth:`pruned_terms`' terms (leading dimensions, rows, ...)."""
        raise NotImplementedError

    def _divide_by_temperature(self, kept: Tensor) -> Tuple[Tensor, Tensor]:
        """``kept / T`` per row, differentiable in ``T`` too (as the OT temperature is; -inf candidates stay
        -inf: :func:`~softtopk_fairseq.ops.divide_by_temperature`), and ``T`` detached."""
        temperature = self.temperature(kept)
        return divide_by_temperature(kept, temperature), temperature.detach()

    # ------------------------------------------------------------------------------------- the attention ----

    def attention_scores(self, scores: Tensor, dim: int) -> Tensor:
        """The attention scores (``-inf`` = masked; at least float32) with the selection applied, for a softmax
        along ``dim``: by default ``s + log A`` with ``A`` the unsorted relaxed top-k (:meth:`indicator`), ``A``
        floored at :data:`LOG_FLOOR`. Rows the operator refuses (a NaN or ``+inf`` score) get NaN, as
        ``torch.softmax`` would give them."""
        try:
            a = self.indicator(scores, dim)
        except BadScoresError:
            bad = bad_score_rows(scores, dim)
            a = torch.where(bad, torch.nan, self.indicator(torch.where(bad, 0.0, scores), dim))
        return torch.where(scores != -torch.inf, scores + torch.log(a.clamp_min(LOG_FLOOR)), scores)

    def indicator(self, scores: Tensor, dim: int) -> Tensor:
        """The unsorted relaxed top-k of ``scores`` along ``dim`` (like the scores, summing to ``k``)."""
        raise NotImplementedError(f"the {self.name} relaxation has no unsorted top-k for the attention")


_REGISTRY: Dict[str, Type[Relaxation]] = {}
# Names of earlier versions -> the registry's.
ALIASES = {"ot": "soft_topk", "soft": "soft_topk", "hard": "hard_topk"}
_warned = set()


def register(cls: Type[Relaxation]) -> Type[Relaxation]:
    """Register a :class:`Relaxation` subclass under its ``name`` (a class decorator)."""
    if not cls.name or not set(cls.uses) <= set(USES) or not cls.uses:
        raise ValueError(f"register: {cls.__name__} needs a name and uses among {USES}, got {cls.name!r}, "
                         f"{set(cls.uses)}")
    if cls.name in ALIASES or _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"register: the name {cls.name!r} is taken")
    _REGISTRY[cls.name] = cls
    return cls


def names(use: str) -> Tuple[str, ...]:
    """The registered relaxations that serve ``use`` (``"search"`` or ``"attention"``), in registration order."""
    return tuple(name for name, cls in _REGISTRY.items() if use in cls.uses)


def accepted_names(use: str) -> Tuple[str, ...]:
    """:func:`names` and the aliases of earlier versions that resolve to one of them (for a flag's choices)."""
    return names(use) + tuple(alias for alias, name in ALIASES.items() if name in names(use))


def resolve(name: str, use: str, where: str = "relaxation") -> str:
    """The registry's name for ``name`` (an alias resolved, with a one-time ``FutureWarning``); ValueError, naming
    ``where`` and the choices, when no relaxation of that name serves ``use`` (or ``use`` is not one of
    :data:`USES`)."""
    if use not in USES:
        raise ValueError(f"{where}: use must be one of {USES}, got {use!r}")
    name = str(name)
    if name in ALIASES:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"{where}: {name!r} is the old name of {ALIASES[name]!r}; it will be removed",
                          FutureWarning, stacklevel=3)
        name = ALIASES[name]
    if name not in names(use):
        raise ValueError(f"{where} must be one of {names(use)}, got {name!r}")
    return name


def relaxation_class(name: str, use: str, where: str = "relaxation") -> Type[Relaxation]:
    """The class registered as ``name`` (or an alias) for ``use``."""
    return _REGISTRY[resolve(name, use, where)]


def make(name: str, use: str, k: int, epsilon: float = defaults.EPSILON, where: str = "relaxation",
         **options) -> Relaxation:
    """The relaxation called ``name`` (or an alias) for ``use``, at ``k`` and ``epsilon``; ``options`` (``scaling``,
    ``tol``, ``max_iter``, ``samples``) go to its constructor."""
    return relaxation_class(name, use, where)(k, epsilon, **options)


# ---------------------------------------------------------------------------------------- the relaxations ----

@register
class OptimalTransport(Relaxation):
    """The paper's SOFT top-k (:func:`~softtopk_fairseq.ops.soft_topk`). In the beam search, sorted, called with
    ``check_errors=False``: on a GPU each of its checks would be a synchronisation per step, a wait for everything
    queued before it. A refused row comes out NaN, as :meth:`Relaxation.relax` promises, and the rows capped at
    ``max_iter`` are counted (``SoftBeamOutput.solver_capped``) for the caller to report once per batch. In the
    attention, unsorted."""

    name = "soft_topk"
    solves = True
    uses = frozenset(USES)
    check_errors = False  # the beam search's calls: NaN rows instead of an error, nothing read back

    def capturable(self):
        return not self.check_errors

    def _relax(self, kept):
        A, info = soft_topk(kept, self.k, sorted=True, epsilon=self.epsilon, scaling=self.scaling, tol=self.tol,
                            max_iter=self.max_iter, check_errors=self.check_errors, return_info=True)
        return Relaxed(A, info.temperature, info.iterations.detach(), info.error.detach(), info.capped)

    def pruned_terms(self, relaxed, kept, rest):
        r"""At the kept problem's dual potentials a candidate of score ``x`` gets
        :math:`\Gamma_l / \Gamma_{rest} = r_l\, e^{(x - x_w)(k - l)/\varepsilon}` relative to the weakest kept
        candidate ``w`` (:math:`r_l = A_{wl} / A_{w,rest}`); anchors ``k - l >= 1`` and ``x <= x_w`` give a total
        over pruned candidates of at most :math:`\frac{1 - a}{a} \sum_p e^{(x_p - x_w)/\varepsilon}`, with ``a``
        the weakest kept candidate's rest mass (capped at ``k``, the total rank mass). Terms: ``1 - a`` and the
        sum."""
        # The kept scores are sorted, best first: the weakest kept candidate w is the last. If it is -inf, fewer
        # than M candidates were live and no finite one was pruned: a = 0 there, and so is the bound (x_w is
        # clamped to a finite reference only so that -inf - x_w is not NaN).
        x_w = kept[:, -1:].clamp_min(torch.finfo(kept.dtype).min)
        rest_sum = rest.sub_(x_w).div_(relaxed.temperature.unsqueeze(-1)).exp_().sum(-1)  # terms <= 1: no overflow
        return relaxed.A[:, -1, :].sum(-1), rest_sum

    def pruned_bound(self, rank_mass, rest_sum):
        tiny = torch.finfo(rank_mass.dtype).tiny
        return (rank_mass * rest_sum / (1 - rank_mass).clamp_min(tiny)).clamp(max=self.k)  # at most k anyway

    def indicator(self, scores, dim):
        # Compiled, the refusal would not reach attention_scores' fallback (an exception is no graph's output):
        # the operator gives the refused rows NaN itself there, and the unconverged-row warning is not read back.
        return soft_topk(scores, self.k, dim=dim, epsilon=self.epsilon,
                         check_errors=not torch.compiler.is_compiling())


@register
class SoftmaxKTimes(Relaxation):
    """k successive softmaxes, rank ``l`` removing the hard top-l (:func:`~softtopk_fairseq.ops.softmax_k_times`),
    at the temperature SOFT top-k would use (the scores divided by it here, the softmaxes at temperature 1). A
    sorted relaxation only: its rank columns summed need not stay below 1 per element, so it has no unsorted
    indicator for the attention."""

    name = "softmax_k_times"
    uses = frozenset({"search"})

    def _relax(self, kept):
        scaled, temperature = self._divide_by_temperature(kept)
        return Relaxed(softmax_k_times(scaled, self.k, epsilon=1.0), temperature, None, None)

    def pruned_terms(self, relaxed, kept, rest):
        """Exact: the mass ``S_p / (S_p + S_l)`` of each rank's softmax, summed over ranks (``S`` = sums of
        ``exp(x / T)``). Terms: ``log S_p`` (rows,) and ``log S_l`` (rows, k), relative to a common reference."""
        temperature = relaxed.temperature
        # Relative to x_w, the weakest finite kept score (if some kept ones are -inf, nothing finite was pruned:
        # the sum is 0).
        x_w = torch.where(kept > -torch.inf, kept, torch.inf).amin(-1, keepdim=True)
        log_rest = torch.log(rest.sub_(x_w).div_(temperature.unsqueeze(-1)).exp_().sum(-1))
        tiny = torch.finfo(temperature.dtype).tiny
        logits = (kept - x_w) / temperature.unsqueeze(-1)
        top = torch.sort(logits, -1, descending=True).values[..., : self.k]
        lse_all = torch.logsumexp(logits, -1, keepdim=True)
        removed = torch.cumsum(torch.exp(top - lse_all), -1) - torch.exp(top - lse_all)  # mass of the top-l
        return log_rest, lse_all + torch.log((1 - removed).clamp_min(tiny))

    def pruned_bound(self, log_rest, lse_kept):
        return torch.sigmoid(log_rest.unsqueeze(-1) - lse_kept).sum(-1)


@register
class Perturbed(Relaxation):
    """The perturbed top-k of Berthet et al. (:func:`~softtopk_fairseq.ops.perturbed_topk`), ``samples`` draws per
    call, noise from torch's default generator. In the beam search, sorted, with noise scale ``sigma = epsilon``
    per row through :meth:`temperature` -- the same per-sentence normalisation as the OT temperature with
    ``scaling="paper"``. The hard top-k does not change when all scores are divided by one positive number, so
    ``top-k(x + sigma Z) = top-k(x / sigma + Z)``: the operator runs at sigma 1 on the scores divided by each
    row's sigma (differentiable in it, as the OT temperature is). In the attention, unsorted, ``sigma =
    epsilon`` in the units of the scores."""

    name = "perturbed"
    uses = frozenset(USES)

    def _relax(self, kept):
        scaled, sigma = self._divide_by_temperature(kept)
        return Relaxed(perturbed_topk(scaled, self.k, sigma=1.0, samples=self.samples, sorted=True), sigma, None,
                       None)

    def pruned_terms(self, relaxed, kept, rest):
        r"""A pruned candidate ``p`` (``x_p <= x_k``, the k-th best kept score) holds a rank of
        ``top-k(x + sigma Z)`` only if it beats one of the k best kept candidates ``j``, so its rank mass is at
        most :math:`\sum_{j \le k} \Phi((x_p - x_j) / (\sigma\sqrt 2)) \le k\,\Phi((x_p - x_k)/(\sigma\sqrt 2))`
        -- a bound on the expectation, not on the Monte-Carlo estimate; summed over ``p``, capped at ``k``. Term:
        the log of the sum over ``p``."""
        sigma = relaxed.temperature.unsqueeze(-1)
        x_k = kept[:, self.k - 1: self.k]
        live = (rest > -torch.inf) & (x_k > -torch.inf)
        z = torch.where(live, (rest - torch.where(live, x_k, 0.0)) / (sigma * math.sqrt(2.0)), -torch.inf)
        return (torch.logsumexp(torch.special.log_ndtr(z), -1),)

    def pruned_bound(self, log_sum):
        return torch.exp(log_sum.clamp(max=0.0) + math.log(self.k))

    def indicator(self, scores, dim):
        return perturbed_topk(scores, self.k, dim=dim, sigma=self.epsilon, samples=self.samples)


@register
class HardTopK(Relaxation):
    """The hard top-k, no relaxation (no gradient through which entries are selected). Attention: softmax over the
    k largest scores (the Explicit Sparse Transformer), ties at the k-th score all kept."""

    name = "hard_topk"
    uses = frozenset({"attention"})

    def attention_scores(self, scores, dim):
        kth = torch.topk(scores, self.k, dim=dim).values.narrow(dim, self.k - 1, 1)
        return scores.masked_fill(scores < kth, -torch.inf)


@register
class Softmax(Relaxation):
    """No top-k: plain softmax attention, the baseline of the top-k attention (one model definition for every arm
    of a comparison)."""

    name = "softmax"
    uses = frozenset({"attention"})

    def attention_scores(self, scores, dim):
        return scores
