"""``--criterion soft_beam_search``: teacher forcing mixed with differentiable beam search (paper App. D).

    L_final = rho * L_tf + (1 - rho) * L_SOFT

``L_tf`` is fairseq's ``label_smoothed_cross_entropy`` on the batch (``--label-smoothing``); ``L_SOFT`` is the
gold-token NLL along the best beam of a beam search run inside training with its top-k relaxed
(:func:`softtopk_fairseq.modules.soft_beam_search.soft_beam_search`). Both are sums over the batch, so they
share fairseq's sample size (target tokens, or sentences with ``--sentence-avg``). ``rho = 1`` is exactly
``label_smoothed_cross_entropy``; ``rho = 0`` trains through the beam search only. With
``--teacher-forcing-mode sample`` each batch takes one of the two losses (L_tf with probability rho), which is
the same objective in expectation and costs ``rho * t_tf + (1 - rho) * t_soft`` per update instead of the sum.

Data parallelism: the soft beam search calls the model's encoder and decoder step by step, not its
``forward``. Under fairseq's default ``--ddp-backend pytorch_ddp`` (c10d), torch's DistributedDataParallel
all-reduces gradients only in an iteration where its own ``forward`` ran, so a batch that computes L_SOFT
alone (``rho = 0``, or ``--teacher-forcing-mode sample`` drawing L_SOFT) would let the workers drift apart.
Such a batch therefore runs the beam search *inside* the wrapper's ``forward``
(:func:`run_inside_ddp_forward`); when the teacher-forcing pass already went through it, the beam search
shares that iteration's reduction. ``legacy_ddp`` does not depend on ``forward`` at all.

``sum`` mode runs the encoder once for both losses when the model's ``forward`` is one of fairseq's
encoder-then-decoder forwards (:data:`ENCODER_THEN_DECODER`: the transformer, LSTM and plain encoder-decoder
models, and every architecture of this plugin): the teacher-forcing decoder and the beam search read the same
encoder output -- the same dropout mask on it, an unbiased estimate of the same objective -- in one pass through
the (DDP) wrapper's ``forward``. Other models run their own ``forward`` for ``L_tf`` and the encoder again.
With ``--teacher-forcing-pass search`` the encoder-then-decoder models' ``L_tf`` comes from the beam search's
own decoder steps: each step decodes one teacher-forced row per sentence beside its ``k`` beams (fed the gold
prefix, its state never mixed), so one decoder call per step serves both losses instead of a second decoder
pass -- fairseq's incremental decoding computes what its full pass does (tested: the same loss and gradients
without dropout).
On a GPU, where an update is bound by kernel launches, that removes the teacher-forcing pass's launches; on a
CPU, bound by arithmetic, it is no faster.
``separate`` runs the decoder's full teacher-forcing pass as ``label_smoothed_cross_entropy`` does; ``auto``
(the default) is ``search`` for CUDA batches and ``separate`` otherwise.
"""
import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Tuple

import torch
from fairseq import metrics, utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.dataclass import ChoiceEnum

from softtopk_fairseq import defaults
from softtopk_fairseq.criterions.wrapped_model import (encoder_then_decoder, layer_drop_drawn_once,
                                                      refuse_fully_sharded, run_inside_ddp_forward)
from softtopk_fairseq.modules import relaxations
from softtopk_fairseq.modules.cuda_graphs import GraphCache
from softtopk_fairseq.modules.soft_beam_search import (BOOKKEEPING, USE, duplicate_hypotheses, search_option_problems,
                                                       soft_beam_search, vocabulary_problems)
from softtopk_fairseq.ops.soft_topk import SCALINGS


TEACHER_FORCING_PASSES = ("auto", "search", "separate")
SOFT_LOG_KEYS = ("soft_loss", "soft_ntokens", "soft_topk_steps", "soft_batches", "pruned_mass",
                 "soft_sentence_steps", "duplicate_beams", "soft_nsentences")  # a batch with L_SOFT
SOLVER_LOG_KEYS = ("soft_topk_iters", "soft_topk_err_max", "soft_topk_capped")  # and a relaxation that solves
CAPPED_WARNING = ("soft_beam_search: the OT solver stopped at its iteration cap above its tolerance on some rows "
                  "(counted in the logs as soft_topk_capped); raise --soft-topk-max-iter or --soft-topk-tol")


