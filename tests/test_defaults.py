"""Every default written once, in softtopk_fairseq/defaults.py: the operators, the Python search and attention
functions, the criterion's and the attention architectures' flags and the demo pipeline read it."""
import inspect
from dataclasses import fields

import torch

from softtopk_fairseq import defaults
from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig
from softtopk_fairseq.models.topk_attention import TopkAttentionConfig
from softtopk_fairseq.modules.soft_beam_search import soft_beam_search
from softtopk_fairseq.modules.topk_attention import topk_attention_weights
from softtopk_fairseq.ops import effective_epsilon, perturbed_topk, soft_topk, softmax_k_times
from softtopk_fairseq.ops.soft_topk import DEFAULT_TOL
from softtopk_fairseq.pipeline.run import Config


def _defaults(fn):
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _field_defaults(config):
    return {f.name: f.default for f in fields(config)}


def test_the_operators_defaults_are_the_modules():
    for fn in (soft_topk, effective_epsilon, softmax_k_times):
        assert _defaults(fn)["epsilon"] == defaults.EPSILON and _defaults(fn)["scaling"] == defaults.OPERATOR_SCALING
    assert _defaults(soft_topk)["method"] == defaults.SOLVER_METHOD
    assert _defaults(perturbed_topk)["sigma"] == defaults.EPSILON
    assert _defaults(perturbed_topk)["samples"] == defaults.PERTURBED_SAMPLES
    assert DEFAULT_TOL == {torch.float32: defaults.TOL_FLOAT32, torch.float64: defaults.TOL_FLOAT64}


def test_the_python_search_searches_as_the_criterion_does():
    """``soft_beam_search`` called without options is the criterion at its flags' defaults (the scaling
    included: the Python function used to default to the temperature in nats)."""
    search, criterion = _defaults(soft_beam_search), _field_defaults(SoftBeamSearchConfig)
    for argument, flag in (("beam", "soft_beam_size"), ("relaxation", "soft_beam_relaxation"),
                           ("epsilon", "soft_beam_epsilon"), ("scaling", "soft_beam_scaling"),
                           ("samples", "soft_beam_samples"), ("candidates", "soft_beam_candidates"),
                           ("bookkeeping", "soft_beam_bookkeeping")):
        assert search[argument] == criterion[flag], argument
    assert (search["beam"], search["relaxation"], search["epsilon"], search["scaling"], search["samples"],
            search["candidates"], search["bookkeeping"]) == (
        defaults.BEAM, defaults.SEARCH_RELAXATION, defaults.EPSILON, defaults.SEARCH_SCALING,
        defaults.PERTURBED_SAMPLES, defaults.CANDIDATES, defaults.BOOKKEEPING)
    assert criterion["teacher_forcing_ratio"] == defaults.TEACHER_FORCING_RATIO


def test_the_attention_flags_and_function_share_the_modules_defaults():
    arch, function = _field_defaults(TopkAttentionConfig), _defaults(topk_attention_weights)
    assert (arch["topk_attn_k"], arch["topk_attn_epsilon"], arch["topk_attn_samples"], arch["topk_attn_mode"],
            arch["topk_attn_inference"]) == (defaults.TOPK_ATTN_K, defaults.EPSILON, defaults.PERTURBED_SAMPLES,
                                             defaults.TOPK_ATTN_MODE, defaults.TOPK_ATTN_INFERENCE)
    assert (function["mode"], function["epsilon"], function["samples"]) == (
        defaults.TOPK_ATTN_MODE, defaults.EPSILON, defaults.PERTURBED_SAMPLES)


def test_the_pipeline_runs_the_criterion_and_the_attention_at_their_defaults():
    pipeline, criterion, arch = _field_defaults(Config), _field_defaults(SoftBeamSearchConfig), \
        _field_defaults(TopkAttentionConfig)
    for name in ("teacher_forcing_ratio", "soft_beam_size", "soft_beam_epsilon", "soft_beam_scaling"):
        assert pipeline[name] == criterion[name], name
    for name in ("topk_attn_k", "topk_attn_epsilon"):
        assert pipeline[name] == arch[name], name


def test_the_cuda_graph_caches_size_is_the_modules():
    from softtopk_fairseq.modules.cuda_graphs import GraphCache

    assert GraphCache().capacity == defaults.CUDA_GRAPH_SIZES_KEPT
    help_text = next(f for f in fields(SoftBeamSearchConfig) if f.name == "soft_beam_cuda_graphs").metadata["help"]
    assert f"the {defaults.CUDA_GRAPH_SIZES_KEPT} most recently used sizes are kept" in help_text
