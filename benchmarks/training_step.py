"""The training-step workload the benchmarks and the GPU diagnostics share (a library, not a script): the
pipeline's demo-size models on a random Multi30k-sized batch, the criteria they compare -- teacher forcing and
the soft beam search -- and the top-k attention variants, one update (criterion forward + backward + Adam step)
and its timing against a baseline update (on :mod:`harness`).

Defaults: 128 sentences, source 14 / target 16 tokens, an 8k joint vocabulary (a sentencepiece run on
Multi30k), 2 threads, CPU.
"""
import argparse
import os
import statistics
import sys
from typing import Callable, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARCHS = {
    "lstm": dict(arch="lstm", encoder_embed_dim=128, decoder_embed_dim=128, encoder_hidden_size=256,
                 decoder_hidden_size=256, decoder_out_embed_dim=128, encoder_bidirectional=True,
                 share_decoder_input_output_embed=True, dropout=0.1),
    "transformer": dict(arch="transformer", share_all_embeddings=True, encoder_layers=2, decoder_layers=2,
                        encoder_embed_dim=128, decoder_embed_dim=128, encoder_ffn_embed_dim=256,
                        decoder_ffn_embed_dim=256, encoder_attention_heads=4, decoder_attention_heads=4,
                        dropout=0.1),
    # RNNsearch at its default sizes (the converged Multi30k study's model; embeddings 256, GRUs 256 x 2 and 512)
    "rnnsearch": dict(arch="rnnsearch", dropout=0.1),
}

# The top-k attention variants of the demo transformer (model arguments over ARCHS["transformer"]); the first is
# the baseline, plain softmax attention.
ATTENTION_VARIANTS = {
    "transformer (softmax)": dict(arch="transformer"),
    "transformer_topk_attn soft_topk, enc-dec": dict(arch="transformer_topk_attn", topk_attn_mode="soft_topk"),
    "transformer_topk_attn hard_topk, enc-dec": dict(arch="transformer_topk_attn", topk_attn_mode="hard_topk"),
    "transformer_topk_attn soft_topk, all three": dict(arch="transformer_topk_attn", topk_attn_mode="soft_topk",
                                                       topk_attn_layers="encoder-decoder,decoder-self,encoder-self"),
    "transformer_topk_attn perturbed (16 samples), enc-dec": dict(arch="transformer_topk_attn",
                                                                  topk_attn_mode="perturbed", topk_attn_samples=16),
}
TEACHER_FORCING = "teacher forcing"


def build_model_and_sample(cfg, extra_args=None):
    """The demo-size model of ``cfg['arch']`` (``extra_args`` override its arguments) on a ``cfg['vocab']``-word
    dictionary, and a random batch of ``cfg['bsz']`` sentences of ``cfg['src_len']`` / ``cfg['tgt_len']`` tokens on
    ``cfg['device']``, torch at ``cfg['threads']`` threads; returns (model, task, sample, device)."""
    import torch

    torch.set_num_threads(cfg["threads"])
    sys.path.insert(0, REPO_ROOT)
    import softtopk_fairseq.fairseq_plugin  # noqa: F401
    from fairseq.data import Dictionary
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    d = Dictionary()
    for i in range(cfg["vocab"] - d.nspecial):
        d.add_symbol(f"w{i}")

    class Task:
        source_dictionary = target_dictionary = d

    torch.manual_seed(0)
    args = argparse.Namespace(criterion="x", max_source_positions=256, max_target_positions=256,
                              **{**ARCHS[cfg["arch"]], **(extra_args or {})})
    ARCH_CONFIG_REGISTRY[args.arch](args)
    device = torch.device(cfg["device"])
    model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, Task()).to(device).train()
    return model, Task(), random_sample(d, cfg["bsz"], cfg["src_len"], cfg["tgt_len"], device), device


def random_sample(d, bsz, S, T, device):
    """A fairseq batch of ``bsz`` random sentences of ``S`` source and ``T`` target tokens (eos last) over the
    dictionary ``d``."""
    import torch

    src = torch.randint(d.nspecial, len(d), (bsz, S), device=device)
    target = torch.randint(d.nspecial, len(d), (bsz, T), device=device)
    target[:, -1] = d.eos()
    prev = torch.cat([torch.full((bsz, 1), d.eos(), device=device), target[:, :-1]], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), S, device=device),
                          "prev_output_tokens": prev},
            "target": target, "ntokens": bsz * T, "nsentences": bsz}


def teacher_forcing_criterion(task):
    """``label_smoothed_cross_entropy`` at label smoothing 0.1."""
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    return LabelSmoothedCrossEntropyCriterion(task, False, 0.1)