GRAPHS_UNUSED_WARNING = ("soft_beam_search: --soft-beam-cuda-graphs captured nothing, the search runs eagerly: it "
                         "needs CUDA batches, no --amp, no torch.use_deterministic_algorithms, and a decoder whose "
                         "embed_tokens is an nn.Embedding")


@dataclass
class SoftBeamSearchConfig(LabelSmoothedCrossEntropyCriterionConfig):
    teacher_forcing_ratio: float = field(
        default=defaults.TEACHER_FORCING_RATIO,
        metadata={"help": "rho in L = rho * L_tf + (1 - rho) * L_SOFT (1 = teacher forcing only)"})
    teacher_forcing_pass: ChoiceEnum(TEACHER_FORCING_PASSES) = field(
        default="auto", metadata={"help": "where --teacher-forcing-mode sum computes L_tf: 'search' decodes one "
                                          "teacher-forced row per sentence in the beam search's own decoder steps "
                                          "(one decoder call per step for both losses: fewer kernel launches on "
                                          "a GPU), 'separate' runs the decoder's full teacher-forcing pass, "
                                          "'auto' is 'search' for CUDA batches and 'separate' otherwise; the same "
                                          "loss up to dropout masks and rounding (models with a forward of their "
                                          "own: always 'separate')"})
    teacher_forcing_mode: ChoiceEnum(["sum", "sample"]) = field(
        default="sum", metadata={"help": "'sum': both losses on every batch, weighted (the paper); 'sample': each "
                                         "training batch uses L_tf with probability rho, else L_SOFT -- the same "
                                         "objective in expectation at a fraction of the cost (validation: both)"})
    soft_beam_size: int = field(default=defaults.BEAM, metadata={"help": "beam size k of the beam search run in "
                                                                         "training"})
    soft_beam_relaxation: ChoiceEnum(relaxations.names(USE)) = field(
        default=defaults.SEARCH_RELAXATION,
        metadata={"help": "the relaxed top-k: 'soft_topk' (sorted SOFT top-k), 'softmax_k_times' (k successive "
                          "softmaxes, the Goyal et al. 2018 style baseline) or 'perturbed' (the hard top-k under "
                          "Gaussian noise, Berthet et al. 2020)"})
    soft_beam_epsilon: float = field(
        default=defaults.EPSILON,
        metadata={"help": "the relaxation's smoothing scale (a temperature; for 'perturbed', the noise's standard "
                          "deviation): the paper's normalised epsilon with --soft-beam-scaling paper, in nats with "
                          "'none'"})
    soft_beam_scaling: ChoiceEnum(SCALINGS) = field(
        default=defaults.SEARCH_SCALING,
        metadata={"help": "'paper' (the paper's setting) divides the OT cost by its per-sentence maximum like the "
                          "authors' code: temperature = epsilon * max cost / 2; 'none': epsilon in nats of "
                          "log-likelihood (small values give very large gradients)"})
    soft_beam_samples: int = field(
        default=defaults.PERTURBED_SAMPLES,
        metadata={"help": "Gaussian draws per decoding step of --soft-beam-relaxation perturbed (the gradient's "
                          "variance falls as 1/samples)"})
    soft_topk_tol: Optional[float] = field(
        default=None, metadata={"help": "marginal tolerance of the OT solver (default: soft_topk's)"})
    soft_topk_max_iter: Optional[int] = field(
        default=None, metadata={"help": "iteration cap of the OT solver (default: soft_topk's)"})
    soft_beam_bookkeeping: ChoiceEnum(BOOKKEEPING) = field(
        default=defaults.BOOKKEEPING,
        metadata={"help": "which candidate beam l continues: 'argmax' of its soft top-k column (the paper, App. "
                          "I.2; smooth columns can share it: duplicate beams) or 'topk', the l-th best candidate "
                          "(always k distinct beams)"})
    soft_beam_candidates: int = field(
        default=defaults.CANDIDATES,
        metadata={"help": "keep only the best M of the k*V candidates per sentence before the relaxed top-k (0 = "
                          "all, exact). Logged as pruned_mass: an upper bound, out of k (the total rank mass), on "
                          "the rank mass the pruned candidates would get, per sentence and step -- a value near k "
                          "(e.g. 5 at beam 5) means no guarantee, not that all mass was pruned"})
    soft_beam_cuda_graphs: bool = field(
        default=False, metadata={"help": "run each decoding step's work between two decoder calls (candidates, "
                                         "relaxed top-k, bookkeeping, state mixing, soft inputs) as CUDA graphs: "
                                         "a few kernel launches per step instead of dozens, for a GPU, where a soft "
                                         "beam-search update is bound by launching them. Needs "
                                         "--soft-beam-relaxation soft_topk; used on CUDA batches outside --amp. "
                                         "Each new batch size is captured once (a synchronisation, two untimed "
                                         "runs and two captures) and keeps its buffers, a few times sentences x "
                                         "beam x vocabulary floats, on the GPU; the "
                                         f"{defaults.CUDA_GRAPH_SIZES_KEPT} most recently used sizes are kept, "
                                         "one dropped is captured again when it returns"})
    # The flags of version 0.1, kept as aliases (upgrade_config).
    soft_topk_method: Optional[str] = field(
        default=None, metadata={"help": "old name of --soft-beam-relaxation (its 'ot' is 'soft_topk')"})
    soft_topk_epsilon: Optional[float] = field(
        default=None, metadata={"help": "old name of --soft-beam-epsilon (for every relaxation but 'perturbed')"})
    perturbed_sigma: Optional[float] = field(
        default=None, metadata={"help": "old name of --soft-beam-epsilon (for --soft-beam-relaxation perturbed)"})
    perturbed_samples: Optional[int] = field(
        default=None, metadata={"help": "old name of --soft-beam-samples"})
    soft_topk_scaling: Optional[str] = field(
        default=None, metadata={"help": "old name of --soft-beam-scaling"})


