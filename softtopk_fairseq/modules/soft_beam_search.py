r"""Differentiable beam search through any fairseq incremental encoder-decoder (paper App. D, Algorithm 2, I.2).

For each target position ``t`` the decoder runs one incremental step for the ``k`` beams of every sentence
(a batch of ``bsz*k``, like fairseq's ``SequenceGenerator``). The candidate scores are the cumulative
log-likelihoods of the ``k*V`` extensions; a sorted relaxed top-k (SOFT top-k, softmax-k-times or the perturbed
top-k: :mod:`~softtopk_fairseq.modules.relaxations`) gives ``A`` (candidates x ranks), and

* the next input of beam ``l`` is ``sum_c A[c, l] * embed(token(c))`` (eq. (9), via :class:`SoftTokenInput`),
* the next state of beam ``l`` is ``sum_i W[l, i] * state_i`` with ``W[l, i] = sum_{c from beam i} A[c, l]``
  (eq. (10), via :class:`SoftOrder` in the decoder's own ``reorder_incremental_state``),
* the bookkeeping (prefix tokens, cumulative score, parent pointers) follows the hard argmax of ``A[:, l]``
  (App. I.2).

Choices this implementation makes (documented, tested):

* It decodes for the gold length of each sentence: ``eos`` and ``pad`` are excluded from the candidates at
  every step, the gold ``eos`` is scored at the sentence's last position, and positions past it are masked.
* Step 0: all ``k`` beams hold the same prefix, so only beam 0's candidates are live (the others are -inf,
  which the operator excludes) -- fairseq's generator does the same.
* The best hypothesis is the final beam with the largest ``cumulative score + log p(eos)``, as fairseq's
  generator would rank them; ``L_SOFT`` is the NLL of the gold tokens along its backtracked beams,
  ``-sum_t log p(y_t | beam at step t)``.
* Pruning: with ``candidates = M < k*V`` only the ``M`` best candidates per sentence (hard top-M) enter the
  relaxed top-k. :attr:`SoftBeamOutput.pruned_mass` bounds, per sentence and step, the rank mass the pruned
  candidates would receive (each relaxation's
  :meth:`~softtopk_fairseq.modules.relaxations.Relaxation.pruned_mass`).
"""
import functools
from typing import Callable, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from softtopk_fairseq import defaults
from softtopk_fairseq.modules import relaxations
from softtopk_fairseq.modules.cuda_graphs import GraphCache
from softtopk_fairseq.modules.relaxations import Relaxation
from softtopk_fairseq.modules.soft_reorder import SoftOrder, SoftTokenInput
from softtopk_fairseq.ops.arguments import count_problems

USE = "search"
BOOKKEEPING = ("argmax", "topk")
# How search_option_problems names the options: soft_beam_search's arguments (the criterion passes its flags).
ARGUMENT_NAMES = {"beam": "beam", "candidates": "candidates"}


def search_option_problems(beam: int, candidates: int, names: Mapping[str, str] = ARGUMENT_NAMES) -> List[str]:
    """What is wrong with the beam size and the pruning size, one line each naming the option by ``names``, its
    value and what it must be (empty when nothing is): ``beam >= 1``, and ``candidates`` 0 (all) or at least
    ``beam`` -- the relaxed top-k of fewer than k candidates has no k ranks to fill."""
    problems = count_problems(names["beam"], beam)
    if isinstance(candidates, bool) or not isinstance(candidates, int):
        problems.append(f"{names['candidates']} must be an int, 0 (all) or >= {names['beam']}, got {candidates!r}")
    elif candidates < 0 or (isinstance(beam, int) and 0 < candidates < beam):
        problems.append(f"{names['candidates']} must be 0 (all) or >= {names['beam']} ({beam}), got {candidates}")
    return problems


def vocabulary_problems(V: int, beam: int, pad: int, eos: int,
                        names: Mapping[str, str] = ARGUMENT_NAMES) -> List[str]:
    """What is wrong with the beam size for a target vocabulary of ``V`` tokens (empty when nothing is): ``pad``
    and ``eos`` must be two of its tokens, and the first step must have ``beam`` tokens to extend with (all but
    those two) -- with fewer, beams would repeat."""
    if not (0 <= pad < V and 0 <= eos < V and pad != eos):
        return [f"pad={pad} and eos={eos} must be two tokens of the vocabulary (0..{V - 1})"]
    if V - 2 < 1:
        return [f"the vocabulary of {V} tokens has none to extend a beam with besides pad and eos"]
    if beam > V - 2:
        return [f"{names['beam']} must be <= {V - 2}, the tokens a first step can extend with (the vocabulary of {V} "
                f"less pad and eos), got {beam}"]
    return []


