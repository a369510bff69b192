"""CUDA graphs of a small function (modules/cuda_graphs.py) and of the soft beam search's step: the autograd
plumbing on CPU (GraphCache(emulate=True): the same copies, runs and clones, eagerly), the capture itself on
CUDA (skipped without one)."""
import functools
import warnings
from typing import NamedTuple, Optional

import pytest
import torch
from fairseq import metrics
from fairseq.utils import move_to_cuda

import softtopk_fairseq.modules.soft_beam_search as search_module
from softtopk_fairseq.criterions.soft_beam_search import (GRAPHS_UNUSED_WARNING, SoftBeamSearchConfig,
                                                         SoftBeamSearchCriterion, config_problems)
from softtopk_fairseq.modules import relaxations
from softtopk_fairseq.modules.cuda_graphs import GraphCache
from softtopk_fairseq.modules.soft_beam_search import soft_beam_search
from softtopk_fairseq.ops import use_backend
from host_reads import HostReads
from tiny_models import ARCHS, TinyTask, batch, build, dictionary

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Out(NamedTuple):
    y: torch.Tensor
    index: torch.Tensor
    nothing: Optional[torch.Tensor]
    pair: tuple


def small(x, w, idx, p):
    """A function with every kind of input and output GraphCache handles."""
    y = torch.tanh(x @ w) * p.sum()
    return Out(y, y.argmax(-1), None, (y.detach().sum(-1), (x * x).sum(-1)))


def _inputs(requires_grad=True, n=4):
    torch.manual_seed(0)
    x = torch.randn(n, 3, dtype=torch.float64, requires_grad=requires_grad)
    w = torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64))
    return x, w, torch.arange(n), torch.randn(2, dtype=torch.float64, requires_grad=True)


def test_graph_cache_gives_the_functions_values_and_gradients():
    cache = GraphCache(emulate=True)
    x, w, idx, p = _inputs()
    expected = small(x, w, idx, p)
    loss = lambda out: (out.y ** 2).sum() + out.pair[1].sum()  # noqa: E731
    ex, ew, ep = torch.autograd.grad(loss(expected), [x, w, p])
    for _ in range(2):  # the second call reuses the pair
        got = cache("small", small, x, w, idx, p)
        assert got.nothing is None and torch.equal(got.index, expected.index)
        assert torch.allclose(got.y, expected.y) and torch.allclose(got.pair[0], expected.pair[0])
        assert not got.pair[0].requires_grad and got.y.requires_grad and not got.index.requires_grad
        gx, gw, gp = torch.autograd.grad(loss(got), [x, w, p])
        assert torch.allclose(gx, ex) and torch.allclose(gw, ew) and torch.allclose(gp, ep)
    assert cache.captures == 1
    # Gradients were computed from the inputs of each call, not from the last call's (a recomputation).
    x2 = (x.detach() * 2).requires_grad_()
    first = cache("small", small, x, w, idx, p)
    second = cache("small", small, x2, w, idx, p)
    g1 = torch.autograd.grad(first.y.sum(), x)[0]
    g2 = torch.autograd.grad(second.y.sum(), x2)[0]
    assert torch.allclose(g1, torch.autograd.grad(small(x, w, idx, p).y.sum(), x)[0])
    assert torch.allclose(g2, torch.autograd.grad(small(x2, w, idx, p).y.sum(), x2)[0])


def test_graph_cache_keys_shapes_and_keeps_at_most_capacity():
    cache = GraphCache(capacity=2, emulate=True)
    w = _inputs()[1]
    for n in (4, 5, 4, 6, 4, 5):
        x, _, idx, p = _inputs(n=n)
        cache("small", small, x, w, idx, p)
    # 4 and 5 captured, 4 reused, 6 pushes out 5 (least recently used), 4 reused, 5 captured again.
    assert cache.captures == 4 and len(cache.pairs) == 2
    cache("small", small, x, _inputs()[1], idx, p)  # another parameter (its address is part of the key)
    assert cache.captures == 5
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        GraphCache(capacity=0)