# Version 0.1's flags (fields) -> the flags that replaced them.
FLAG_ALIASES = {"soft_topk_method": "soft_beam_relaxation", "soft_topk_epsilon": "soft_beam_epsilon",
                "perturbed_sigma": "soft_beam_epsilon", "perturbed_samples": "soft_beam_samples",
                "soft_topk_scaling": "soft_beam_scaling"}
_warned_flags = set()


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def upgrade_config(cfg: SoftBeamSearchConfig) -> SoftBeamSearchConfig:
    """``cfg`` (in place) with version 0.1's flags moved into the ones that replaced them (:data:`FLAG_ALIASES`),
    each with a one-time ``FutureWarning``: a command line, or a checkpoint's saved criterion config, of 0.1 means
    what it meant. 0.1 took the perturbed top-k's noise from ``--perturbed-sigma`` and every other relaxation's
    temperature from ``--soft-topk-epsilon``: the one that applies to the relaxation is used. An old flag that
    contradicts its replacement given with another value than its default raises."""
    given = {old: getattr(cfg, old, None) for old in FLAG_ALIASES if getattr(cfg, old, None) is not None}
    if "soft_topk_method" in given:
        given["soft_topk_method"] = relaxations.resolve(given["soft_topk_method"], USE, "--soft-topk-method")
    relaxation = str(given.get("soft_topk_method", cfg.soft_beam_relaxation))
    unused = "soft_topk_epsilon" if relaxation == "perturbed" else "perturbed_sigma"
    for old in given:
        if old not in _warned_flags:
            _warned_flags.add(old)
            ignored = f" (ignored: the {relaxation} relaxation does not take it, as in 0.1)" if old == unused else ""
            warnings.warn(f"soft_beam_search: {_flag(old)} is the old name of {_flag(FLAG_ALIASES[old])}; it will "
                          f"be removed{ignored}", FutureWarning, stacklevel=2)
    for old, value in given.items():
        if old == unused:
            continue  # (0.1 ignored it for this relaxation too)
        new = FLAG_ALIASES[old]
        current, default = getattr(cfg, new), SoftBeamSearchConfig.__dataclass_fields__[new].default
        if str(current) != str(default) and str(current) != str(value):
            raise ValueError(f"soft_beam_search: {_flag(old)} {value} contradicts {_flag(new)} {current}; give "
                             f"{_flag(new)} alone")
        setattr(cfg, new, value)
    return cfg


# The flags of soft_beam_search's beam and pruning arguments, and of the relaxation's options, for the rules they
# share with the Python functions (search_option_problems, relaxations.option_problems).
SEARCH_FLAGS = {"beam": "--soft-beam-size", "candidates": "--soft-beam-candidates"}
RELAXATION_FLAGS = {"epsilon": "--soft-beam-epsilon", "scaling": "--soft-beam-scaling", "tol": "--soft-topk-tol",
                    "max_iter": "--soft-topk-max-iter", "samples": "--soft-beam-samples"}