class SoftBeamOutput(NamedTuple):
    nll: Tensor               # (bsz,) L_SOFT per sentence: gold-token NLL along the best beam (differentiable)
    hypotheses: Tensor        # (bsz, k, T) hard tokens of the final beams, best first, eos then pad
    hypothesis_scores: Tensor  # (bsz, k) cumulative log-likelihood incl. eos, best first
    solver_iterations: Tensor  # (steps,) mean solver iterations per step (0 without a solver)
    solver_error: Tensor       # (steps,) max marginal error per step (0 without a solver)
    # (steps,) the rows whose solver stopped at max_iter unconverged, per step (0 without a solver): what soft_topk
    # would warn about, which the search leaves to its caller (it reads nothing back from the device per step)
    solver_capped: Tensor
    pruned_mass: Tensor        # (bsz,) sum over steps of the pruned-mass bound (0 without pruning)
    # (bsz, T, V) the teacher-forced rows' log-probabilities (differentiable); None without ``teacher_forcing``
    teacher_forced_lprobs: Optional[Tensor] = None


def _log_probs(model, net_output) -> Tensor:
    """The model's own normalisation -- except that fairseq computes it in float32 even for float64 models,
    which would cap the precision of gradient checks: those get log_softmax in float64."""
    logits = net_output[0]
    if logits.dtype == torch.float64 and getattr(model.decoder, "adaptive_softmax", None) is None:
        return torch.log_softmax(logits, -1)
    return model.get_normalized_probs(net_output, log_probs=True)


class _Candidates(NamedTuple):
    kept: Tensor                # (bsz, M) the candidate scores entering the relaxed top-k (differentiable)
    index: Optional[Tensor]     # (bsz, M) their flat index beam * V + token; None: all k*V are kept, in order
    kept_scores: Optional[Tensor]  # (bsz, M) kept, without autograd (pruned case)
    all_scores: Optional[Tensor]   # (bsz, k*V) every candidate's score, without autograd (pruned case)