def test_graph_cache_without_gradients_and_for_inputs_not_requiring_them():
    cache = GraphCache(emulate=True)
    x, w, idx, p = _inputs(requires_grad=False)
    with torch.no_grad():
        out = cache("small", small, x, w, idx, p)
    assert torch.allclose(out.y, small(x, w, idx, p).y) and not out.y.requires_grad
    out = cache("small", small, x, w, idx, p)
    gw, = torch.autograd.grad(out.y.sum(), [w])  # x does not require grad: none computed for it, w's is right
    assert torch.allclose(gw, torch.autograd.grad(small(x, w, idx, p).y.sum(), [w])[0])


# ------------------------------------------------------------------------------------ the search's step ----

def _search(model, sample, d, graphs, **kw):
    ni = sample["net_input"]
    model.zero_grad()
    out = soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=d.pad(), eos=d.eos(),
                           beam=3, scaling="paper", teacher_forcing=ni["prev_output_tokens"], graphs=graphs, **kw)
    (out.nll.sum() + 0.1 * out.teacher_forced_lprobs.logsumexp(-1).sum()).backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("candidates", [0, 7])
def test_search_through_step_graphs_is_the_eager_search(arch, candidates):
    d = dictionary()
    model, sample = build(arch, d, dtype=torch.float32), batch(d)
    expected, expected_grads = _search(model, sample, d, None, candidates=candidates)
    cache = GraphCache(emulate=True)
    for _ in range(2):
        got, grads = _search(model, sample, d, cache, candidates=candidates)
        for name in ("nll", "hypotheses", "hypothesis_scores", "solver_iterations", "solver_error", "solver_capped",
                     "pruned_mass", "teacher_forced_lprobs"):
            assert torch.allclose(getattr(got, name), getattr(expected, name), atol=1e-6), name
        for g, e in zip(grads, expected_grads):
            assert torch.allclose(g, e, atol=1e-5)
    assert cache.captures == 1  # every step of every call: one batch size, one configuration


@pytest.mark.parametrize("relaxation", ["softmax_k_times", "perturbed"])
def test_step_graphs_are_not_used_for_relaxations_that_read_back_or_draw_noise(relaxation):
    d = dictionary()
    model, sample = build("lstm", d, dtype=torch.float32), batch(d)
    cache = GraphCache(emulate=True)
    _search(model, sample, d, cache, relaxation=relaxation)
    assert cache.captures == 0
    assert not relaxations.make(relaxation, "search", 3, 0.1, scaling="paper").capturable()
    assert relaxations.make("soft_topk", "search", 3, 0.1, scaling="paper").capturable()