def config_problems(cfg: SoftBeamSearchConfig) -> List[str]:
    """What is wrong with the criterion's flags, one line each naming the flag, its value and what it must be
    (empty when nothing is): the criterion refuses such a config, and the demo pipeline checks its own soft
    beam-search options with it before anything runs."""
    problems = []
    if not 0.0 <= cfg.teacher_forcing_ratio <= 1.0:
        problems.append(f"--teacher-forcing-ratio must be in [0, 1], got {cfg.teacher_forcing_ratio}")
    problems += search_option_problems(cfg.soft_beam_size, cfg.soft_beam_candidates, names=SEARCH_FLAGS)
    for flag, value, allowed in (("--soft-beam-relaxation", cfg.soft_beam_relaxation, relaxations.names(USE)),
                                 ("--soft-beam-bookkeeping", cfg.soft_beam_bookkeeping, BOOKKEEPING)):
        if str(value) not in allowed:
            problems.append(f"{flag} must be one of {allowed}, got {value!r}")
    problems += relaxations.option_problems(cfg.soft_beam_epsilon, str(cfg.soft_beam_scaling), cfg.soft_topk_tol,
                                            cfg.soft_topk_max_iter, cfg.soft_beam_samples, names=RELAXATION_FLAGS)
    if cfg.ignore_prefix_size > 0:
        problems.append(f"--ignore-prefix-size is not supported (must be 0), got {cfg.ignore_prefix_size}")
    if cfg.soft_beam_cuda_graphs and str(cfg.soft_beam_relaxation) != "soft_topk":
        problems.append(f"--soft-beam-cuda-graphs needs --soft-beam-relaxation soft_topk (the others read their checks "
                        f"back or draw noise, which a CUDA graph cannot replay), got {cfg.soft_beam_relaxation}")
    return problems


def rho_zero_unused_flags(cfg: SoftBeamSearchConfig) -> List[str]:
    """The flags given that only L_tf reads, when ``--teacher-forcing-ratio 0`` computes no L_tf: label smoothing
    (L_SOFT is the gold tokens' plain NLL) and token accuracy (measured on teacher forcing's predictions)."""
    if cfg.teacher_forcing_ratio != 0:
        return []
    return [flag for flag, given in (("--label-smoothing", cfg.label_smoothing > 0),
                                     ("--report-accuracy", bool(cfg.report_accuracy))) if given]


class TeacherForcedLogProbs(NamedTuple):
    """Teacher forcing's log-probabilities (bsz, T, V), computed by the beam search's teacher-forced rows: what
    the criterion hands fairseq's loss and accuracy code in place of the decoder's output."""

    lprobs: torch.Tensor