class _KeptScores(torch.autograd.Function):
    """The kept candidates' scores ``cum[b, c // V] + log p[b, c]`` with their gradient routed to ``cum`` and
    ``log p``. Their values are the top-M ``top`` found without autograd (-inf for the banned tokens and the dead
    beams' extensions, whose gradient the relaxed top-k makes 0), returned as they are (autograd gives the output
    its own view of ``top``: nothing writes either in place); the backward scatters into the M kept entries only
    -- no operation forward (two gathers, an add and a mask otherwise), and nothing k*V-sized saved."""

    @staticmethod
    def forward(ctx, cum: Tensor, lprobs: Tensor, index: Tensor, top: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.k, ctx.V = lprobs.shape[1], lprobs.shape[2]
        return top

    @staticmethod
    def backward(ctx, grad):
        index, = ctx.saved_tensors
        bsz, k, V = grad.shape[0], ctx.k, ctx.V
        grad_lprobs = grad.new_zeros(bsz, k * V).scatter_(1, index, grad).view(bsz, k, V)  # distinct indices
        # Each beam's cum is in all of its V candidates: its gradient is their sum (zeros where not kept).
        grad_cum = grad_lprobs.sum(-1) if ctx.needs_input_grad[0] else None
        return grad_cum, grad_lprobs, None, None


def _candidates(cum: Tensor, lprobs: Tensor, ban: Tensor, candidates: int) -> _Candidates:
    """The step's candidate scores ``cum + log p`` of the ``k*V`` extensions (``ban``, (V,): -inf for ``eos`` and
    ``pad``, else 0, added; the dead beams' extensions -inf through ``cum``), or with ``0 < candidates < k*V`` the
    hard top-M of them (selected without autograd: the relaxed top-k and its backward see M candidates per
    sentence instead of k*V)."""
    bsz, k, V = lprobs.shape
    if candidates <= 0 or candidates >= k * V:
        # In place on a fresh tensor (add's backward does not need it). An added -inf rather than an indexed
        # assignment: one elementwise kernel, where ``cand[:, :, banned] = -inf`` also makes the value a device
        # tensor and goes through advanced indexing's host-side set-up at every step.
        cand = (cum.unsqueeze(-1) + lprobs).add_(ban)
        return _Candidates(cand.view(bsz, k * V), None, None, None)
    with torch.no_grad():
        cand = (cum.unsqueeze(-1) + lprobs).add_(ban).view(bsz, k * V)
        top, index = torch.topk(cand, candidates, dim=1)
    return _Candidates(_KeptScores.apply(cum, lprobs, index, top), index, top, cand)


def _follow(A: Tensor, c: _Candidates, bookkeeping: str, V: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Hard bookkeeping (App. I.2): the candidate each rank continues -- the argmax of ``A[:, l]``, or the hard
    top-k of the scores (its eps -> 0 limit, always k distinct candidates) -- as (parent beam, token,
    cumulative score), each (bsz, k)."""
    k = A.shape[-1]
    best = A.detach().argmax(1) if bookkeeping == "argmax" else torch.topk(c.kept.detach(), k, dim=1).indices
    flat = best if c.index is None else c.index.gather(1, best)
    return flat // V, flat % V, c.kept.gather(1, best)


def _soft_order_and_input(A: Tensor, c: _Candidates, embed, V: int) -> Tuple[Tensor, Tensor]:
    """The soft state's mixing ``W[l, i] = sum_{c from beam i} A[c, l]`` (bsz, k, k; eq. (10)) and the soft
    inputs ``sum_c A[c, l] embed(token(c))`` (bsz, k, dim; eq. (9))."""
    bsz, k = A.shape[0], A.shape[-1]
    if c.index is None:
        A4 = A.view(bsz, k, V, k)
        mixing = A4.sum(2).transpose(1, 2)
        table = embed(torch.arange(V, device=A.device))
        return mixing, torch.matmul(A4.sum(1).transpose(1, 2).to(table.dtype), table)
    beam_of = c.index // V
    mixing = c.kept.new_zeros(bsz, k, k).scatter_add(2, beam_of.unsqueeze(1).expand(bsz, k, -1), A.transpose(1, 2))
    table = embed(c.index % V)
    return mixing, torch.bmm(A.transpose(1, 2).to(table.dtype), table)


def _backtrack(final_lp, gold_lp, parents, tokens, lengths: Tensor, pad: int,
               eos: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Every final beam backtracked from its sentence's ``eos`` position, ranked by ``cumulative score +
    log p(eos)``: (L_SOFT per sentence -- the gold tokens' NLL along the best beam --, hypotheses (bsz, k, T),
    their scores (bsz, k))."""
    final = torch.stack(final_lp, 1)                    # (bsz, T, k)
    bsz, T, k = final.shape
    last = lengths - 1                                  # index of eos in the target
    final_at_end = final.gather(1, last.view(bsz, 1, 1).expand(bsz, 1, k)).squeeze(1)
    ranked_scores, ranked = final_at_end.sort(-1, descending=True)
    steps = torch.arange(T, device=final.device).unsqueeze(1)
    at_end, active = steps == last, steps <= last       # (T, bsz): each sentence's eos step, its live steps
    # beams[t]: the beam at step t of each ranked final hypothesis, followed backwards through the parents. Past
    # its eos step a sentence's beams follow themselves (the search went on reordering them, masked), so its
    # ranked beams at the last step are those at its eos step: one gather per step, every sentence alike.
    beams = [ranked]
    if T > 1:
        itself = torch.arange(k, device=final.device).expand(bsz, k)
        parent = torch.where(active[1:].unsqueeze(-1), torch.stack(parents), itself)  # (T-1, bsz, k)
        for t in range(T - 2, -1, -1):
            beams.append(parent[t].gather(1, beams[-1]))
    beams = torch.stack(beams[::-1])                    # (T, bsz, k)
    # The token that made each beam at step t + 1 is the one its rank appended at step t; pad past eos, then eos.
    hyp_tokens = ranked.new_full((T, bsz, k), pad)
    if T > 1:
        hyp_tokens[:-1] = torch.where(active[1:].unsqueeze(-1), torch.stack(tokens).gather(2, beams[1:]), pad)
    hyps = torch.where(at_end.t().unsqueeze(1), eos, hyp_tokens.permute(1, 2, 0))
    gold = torch.stack(gold_lp, 1)                      # (bsz, T, k)
    along_best = gold.gather(2, beams[:, :, :1].transpose(0, 1)).squeeze(2)
    nll = -torch.where(active.t(), along_best, 0.0).sum(1)
    return nll, hyps, ranked_scores


def duplicate_hypotheses(hypotheses: Tensor) -> Tensor:
    """Per sentence, the final beams that repeat a better-ranked one token for token (``hypotheses``: (bsz, k,
    T), :attr:`SoftBeamOutput.hypotheses`): 0 to k - 1. ``argmax`` bookkeeping lets two ranks follow the same
    candidate when smooth columns of ``A`` share their largest entry, and the beam then holds fewer distinct
    hypotheses than k; ``topk`` bookkeeping never does (always 0)."""
    same = (hypotheses.unsqueeze(2) == hypotheses.unsqueeze(1)).all(-1)  # (bsz, k, k): beam i equals beam j
    rank = torch.arange(hypotheses.shape[1], device=hypotheses.device)
    return (same & (rank.unsqueeze(1) > rank)).any(-1).sum(-1)  # (j ranked before i)


class _Step(NamedTuple):
    """What one step decided (:func:`_search_step`): every field a tensor, a tuple of tensors or None -- what a
    CUDA graph can return (:class:`~softtopk_fairseq.modules.cuda_graphs.GraphCache`)."""

    parent: Tensor            # (bsz, k) the beam each rank continues (hard bookkeeping)
    token: Tensor             # (bsz, k) the token it appends
    cum: Tensor               # (bsz, k) its cumulative score
    mixing: Tensor            # (bsz, k, k) the state mixing W (eq. (10))
    soft: Tensor              # (bsz, k, dim) the soft inputs (eq. (9))
    iterations: Optional[Tensor]  # (bsz,) the solver's report (:class:`~.relaxations.Relaxed`); None without a solver
    error: Optional[Tensor]
    capped: Optional[Tensor]
    pruned_terms: Optional[Tuple[Tensor, ...]]  # what bounds the rank mass lost to pruning; None without pruning


def _search_step(relax: Relaxation, cum: Tensor, lprobs: Tensor, ban: Tensor, candidates: int,
                 bookkeeping: str, embed) -> _Step:
    """One step's tensor work between two decoder calls: the candidates (pruned to ``candidates`` if asked),
    their relaxed top-k ``A``, the terms of the bound on what pruning lost (:meth:`Relaxation.pruned_terms`),
    the hard bookkeeping that follows ``A``, and the state mixing and soft inputs it implies (``embed``: the
    token embedding lookup, token ids -> vectors)."""
    V = lprobs.shape[-1]
    c = _candidates(cum, lprobs, ban, candidates)
    relaxed = relax.relax(c.kept)
    pruned = None
    if c.index is not None:
        with torch.no_grad():
            rest = c.all_scores.scatter_(1, c.index, -torch.inf)  # the pruned ones (not reused)
            pruned = relax.pruned_terms(relaxed, c.kept_scores, rest)
    parent, token, cum = _follow(relaxed.A, c, bookkeeping, V)
    mixing, soft = _soft_order_and_input(relaxed.A, c, embed, V)
    return _Step(parent, token, cum, mixing, soft, relaxed.iterations, relaxed.error, relaxed.capped, pruned)


def capturable_lookup(embed) -> Optional[Callable[[Tensor, Tensor], Tensor]]:
    """``embed``'s lookup as ``lookup(index, weight)`` through ``weight.index_select`` (``weight``: embed's, or an
    alias of it), for a step captured in a CUDA graph: the same values, and a backward (an ``index_add``) that a
    graph can hold -- ``nn.Embedding``'s CUDA backward sorts the indices once there are more than 3,072 (4,096
    on sm_90) of them and reads a count back to the host (pytorch#82886): at 128 sentences and M = 50 the step
    looks up 6,400. Its adds are atomic, so the last bits of the embedding's gradient may vary from run to run;
    the padding index gets none, as with ``embed``. None when ``embed`` is not a plain ``nn.Embedding`` (no
    ``max_norm``, frequency scaling or sparse gradient) or when deterministic algorithms are asked for."""
    if (type(embed) is not torch.nn.Embedding or embed.max_norm is not None or embed.scale_grad_by_freq
            or embed.sparse or torch.are_deterministic_algorithms_enabled()):
        return None
    padding_idx = embed.padding_idx

    def lookup(index: Tensor, weight: Tensor) -> Tensor:
        rows = weight.index_select(0, index.reshape(-1)).view(*index.shape, weight.shape[1])
        if padding_idx is None:
            return rows
        return torch.where((index == padding_idx).unsqueeze(-1), rows.detach(), rows)  # no gradient, as embed's

    return lookup


def _graphed_search_step(graphs: GraphCache, lookup: Callable[[Tensor, Tensor], Tensor], relax: Relaxation,
                         cum: Tensor, lprobs: Tensor, ban: Tensor, candidates: int, bookkeeping: str, embed) -> _Step:
    """:func:`_search_step` through ``graphs``, looking up the embeddings with ``lookup``
    (:func:`capturable_lookup`): one pair of CUDA graphs per batch size (and configuration) does the step's work
    in a few launches each way (``soft_beam_search``'s ``graphs``)."""

    def step(cum, lprobs, ban, weight):
        return _search_step(relax, cum, lprobs, ban, candidates, bookkeeping, functools.partial(lookup, weight=weight))

    key = ("soft_beam_search step", relax.config(), candidates, bookkeeping, id(embed))
    return graphs(key, step, cum, lprobs, ban, embed.weight)


class _Trace:
    """What the search keeps of every step: the scores for the backtracking and L_SOFT, and the solver's and the
    pruning's reports for the logs."""

    def __init__(self, bsz: int, device: torch.device):
        self.gold_lp, self.final_lp, self.parents, self.tokens = [], [], [], []
        self.iterations, self.errors, self.capped, self.pruned = [], [], [], []  # per step; reduced in output()
        self.bsz, self.device = bsz, device

    def scores(self, lprobs: Tensor, cum: Tensor, gold: Tensor, eos: int) -> None:
        """The gold token's log-probability on every beam, and every beam's score if it ended here."""
        bsz, k, _ = lprobs.shape
        self.gold_lp.append(lprobs.gather(2, gold.view(bsz, 1, 1).expand(bsz, k, 1)).squeeze(2))
        self.final_lp.append((cum + lprobs[:, :, eos]).detach())

    def step(self, step: _Step) -> None:
        if step.iterations is not None:  # a solver's relaxation (the others report nothing: empty lists)
            self.iterations.append(step.iterations)
            self.errors.append(step.error)
            self.capped.append(step.capped)
        if step.pruned_terms is not None:
            self.pruned.append(step.pruned_terms)
        self.parents.append(step.parent)
        self.tokens.append(step.token)

    def output(self, relax: Relaxation, lengths: Tensor, pad: int, eos: int,
               teacher_forced_lprobs: Optional[Tensor] = None) -> SoftBeamOutput:
        nll, hyps, ranked_scores = _backtrack(self.final_lp, self.gold_lp, self.parents, self.tokens, lengths,
                                              pad, eos)
        zero = torch.zeros(max(len(self.final_lp) - 1, 1), device=self.device)  # one 0 per step without a solver
        return SoftBeamOutput(
            nll=nll,
            hypotheses=hyps,
            hypothesis_scores=ranked_scores,
            solver_iterations=torch.stack(self.iterations).float().mean(1) if self.iterations else zero,
            solver_error=torch.stack(self.errors).float().amax(1) if self.errors else zero,
            solver_capped=torch.stack(self.capped).sum(1) if self.capped else zero.long(),
            pruned_mass=(relax.pruned_bound(*map(torch.stack, zip(*self.pruned))).sum(0).float() if self.pruned
                         else torch.zeros(self.bsz, device=self.device)),
            teacher_forced_lprobs=teacher_forced_lprobs,
        )


class _BeamRows:
    """The decoder rows of one sentence: its ``k`` beams. The search asks these hooks at every step; a variant
    adds rows of its own (:class:`_TeacherForcedRows`)."""

    def __init__(self, k: int):
        self.k = self.per_sentence = k

    def inputs(self, beam_tokens: Tensor, t: int) -> Tensor:
        """(bsz, k, 1) the beams' input tokens at step ``t`` -> every row's (bsz, per_sentence, 1)."""
        return beam_tokens

    def split(self, lprobs: Tensor) -> Tensor:
        """(bsz, per_sentence, V) one step's log-probabilities -> the beams' (bsz, k, V)."""
        return lprobs

    def parent(self, parent: Tensor) -> Tensor:
        """(bsz, k) the row each beam continues -> every row's (bsz, per_sentence)."""
        return parent

    def mix(self, mixing: Tensor) -> Tensor:
        """(bsz, k, k) the beams' state mixing (eq. (10)) -> every row's (bsz, per_sentence, per_sentence)."""
        return mixing

    def embedded_inputs(self, soft: Tensor, t: int) -> Tensor:
        """(bsz, k, dim) the beams' soft inputs for step ``t`` -> every row's input embedding (bsz, per_sentence,
        dim), which replaces the decoder's own lookup (:class:`SoftTokenInput`)."""
        return soft

    def lprobs(self) -> Optional[Tensor]:
        """What the extra rows computed (None here)."""
        return None


class _TeacherForcedRows(_BeamRows):
    """The beams, then one teacher-forced row per sentence (``soft_beam_search``'s ``teacher_forcing``): fed
    ``prev_output_tokens``, continuing itself, its state never mixed with the beams' (mixing weight exactly 1 on
    itself, 0 on the beams); its log-probabilities collected step by step."""

    def __init__(self, prev_output_tokens: Tensor, k: int, embed):
        super().__init__(k)
        self.per_sentence = k + 1
        self.gold_inputs = prev_output_tokens
        # Every step's gold input embedded in one lookup: each step's input then replaces the decoder's own
        # lookup whole, whose backward -- a sort-based kernel sequence on CUDA -- would otherwise run every step.
        self.gold_embedded = embed(prev_output_tokens).unsqueeze(2).unbind(1)  # T x (bsz, 1, dim)
        self.itself = prev_output_tokens.new_full((prev_output_tokens.shape[0], 1), k)
        self.own_weight = torch.zeros(k + 1, k + 1, device=prev_output_tokens.device)
        self.own_weight[k, k] = 1
        self.steps: List[Tensor] = []

    def inputs(self, beam_tokens, t):
        return torch.cat([beam_tokens, self.gold_inputs[:, t, None, None]], 1)

    def split(self, lprobs):
        # One split (its backward: one cat), not two slices (each a zero-filled full-size gradient).
        beams, teacher = lprobs.split([self.k, 1], dim=1)
        self.steps.append(teacher)
        return beams

    def parent(self, parent):
        return torch.cat([parent, self.itself], 1)

    def mix(self, mixing):
        if self.own_weight.dtype != mixing.dtype:  # once per search
            self.own_weight = self.own_weight.to(mixing.dtype)
        return torch.nn.functional.pad(mixing, (0, 1, 0, 1)) + self.own_weight

    def embedded_inputs(self, soft, t):
        return torch.cat([soft, self.gold_embedded[t].to(soft.dtype)], 1)

    def lprobs(self):
        """(bsz, T, V) the teacher-forced rows' log-probabilities at every step."""
        return torch.cat(self.steps, 1)


# What the search assumes of its target, each with how a fairseq user gets it wrong (one read back for all).
_TARGET_RULES = (
    "target rows {rows} are empty (all pad={pad}); each row needs at least its eos",
    "target rows {rows} are not right-padded (pad={pad} before a token); fairseq's --left-pad-target must be False",
    "target rows {rows} do not end in eos={eos}: the search scores each sentence up to and including its eos",
    "{starts} rows {rows} do not start with eos={eos}, where the beams start (as fairseq's prev_output_tokens "
    "do; a decoder started from another token, bos or a language tag, is not supported)",
)


def _target_lengths(target: Tensor, pad: int, eos: int, starts: Optional[Tensor], starts_name: str = "") -> Tensor:
    """Each sentence's length with its eos, once ``target`` is checked: right-padded with ``pad``, each row
    ending in ``eos`` (and the decoder input ``starts``, named ``starts_name``, starting with it) -- else a wrong
    but finite L_SOFT."""
    real = target.ne(pad)
    lengths = real.sum(1)  # incl. eos
    positions = torch.arange(target.shape[1], device=target.device)
    last = target.gather(1, (lengths - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    misplaced = real.ne(positions < lengths.unsqueeze(1)).any(1)  # (its last token is then not at lengths - 1)
    broken = [lengths < 1, misplaced, last.ne(eos) & (lengths >= 1) & ~misplaced,
              starts[:, 0].ne(eos) if starts is not None else torch.zeros_like(real[:, 0])]
    broken = torch.stack(broken)
    if bool(broken.any()):
        problems = [rule.format(rows=rows.nonzero().flatten().tolist()[:8], pad=pad, eos=eos, starts=starts_name)
                    for rows, rule in zip(broken, _TARGET_RULES) if bool(rows.any())]
        raise ValueError("soft_beam_search: " + "; ".join(problems))
    return lengths


def soft_beam_search(model, src_tokens: Tensor, src_lengths: Tensor, target: Tensor, *, pad: int, eos: int,
                     beam: int = defaults.BEAM, relaxation: Union[str, Relaxation] = defaults.SEARCH_RELAXATION,
                     epsilon: float = defaults.EPSILON, scaling: str = defaults.SEARCH_SCALING,
                     tol: Optional[float] = None, max_iter: Optional[int] = None,
                     candidates: int = defaults.CANDIDATES, bookkeeping: str = defaults.BOOKKEEPING,
                     samples: int = defaults.PERTURBED_SAMPLES, encoder_out=None,
                     teacher_forcing: Optional[Tensor] = None, prev_output_tokens: Optional[Tensor] = None,
                     graphs: Optional[GraphCache] = None) -> SoftBeamOutput:
    """Run the differentiable beam search of ``model`` (a fairseq encoder-decoder with an incremental
    decoder whose ``embed_tokens`` embeds the input tokens) on a batch, for the gold length of ``target``.

    Args:
        target: (bsz, T) gold tokens, right-padded with ``pad``, each row ending in ``eos``.
        beam: k. relaxation: ``"soft_topk"`` (sorted SOFT top-k), ``"softmax_k_times"`` or ``"perturbed"``
            (:mod:`~softtopk_fairseq.modules.relaxations`), or a
            :class:`~softtopk_fairseq.modules.relaxations.Relaxation` built for this beam size (then ``epsilon``,
            ``scaling``, ``tol``, ``max_iter`` and ``samples`` are its own, not these).
        epsilon, scaling: the relaxation's temperature (the noise scale sigma for ``"perturbed"``), normalised
            per sentence with ``scaling="paper"`` (the default, the paper's setting), in units of log-likelihood
            with ``"none"`` (for every relaxation: the others then use the temperature ``soft_topk`` would).
            tol, max_iter: passed to ``soft_topk``. samples: Gaussian draws per step of ``"perturbed"``.
        candidates: M, the candidates per sentence kept before the relaxed top-k (0 or >= k*V: all; else >= k;
            :func:`search_option_problems`).
        bookkeeping: ``"argmax"`` (the paper: beam l continues the candidate with the largest ``A[:, l]``) or
            ``"topk"`` (beam l continues the l-th best candidate). With a smooth ``A`` several ranks can share
            one argmax -- duplicate beams; ``"topk"`` keeps k distinct hypotheses. Both agree as eps -> 0.
        encoder_out: ``model.encoder``'s output for ``src_tokens`` when the caller has it already; computed
            here otherwise.
        teacher_forcing: (bsz, T) the decoder's teacher-forcing input (fairseq's ``prev_output_tokens``), or
            None. Given, every step also decodes one teacher-forced row per sentence (after its ``k`` beams, fed
            the gold prefix, its state never mixed), and the output's ``teacher_forced_lprobs`` hold its
            log-probabilities: teacher forcing's loss from the search's own decoder calls -- one call per step
            for both losses instead of a second decoder pass. fairseq's incremental decoding computes what its
            full pass does, so these are the full pass's log-probabilities (tested; up to rounding and, in
            training, dropout masks).
        prev_output_tokens: (bsz, T) the decoder's input without ``teacher_forcing`` (which is checked so), or
            None: checked to start with eos, where the beams start (in the target's checks' one read).
        graphs: a :class:`~softtopk_fairseq.modules.cuda_graphs.GraphCache` (kept by the caller across batches)
            to run each step's work between two decoder calls -- candidates, relaxed top-k, bookkeeping, state
            mixing, soft inputs -- as CUDA graphs, captured once per batch size: a few launches each way instead
            of dozens, for a GPU, where an update is bound by launching them. Used on CUDA batches with the
            ``"soft_topk"`` relaxation, outside autocast (whose cast cache a graph cannot hold), for an
            ``nn.Embedding`` input embedding (:func:`capturable_lookup`); elsewhere the step runs eagerly (the
            other relaxations read their checks back or draw noise). Same results up to rounding (tested).
    """
    problems = search_option_problems(beam, candidates)
    if bookkeeping not in BOOKKEEPING:
        problems.insert(0, f"bookkeeping must be one of {BOOKKEEPING}, got {bookkeeping!r}")
    if not isinstance(relaxation, Relaxation):  # (a Relaxation's options are its own, checked when it was built)
        problems += relaxations.option_problems(epsilon, scaling, tol, max_iter, samples)
    # What the search calls: fairseq's encoder-decoder with an incremental decoder (a duck-typed check: this
    # layer imports no fairseq), named up front rather than as an AttributeError mid-search.
    missing = [f"{part}.{method}" for part, method in (("encoder", "reorder_encoder_out"),
                                                       ("decoder", "reorder_incremental_state_scripting"))
               if not callable(getattr(getattr(model, part, None), method, None))]
    if missing:
        raise TypeError(f"soft_beam_search: {type(model).__name__} lacks {', '.join(missing)}: the search needs a "
                        "fairseq encoder-decoder model (FairseqEncoderDecoderModel) whose decoder is incremental "
                        "(FairseqIncrementalDecoder)")
    decoder = model.decoder
    embed = getattr(decoder, "embed_tokens", None)
    if embed is None:
        raise TypeError(f"soft_beam_search: {type(decoder).__name__} has no embed_tokens module to feed soft "
                        "tokens through")
    if not problems and isinstance(getattr(embed, "num_embeddings", None), int):  # (the output's size: at step 0)
        problems += vocabulary_problems(embed.num_embeddings, beam, pad, eos)
    if problems:
        raise ValueError("soft_beam_search: " + "; ".join(problems))
    k = beam
    if isinstance(relaxation, Relaxation):
        if relaxation.k != k or USE not in relaxation.uses:
            raise ValueError(f"soft_beam_search: relaxation {type(relaxation).__name__} (k={relaxation.k}) is not a "
                             f"beam-search relaxation for beam={k}")
        relax = relaxation
    else:
        relax = relaxations.make(relaxation, USE, k, epsilon, where="soft_beam_search: relaxation", scaling=scaling,
                                 tol=tol, max_iter=max_iter, samples=samples)
    if not isinstance(target, torch.Tensor) or target.dim() != 2:
        raise ValueError(f"soft_beam_search: target must be a (bsz, T) tensor of gold token ids, got "
                         f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"soft_beam_search: target must hold integer token ids, got {target.dtype}")
    bsz, T = target.shape
    device = target.device
    starts_name = "teacher_forcing" if teacher_forcing is not None else "prev_output_tokens"
    starts = teacher_forcing if teacher_forcing is not None else prev_output_tokens
    if starts is not None and starts.shape != target.shape:
        raise ValueError(f"soft_beam_search: {starts_name} of shape {tuple(starts.shape)} must be shaped like "
                         f"target {tuple(target.shape)} (fairseq's prev_output_tokens)")
    lengths = _target_lengths(target, pad, eos, starts, starts_name)
    # Decoder rows per sentence: its k beams, then its teacher-forced row if asked.
    rows = _BeamRows(k) if teacher_forcing is None else _TeacherForcedRows(teacher_forcing, k, embed)

    if encoder_out is None:
        encoder_out = model.encoder(src_tokens, src_lengths=src_lengths)
    expand = torch.arange(bsz, device=device).repeat_interleave(rows.per_sentence)
    encoder_out = model.encoder.reorder_encoder_out(encoder_out, expand)
    incremental_state = {}
    prefix = rows.inputs(torch.full((bsz, k, 1), eos, dtype=torch.long, device=device), 0).view(-1, 1)
    base = (torch.arange(bsz, device=device) * rows.per_sentence).unsqueeze(1)
    trace = _Trace(bsz, device)
    cum: Optional[Tensor] = None
    search_step = _search_step
    lookup = capturable_lookup(embed)
    if (graphs is not None and relax.capturable() and lookup is not None
            and (device.type == "cuda" or graphs.emulate) and not torch.is_autocast_enabled(device.type)):
        search_step = functools.partial(_graphed_search_step, graphs, lookup)

    with SoftTokenInput(embed) as soft_input:
        for t in range(T):
            net_output = decoder(prefix, encoder_out=encoder_out, incremental_state=incremental_state)
            lprobs = _log_probs(model, net_output)
            V = lprobs.shape[-1]
            lprobs = rows.split(lprobs.view(bsz, rows.per_sentence, V))
            if cum is None:  # step 0: one live beam; eos and pad banned as extensions
                problems = vocabulary_problems(V, k, pad, eos)
                if problems:
                    raise ValueError("soft_beam_search: " + "; ".join(problems))
                cum = lprobs.new_full((bsz, k), -torch.inf)
                cum[:, 0] = 0
                ban = lprobs.new_zeros(V)
                ban[[pad, eos]] = -torch.inf
            trace.scores(lprobs, cum, target[:, t], eos)
            if t == T - 1:
                break
            # The next step's input: the decoder state mixed (eq. (10)) and the soft tokens (eq. (9)).
            step = search_step(relax, cum, lprobs, ban, candidates, bookkeeping, embed)
            trace.step(step)
            cum = step.cum
            order = (base + rows.parent(step.parent)).view(-1)
            decoder.reorder_incremental_state_scripting(incremental_state, SoftOrder(order, rows.mix(step.mixing)))
            prefix = torch.cat([prefix[order], rows.inputs(step.token.unsqueeze(-1), t + 1).view(-1, 1)], 1)
            soft_input.pending = rows.embedded_inputs(step.soft, t + 1)

    return trace.output(relax, lengths, pad, eos, rows.lprobs())