@pytest.mark.parametrize("candidates", [0, 7])
def test_the_step_a_graph_captures_reads_nothing_back_on_the_triton_backend(candidates, monkeypatch):
    """What runs inside the graphs on CUDA -- the Triton kernels under the interpreter here -- reads nothing back
    and makes no tensor from host data, forward and backward."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the CUDA capture test below covers it")
    d = dictionary()
    model, sample = build("lstm", d, dtype=torch.float32), batch(d)
    seen = []
    original = search_module._search_step

    def watched(*args):
        with HostReads() as mode:
            step = original(*args)
            loss = step.cum.sum() + step.mixing.sum() + step.soft.sum()
            grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad] + [args[2]],
                                        allow_unused=True, retain_graph=True)
        seen.append((mode.count, mode.from_host))
        assert any(g is not None for g in grads)
        return step

    monkeypatch.setattr(search_module, "_search_step", watched)
    with use_backend("triton"):
        _search(model, sample, d, None, candidates=candidates)
    assert seen and all(found == (0, 0) for found in seen)


def test_criterion_flag_passes_its_cache_and_refuses_other_relaxations():
    d = dictionary()
    model, sample = build("lstm", d, dtype=torch.float32), batch(d)
    plain = SoftBeamSearchCriterion(TinyTask(d), SoftBeamSearchConfig(sentence_avg=False, teacher_forcing_ratio=0.5,
                                                                      soft_beam_size=3))
    graphed = SoftBeamSearchCriterion(TinyTask(d), SoftBeamSearchConfig(
        sentence_avg=False, teacher_forcing_ratio=0.5, soft_beam_size=3, soft_beam_cuda_graphs=True))
    assert plain.graphs is None and isinstance(graphed.graphs, GraphCache)
    graphed.graphs = GraphCache(emulate=True)  # CPU: the plumbing eagerly
    results, logs = [], []
    for criterion in (plain, graphed, graphed):
        model.zero_grad()
        loss, _, log = criterion(model, sample)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        logs.append(log)
    assert graphed.graphs.captures == 1
    # Logged: the batch sizes captured (1, then 0: replayed); fairseq sums them over its log interval.
    assert "cuda_graph_captures" not in logs[0] and [log["cuda_graph_captures"] for log in logs[1:]] == [1, 0]
    with metrics.aggregate() as agg:
        SoftBeamSearchCriterion.reduce_metrics(logs)
    assert agg.get_smoothed_values()["cuda_graph_captures"] == 1
    assert torch.allclose(results[0][0], results[1][0])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(results[0][1], results[1][1]))
    if not torch.cuda.is_available():  # the flag on CPU batches: warned once, run eagerly
        unused = SoftBeamSearchCriterion(TinyTask(d), SoftBeamSearchConfig(
            sentence_avg=False, teacher_forcing_ratio=0.5, soft_beam_size=3, soft_beam_cuda_graphs=True))
        with pytest.warns(RuntimeWarning, match="captured nothing"):
            unused(model, sample)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            unused(model, sample)
        assert GRAPHS_UNUSED_WARNING.startswith("soft_beam_search: --soft-beam-cuda-graphs")
    problems = config_problems(SoftBeamSearchConfig(sentence_avg=False, soft_beam_cuda_graphs=True,
                                                    soft_beam_relaxation="perturbed"))
    assert problems == ["--soft-beam-cuda-graphs needs --soft-beam-relaxation soft_topk (the others read their checks "
                        "back or draw noise, which a CUDA graph cannot replay), got perturbed"]


def test_capturable_lookup_is_the_embedding_lookup():
    d = dictionary()
    embed = build("lstm", d, dtype=torch.float32).decoder.embed_tokens
    index = torch.tensor([[4, 5, 4], [1, 7, 9]])
    lookup = functools.partial(search_module.capturable_lookup(embed), weight=embed.weight)
    assert torch.equal(lookup(index), embed(index))
    g = torch.randn(2, 3, embed.embedding_dim)
    assert torch.allclose(torch.autograd.grad((lookup(index) * g).sum(), embed.weight)[0],
                          torch.autograd.grad((embed(index) * g).sum(), embed.weight)[0])
    assert search_module.capturable_lookup(torch.nn.Embedding(5, 3, max_norm=1.0)) is None
    assert search_module.capturable_lookup(torch.nn.Sequential(torch.nn.Embedding(5, 3))) is None
    torch.use_deterministic_algorithms(True)
    try:
        assert search_module.capturable_lookup(embed) is None
    finally:
        torch.use_deterministic_algorithms(False)


@CUDA
@pytest.mark.parametrize("arch,bsz,candidates,dropout", [
    ("lstm", 3, 7, 0.0), ("transformer", 3, 7, 0.0),
    # 100 x 50 lookups per step: nn.Embedding's CUDA backward would sort them and read back (capturable_lookup);
    # dropout in the decoder between the graphs' replays (the random generator's state across captures)
    ("lstm", 100, 50, 0.1)])
def test_step_graphs_on_cuda_give_the_eager_search(arch, bsz, candidates, dropout):
    d = dictionary()
    model = build(arch, d, dtype=torch.float32, dropout=dropout).cuda().train()
    sample = move_to_cuda(batch(d, bsz=bsz, tgt_lens=(4, 3, 5) * (bsz // 3) + (5,) * (bsz % 3)))
    torch.manual_seed(0)
    expected, expected_grads = _search(model, sample, d, None, candidates=candidates)
    cache = GraphCache()
    for _ in range(3):
        torch.manual_seed(0)  # the same dropout masks: the graphs draw no random numbers
        got, grads = _search(model, sample, d, cache, candidates=candidates)
        assert torch.equal(got.hypotheses, expected.hypotheses)
        assert torch.allclose(got.nll, expected.nll, atol=1e-5)
        assert torch.allclose(got.teacher_forced_lprobs, expected.teacher_forced_lprobs, atol=1e-5)
        for g, e in zip(grads, expected_grads):
            assert torch.allclose(g, e, atol=1e-4, rtol=1e-4)
    assert cache.captures == 1 and all(pair.graphed for pair in cache.pairs.values())