def soft_beam_criterion(task, **config):
    """``soft_beam_search`` at label smoothing 0.1, token-averaged, its other fields ``config``
    (:class:`~softtopk_fairseq.criterions.soft_beam_search.SoftBeamSearchConfig`'s names: ``soft_beam_relaxation``,
    ``soft_beam_scaling``, ``soft_beam_candidates``, ...) or their defaults."""
    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion

    return SoftBeamSearchCriterion(task, SoftBeamSearchConfig(sentence_avg=False, label_smoothing=0.1, **config))


def update_criterion(name, task, relaxation: str = "soft_topk"):
    """The criterion of an update kind the GPU diagnostics compare: ``"teacher forcing"`` is
    label_smoothed_cross_entropy (0.1); any other name the ``sum`` update -- soft_beam_search with ``relaxation``,
    rho 0.8, M 50, paper scaling, teacher forcing in the search --, with ``--soft-beam-cuda-graphs`` when the name
    ends in "graphs"."""
    if name == TEACHER_FORCING:
        return teacher_forcing_criterion(task)
    return soft_beam_criterion(task, teacher_forcing_ratio=0.8, soft_beam_candidates=50, soft_beam_scaling="paper",
                               soft_beam_relaxation=relaxation, teacher_forcing_pass="search",
                               soft_beam_cuda_graphs=name.endswith("graphs"))


def one_update(model, criterion, sample, optimizer, device):
    """Forward + backward + optimizer step, finished on the device; returns the logging output."""
    optimizer.zero_grad()
    loss, _, log = criterion(model, sample)
    loss.backward()
    optimizer.step()
    harness.synchronize(device)
    return log


def adam(model):
    """The updates' optimizer: Adam at lr 1e-4."""
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-4)


class Update:
    """Calling it runs one update of ``model`` with ``criterion`` on ``sample`` with ``optimizer`` (default: its own
    :func:`adam`) and keeps the logging output in ``log``."""

    def __init__(self, model, criterion, sample, device, optimizer=None):
        self.model, self.criterion, self.sample, self.device = model, criterion, sample, device
        self.optimizer = adam(model) if optimizer is None else optimizer
        self.log = {}

    def __call__(self):
        self.log = one_update(self.model, self.criterion, self.sample, self.optimizer, self.device)
        return self.log


def time_updates(model, criterion, sample, device, repeats: int, warmup: int,
                 baseline: Optional[Callable[[], Tuple[object, object]]] = None):
    """Median seconds of ``repeats`` updates (:class:`Update`, after ``warmup`` untimed ones), the last logging
    output, the peak memory in MiB (:func:`harness.peak_mib`) and, given ``baseline`` (a function that builds
    another (model, criterion) for ``sample``), the median seconds of that one's updates, timed alternately with
    these (:func:`harness.compare`; else None). The peak is then read after the warm-up, before the baseline's
    model exists."""
    update = Update(model, criterion, sample, device)
    if baseline is None:
        harness.warm_up({"row": update}, warmup)
        times = harness.rounds({"row": update}, repeats, device)["row"]
        return statistics.median(times), update.log, harness.peak_mib(device), None
    harness.warm_up({"row": update}, max(warmup, 1))  # (at least one: the peak is read now)
    peak = harness.peak_mib(device)
    base = Update(*baseline(), sample, device)
    harness.warm_up({"baseline": base}, warmup)
    timed = harness.compare(("baseline", base), {"row": update}, repeats, warmup=0, device=device)
    return timed.seconds("row"), update.log, peak, timed.seconds("baseline")


BATCH_KEYS = ("bsz", "src_len", "tgt_len", "vocab", "repeats", "warmup", "threads", "device")


def warmup_updates(cfg) -> int:
    """Untimed updates before the timed ones: ``--warmup``, else 1 on CPU and 5 on a GPU (what ran on the device
    and the host just before shows in a short timing)."""
    if cfg.get("warmup") is not None:
        return cfg["warmup"]
    return 5 if cfg["device"].startswith("cuda") else 1


def add_batch_arguments(p, repeats):
    """The batch, vocabulary and timing options shared by the training-step benchmarks and diagnostics."""
    p.add_argument("--bsz", type=int, default=128, help="sentences per batch")
    p.add_argument("--src-len", type=int, default=14)
    p.add_argument("--tgt-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=repeats, help="timed updates (median) after the warm-up")
    p.add_argument("--warmup", type=int, default=None, help="untimed updates first (default: 1 on CPU, 5 on a GPU)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")


def batch_config(a):
    return {key: getattr(a, key) for key in BATCH_KEYS}