@register_criterion("soft_beam_search", dataclass=SoftBeamSearchConfig)
class SoftBeamSearchCriterion(LabelSmoothedCrossEntropyCriterion):
    """``L = rho * L_tf + (1 - rho) * L_SOFT`` (the module docstring). Besides fairseq's ``loss`` and ``nll_loss``
    (the beam search's NLL in a batch without teacher forcing) it logs ``tf_loss`` and ``soft_loss`` (per token,
    base 2, over the batches that computed each), ``tf_nll_loss`` and ``tf_ppl`` (teacher forcing's alone),
    ``soft_topk_iters`` and ``soft_topk_err`` (the OT solver's mean iterations and each batch's largest marginal
    error, averaged over the batches) and ``soft_topk_capped`` (rows per step it left at its iteration cap
    unconverged; warned about once) -- those three for ``soft_topk``, the relaxation that runs the solver --,
    ``pruned_mass``, ``duplicate_beams`` (final beams per sentence that repeat a better-ranked one) and, with
    ``--soft-beam-cuda-graphs``, ``cuda_graph_captures`` (batch sizes captured)."""

    def __init__(self, task, cfg: SoftBeamSearchConfig):
        """Built by fairseq from ``--criterion soft_beam_search`` and its flags; elsewhere pass a
        :class:`SoftBeamSearchConfig`, whose fields hold the defaults (``sentence_avg`` has none there: fairseq
        fills it from ``--sentence-avg``)."""
        if not isinstance(cfg.sentence_avg, bool):  # a bare SoftBeamSearchConfig() holds "${optimization...}"
            raise ValueError(f"soft_beam_search: sentence_avg must be True or False, got {cfg.sentence_avg!r} "
                             "(fairseq sets it from --sentence-avg; pass SoftBeamSearchConfig(sentence_avg=...))")
        super().__init__(task, cfg.sentence_avg, cfg.label_smoothing, cfg.ignore_prefix_size, cfg.report_accuracy)
        upgrade_config(cfg)
        dictionary = task.target_dictionary
        problems = config_problems(cfg) or vocabulary_problems(len(dictionary), cfg.soft_beam_size, dictionary.pad(),
                                                               dictionary.eos(), names=SEARCH_FLAGS)
        if problems:
            raise ValueError("soft_beam_search: " + "; ".join(problems))
        self.rho = cfg.teacher_forcing_ratio
        unused = rho_zero_unused_flags(cfg)
        if unused:
            warnings.warn(f"soft_beam_search: {' and '.join(unused)} apply to teacher forcing's L_tf, which "
                          "--teacher-forcing-ratio 0 leaves out: ignored", UserWarning, stacklevel=2)
        self.sample_mode = str(cfg.teacher_forcing_mode) == "sample"
        self.teacher_forcing_pass = str(cfg.teacher_forcing_pass)
        self.search_options = dict(
            beam=cfg.soft_beam_size, relaxation=str(cfg.soft_beam_relaxation), epsilon=cfg.soft_beam_epsilon,
            scaling=str(cfg.soft_beam_scaling), tol=cfg.soft_topk_tol, max_iter=cfg.soft_topk_max_iter,
            candidates=cfg.soft_beam_candidates, bookkeeping=str(cfg.soft_beam_bookkeeping),
            samples=cfg.soft_beam_samples)
        # One cache for the run: each batch size's graphs are captured once (None: no graphs).
        self.graphs = GraphCache() if cfg.soft_beam_cuda_graphs else None
        self.graphs_unused_warned = False
        self.eos = task.target_dictionary.eos()
        tf_keys = ("tf_loss", "tf_nll_loss", "tf_ntokens") + (("n_correct", "total") if cfg.report_accuracy else ())
        # (the solver's reports only for a relaxation with a solver: 0 iterations would read as a converged one)
        self.solves = relaxations.relaxation_class(self.search_options["relaxation"], USE).solves
        soft_keys = SOFT_LOG_KEYS + (SOLVER_LOG_KEYS if self.solves else ())
        self._log_keys = (tf_keys if self.rho > 0 else ()) + (soft_keys if self.rho < 1 else ())

    def forward(self, model, sample, reduce=True):
        if not reduce:
            raise ValueError("soft_beam_search only computes reduced losses")
        use_tf, use_soft = self._losses_this_batch()
        captured_before = self.graphs.captures if self.graphs is not None else 0
        with layer_drop_drawn_once(model) if use_soft else contextlib.nullcontext():
            net_output, out = self._run_model(model, sample, use_tf, use_soft)
        loss, sample_size, logging_output = self._loss_and_logs(model, sample, net_output, out)
        if self.graphs is not None:
            logging_output["cuda_graph_captures"] = self.graphs.captures - captured_before
            if use_soft and not self.graphs.captures and not self.graphs_unused_warned:
                self.graphs_unused_warned = True
                warnings.warn(GRAPHS_UNUSED_WARNING, RuntimeWarning)
        return loss, sample_size, logging_output

    def _losses_this_batch(self) -> Tuple[bool, bool]:
        """Whether this batch computes L_tf and L_SOFT: both in ``sum`` mode (unless rho is 0 or 1), one drawn in
        ``sample`` mode while training -- validation computes both, as ``sum`` mode does, so that its loss (and a
        checkpoint or a schedule chosen on it) is the objective's, not a draw."""
        use_tf, use_soft = self.rho > 0, self.rho < 1
        if self.sample_mode and use_tf and use_soft and self.training:
            # One draw per batch from torch's RNG, which fairseq seeds per update: reproducible, and the same
            # on every worker. Unbiased: E[L] = rho * L_tf + (1 - rho) * L_SOFT.
            use_tf = bool(torch.rand(()) < self.rho)
            use_soft = not use_tf
        return use_tf, use_soft

    def _run_model(self, model, sample, use_tf: bool, use_soft: bool):
        """The model's passes for this batch: teacher forcing's output (the decoder's, or the search's
        :class:`TeacherForcedLogProbs`; None without L_tf) and the beam search's (None without L_SOFT), at least
        one of them through DDP's ``forward`` (module docstring)."""
        if use_soft:
            refuse_fully_sharded(model)
        net_input = sample["net_input"]

        def search(m, encoder_out=None, teacher_forcing=None):  # (the decoder input checked to start with eos)
            return soft_beam_search(m, net_input["src_tokens"], net_input["src_lengths"], sample["target"],
                                    pad=self.padding_idx, eos=self.eos, encoder_out=encoder_out,
                                    teacher_forcing=teacher_forcing, prev_output_tokens=net_input["prev_output_tokens"],
                                    graphs=self.graphs, **self.search_options)

        if use_tf and use_soft and encoder_then_decoder(model):
            # Both losses from one encoder pass (and one dropout mask on it), inside DDP's forward; L_tf from the
            # search's teacher-forced rows, or from the decoder's own pass.
            in_search = self.teacher_forcing_pass == "search" or (self.teacher_forcing_pass == "auto"
                                                                  and sample["target"].is_cuda)

            def both(m):
                encoder_out = m.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
                if in_search:
                    searched = search(m, encoder_out, teacher_forcing=net_input["prev_output_tokens"])
                    return TeacherForcedLogProbs(searched.teacher_forced_lprobs), searched
                return m.decoder(net_input["prev_output_tokens"], encoder_out=encoder_out), search(m, encoder_out)

            return run_inside_ddp_forward(model, both)
        net_output = model(**net_input) if use_tf else None
        if not use_soft:
            return net_output, None
        # Without a teacher-forcing pass in this batch, DDP's forward has not run: run the search in it.
        return net_output, search(model) if use_tf else run_inside_ddp_forward(model, search)

    def _loss_and_logs(self, model, sample, net_output, out):
        """``rho * L_tf + (1 - rho) * L_SOFT`` from the passes :meth:`_run_model` ran (one of the two terms when
        the other pass did not run), fairseq's sample size and the logging output."""
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {"ntokens": sample["ntokens"], "nsentences": sample["target"].size(0),
                          "sample_size": sample_size}
        loss = tf_loss = nll_loss = None
        if net_output is not None:
            tf_loss, tf_log = self._teacher_forcing_loss(model, sample, net_output)
            nll_loss = tf_log.pop("nll_loss")
            logging_output.update(tf_log)
            logging_output["tf_loss"] = tf_loss.data
            logging_output["tf_nll_loss"] = nll_loss
            logging_output["tf_ntokens"] = sample["ntokens"]
            loss = tf_loss
        if out is not None:
            soft_loss = out.nll.sum()
            loss = soft_loss if loss is None else self.rho * tf_loss + (1 - self.rho) * soft_loss
            if nll_loss is None:
                nll_loss = soft_loss.data  # no teacher-forcing pass: report the beam-search NLL
            steps = out.solver_iterations.numel()  # >= 1
            # The five reports in one read from the device: the search itself reads nothing back per step.
            iters, err_max, pruned, capped, duplicates = torch.stack([
                out.solver_iterations.sum(), out.solver_error.max(), out.pruned_mass.sum(),
                out.solver_capped.sum(), duplicate_hypotheses(out.hypotheses).sum()]).tolist()
            if capped:
                warnings.warn(CAPPED_WARNING, RuntimeWarning)  # one text: Python shows it once
            logging_output.update({
                "soft_loss": soft_loss.data, "soft_ntokens": sample["ntokens"], "soft_topk_steps": steps,
                "soft_batches": 1, "pruned_mass": pruned, "soft_sentence_steps": out.nll.numel() * steps,
                "duplicate_beams": int(duplicates), "soft_nsentences": out.nll.numel(),
            })
            if self.solves:
                logging_output.update(soft_topk_iters=iters, soft_topk_err_max=err_max, soft_topk_capped=int(capped))
        logging_output["loss"] = loss.data
        logging_output["nll_loss"] = nll_loss
        # Every key of every pass this configuration can run, 0 where this batch did not run it: fairseq sums the
        # workers' (and --update-freq's) logs over the keys of the first one, and --teacher-forcing-mode sample runs
        # one pass per batch.
        for key in self._log_keys:  # (the losses as tensors on the loss's device: fairseq all-reduces those apart)
            logging_output.setdefault(key, loss.data.new_zeros(()) if key.endswith("_loss") else 0)
        # In one order whichever passes ran: fairseq's all-reduce matches the workers' values by position.
        return loss, sample_size, {key: logging_output[key] for key in sorted(logging_output)}

    def get_lprobs_and_target(self, model, net_output, sample):
        """fairseq's, and for the search's teacher-forced rows (:class:`TeacherForcedLogProbs`) their
        log-probabilities as they are (``--ignore-prefix-size`` is 0 here)."""
        if isinstance(net_output, TeacherForcedLogProbs):
            return net_output.lprobs.reshape(-1, net_output.lprobs.size(-1)), sample["target"].view(-1)
        return super().get_lprobs_and_target(model, net_output, sample)

    def _teacher_forcing_loss(self, model, sample, net_output):
        """label_smoothed_cross_entropy's loss on ``net_output`` (the decoder's output, or the search's
        :class:`TeacherForcedLogProbs`) and its logs: ``nll_loss``, and ``n_correct`` / ``total`` with
        ``--report-accuracy``."""
        loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=True)
        log = {"nll_loss": nll_loss.data}
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            log.update(n_correct=utils.item(n_correct.data), total=utils.item(total.data))
        return loss, log

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        for key in ("tf", "soft"):
            ntokens = sum(log.get(f"{key}_ntokens", 0) for log in logging_outputs)
            if ntokens:  # per token of the batches that computed it (all of them with --teacher-forcing-mode sum)
                total = sum(log.get(f"{key}_loss", 0) for log in logging_outputs)
                metrics.log_scalar(f"{key}_loss", total / ntokens / math.log(2), ntokens, round=3)
        tf_ntokens = sum(log.get("tf_ntokens", 0) for log in logging_outputs)
        if tf_ntokens:  # teacher forcing's own NLL and perplexity (nll_loss and ppl mix in the search's in sample mode)
            tf_nll = sum(log.get("tf_nll_loss", 0) for log in logging_outputs)
            metrics.log_scalar("tf_nll_loss", tf_nll / tf_ntokens / math.log(2), tf_ntokens, round=3)
            metrics.log_derived("tf_ppl", lambda meters: utils.get_perplexity(meters["tf_nll_loss"].avg))
        steps = sum(log.get("soft_topk_steps", 0) for log in logging_outputs)
        if steps and any("soft_topk_iters" in log for log in logging_outputs):  # (a relaxation with a solver)
            iters = sum(log.get("soft_topk_iters", 0) for log in logging_outputs)
            metrics.log_scalar("soft_topk_iters", iters / steps, steps, round=2)
            # Each batch logs its largest marginal error. Logs are summed across workers and --update-freq (a max
            # cannot be taken), so the meter is the mean of the batches' largest errors -- the same whatever the
            # number of workers -- not the interval's largest.
            batches = sum(log.get("soft_batches", 0) for log in logging_outputs)
            metrics.log_scalar("soft_topk_err", sum(log.get("soft_topk_err_max", 0) for log in logging_outputs)
                               / max(batches, 1), batches, round=8)
            # Rows the solver left at --soft-topk-max-iter above --soft-topk-tol, per step (mostly 0).
            metrics.log_scalar("soft_topk_capped", sum(log.get("soft_topk_capped", 0) for log in logging_outputs)
                               / steps, steps, round=4)
        if steps:  # per sentence and step: the bound on the rank mass (out of k) lost to pruning
            cells = sum(log.get("soft_sentence_steps", 0) for log in logging_outputs)
            metrics.log_scalar("pruned_mass", sum(log.get("pruned_mass", 0) for log in logging_outputs)
                               / max(cells, 1), cells, round=6)
        soft_sentences = sum(log.get("soft_nsentences", 0) for log in logging_outputs)
        if soft_sentences:  # per sentence: final beams repeating a better one (argmax bookkeeping; 0 to k - 1)
            metrics.log_scalar("duplicate_beams", sum(log.get("duplicate_beams", 0) for log in logging_outputs)
                               / soft_sentences, soft_sentences, round=3)
        if any("cuda_graph_captures" in log for log in logging_outputs):
            # Batch sizes --soft-beam-cuda-graphs captured in the interval (a size seen before is replayed).
            metrics.log_scalar_sum("cuda_graph_captures", sum(log.get("cuda_graph_captures", 0)
                                                              for log in logging_outputs))

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True

