"""The differentiable beam search and the soft_beam_search criterion, in Python on tiny models."""
import math
import re
import warnings

import pytest
import torch

from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.modules import LayerDropModuleList
from fairseq.sequence_generator import SequenceGenerator
from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion
from softtopk_fairseq.modules.relaxations import OptimalTransport, Perturbed, SoftmaxKTimes
from softtopk_fairseq.modules.soft_beam_search import duplicate_hypotheses, soft_beam_search
from softtopk_fairseq.modules.soft_reorder import SoftOrder, SoftTokenInput, mix_beams
from softtopk_fairseq.ops import soft_topk
from tiny_models import ARCHS, TinyTask, batch, build, dictionary


def run(model, sample, d, **kw):
    """soft_beam_search on a sample; these tests give their temperatures in nats unless they say otherwise."""
    kw.setdefault("scaling", "none")
    ni = sample["net_input"]
    return soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=d.pad(),
                            eos=d.eos(), **kw)


# ---------------------------------------------------------------- the soft reorder and the soft input ----

def test_soft_order_mixes_float_state_and_hard_selects_the_rest():
    bsz, k = 2, 3
    mixing = torch.softmax(torch.randn(bsz, k, k), -1)
    parents = mixing.argmax(-1)
    order = ((torch.arange(bsz) * k).unsqueeze(1) + parents).view(-1)
    soft = SoftOrder(order, mixing)
    state = torch.randn(4, bsz * k, 5)           # batch in dim 1, like an LSTM's stacked hidden state
    got = state.index_select(1, soft)
    want = torch.einsum("blj,tbjh->tblh", mixing, state.view(4, bsz, k, 5)).reshape(4, bsz * k, 5)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.index_select(state, 1, soft), want)
    mask = torch.rand(bsz * k, 7) > 0.5           # bool state: hard order
    assert torch.equal(mask.index_select(0, soft), mask.index_select(0, order))
    assert soft.size(0) == bsz * k and type(soft.view(-1, k)) is torch.Tensor
    # A one-hot mixing matrix is exactly the hard reorder.
    onehot = torch.nn.functional.one_hot(parents, k).double()
    x = torch.randn(bsz * k, 4, dtype=torch.float64)
    assert torch.equal(x.index_select(0, SoftOrder(order, onehot)), x.index_select(0, order))
    assert torch.equal(mix_beams(x, 0, onehot), x[order])


def test_soft_token_input_replaces_only_the_pending_lookup():
    emb = torch.nn.Embedding(10, 4)
    tokens = torch.tensor([[1], [2]])
    with SoftTokenInput(emb) as hook:
        assert torch.equal(emb(tokens), emb.weight[tokens])
        soft = torch.randn(2, 1, 4)
        hook.pending = soft
        assert torch.equal(emb(tokens), soft)
        assert torch.equal(emb(tokens), emb.weight[tokens])  # consumed
        hook.pending = torch.randn(3, 1, 4)
        with pytest.raises(RuntimeError, match="does not match"):
            emb(tokens)
    hook.pending = soft
    assert torch.equal(emb(tokens), emb.weight[tokens])  # hook removed on exit


def test_soft_token_input_feeds_the_first_rows_of_each_group():
    """Pending (groups, s, dim) for g > s rows per group: the first s rows of each group get the soft inputs, the
    others their own tokens' embeddings (the soft beam search's beams, then a teacher-forced row)."""
    emb = torch.nn.Embedding(10, 4)
    tokens = torch.tensor([[1], [2], [3], [4], [5], [6]])  # 2 groups of 3 rows
    soft = torch.randn(2, 2, 4)
    with SoftTokenInput(emb) as hook:
        hook.pending = soft
        out = emb(tokens).view(2, 3, 4)
        assert torch.equal(out[:, :2], soft)
        assert torch.equal(out[:, 2], emb.weight[[3, 6]])
        for bad in (torch.randn(4, 1, 4), torch.randn(2, 4, 4), torch.randn(2, 2, 5)):  # 6 rows in 4 groups; 4 > 3
            hook.pending = bad
            with pytest.raises(RuntimeError, match="does not match"):
                emb(tokens)


# ------------------------------------------------------------- epsilon -> 0 is fairseq's beam search ----

@pytest.mark.parametrize("bookkeeping", ["argmax", "topk"])
@pytest.mark.parametrize("arch", ARCHS)
def test_small_epsilon_gives_sequence_generator_hypotheses(arch, bookkeeping):
    d = dictionary(20)
    model = build(arch, d).eval()
    sample = batch(d, bsz=3, tgt_lens=(4, 3, 6))
    k = 4
    with torch.no_grad():
        out = run(model, sample, d, beam=k, epsilon=1e-4, bookkeeping=bookkeeping)
    _assert_sequence_generator_hypotheses(model, sample, d, k, out, arch)
    assert float(out.solver_error.max()) < 1e-6


def _assert_sequence_generator_hypotheses(model, sample, d, k, out, arch):
    lengths = sample["target"].ne(d.pad()).sum(1)
    for b in range(len(lengths)):
        src = sample["net_input"]["src_tokens"][b]
        src = src[src.ne(d.pad())].unsqueeze(0)
        n = int(lengths[b])
        gen = SequenceGenerator([model], d, beam_size=k, max_len_a=0, max_len_b=n - 1, min_len=n - 1)
        hypos = gen.generate([model], {"net_input": {"src_tokens": src,
                                                     "src_lengths": torch.tensor([src.size(1)])}})[0]
        want = [h["tokens"].tolist() for h in hypos]
        got = [row[:n] for row in out.hypotheses[b].tolist()]
        assert got == want, (arch, b)
        want_scores = torch.tensor([float(h["score"]) * n for h in hypos], dtype=torch.float64)
        torch.testing.assert_close(out.hypothesis_scores[b].double(), want_scores, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_sentence_is_searched_as_if_alone(arch):
    """Sentences of different lengths in one batch -- one of them eos alone -- get what each gets searched alone
    (decoded for its own length): the batch runs on past a sentence's eos, masked, and its backtracking starts
    there."""
    d = dictionary(20)
    model = build(arch, d).eval()
    sample = batch(d, bsz=3, tgt_lens=(4, 1, 6))
    ni = sample["net_input"]
    with torch.no_grad():
        together = run(model, sample, d, beam=3, epsilon=0.5, candidates=8)
        for b, n in enumerate((4, 1, 6)):
            src = ni["src_tokens"][b][ni["src_tokens"][b].ne(d.pad())].unsqueeze(0)  # its own length, unpadded
            alone = soft_beam_search(model, src, torch.tensor([src.shape[1]]), sample["target"][b:b + 1, :n],
                                     pad=d.pad(), eos=d.eos(), beam=3, epsilon=0.5, scaling="none", candidates=8)
            assert torch.equal(together.hypotheses[b, :, :n], alone.hypotheses[0])
            assert bool((together.hypotheses[b, :, n:] == d.pad()).all())
            torch.testing.assert_close(together.nll[b], alone.nll[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(together.hypothesis_scores[b], alone.hypothesis_scores[0], rtol=0, atol=1e-10)
    assert bool((together.hypotheses[1, :, 0] == d.eos()).all())  # eos alone: nothing to choose


@pytest.mark.parametrize("arch", ARCHS)
def test_small_sigma_perturbed_search_gives_sequence_generator_hypotheses(arch):
    """sigma -> 0: the perturbed top-k is the hard top-k (noise far below the score gaps), so the search is
    fairseq's beam search, as for epsilon -> 0."""
    d = dictionary(20)
    model = build(arch, d).eval()
    sample = batch(d, bsz=3, tgt_lens=(4, 3, 6))
    k = 4
    torch.manual_seed(0)
    with torch.no_grad():
        out = run(model, sample, d, beam=k, relaxation="perturbed", epsilon=1e-7, samples=4)
    _assert_sequence_generator_hypotheses(model, sample, d, k, out, arch)
    assert float(out.solver_iterations.abs().sum()) == 0  # no solver


def test_topk_bookkeeping_keeps_distinct_beams_where_argmax_can_collapse():
    """A very smooth soft top-k (the paper's scaling at a large epsilon): every rank column has the same
    argmax, so 'argmax' bookkeeping continues one candidate k times; 'topk' keeps k distinct hypotheses."""
    d = dictionary(20)
    model = build("lstm", d).eval()
    sample = batch(d)
    with torch.no_grad():
        smooth = dict(beam=3, epsilon=5.0, scaling="paper")
        collapsed = run(model, sample, d, **smooth)
        distinct = run(model, sample, d, bookkeeping="topk", **smooth)
    assert any(len({tuple(h) for h in sent.tolist()}) < 3 for sent in collapsed.hypotheses)
    assert all(len({tuple(h) for h in sent.tolist()}) == 3 for sent in distinct.hypotheses)
    with pytest.raises(ValueError, match="bookkeeping"):
        run(model, sample, d, bookkeeping="nope")
    with pytest.raises(ValueError, match="soft_beam_search: beam must be an int >= 1, got 0"):
        run(model, sample, d, beam=0)
    with pytest.raises(ValueError, match=r"soft_beam_search: candidates must be 0 \(all\) or >= beam \(3\), got 2"):
        run(model, sample, d, beam=3, candidates=2)
    with pytest.raises(ValueError, match=r"soft_beam_search: candidates must be 0 \(all\) or >= beam \(3\), got -1"):
        run(model, sample, d, beam=3, candidates=-1)  # not "all": 0 is
    with pytest.raises(ValueError, match=r"soft_beam_search: bookkeeping must be one of .*; beam must be an int >= 1, got 0; "
                                         r"candidates must be 0 \(all\) or >= beam \(0\), got -2"):
        run(model, sample, d, beam=0, candidates=-2, bookkeeping="nope")  # every problem at once


@pytest.mark.parametrize("relaxation", ["soft_topk", "softmax_k_times", "perturbed"])
@pytest.mark.parametrize("bad, match", [
    (dict(epsilon=-0.5), "epsilon must be a finite number > 0, got -0.5"),
    (dict(epsilon=1e-320), "epsilon=1e-320 is outside float64's range"),  # (float32's: by the operator, below)
    (dict(scaling="bogus"), r"scaling must be one of \('none', 'paper'\), got 'bogus'"),
    (dict(tol=-1.0), "tol must be a finite number >= 0"),
    (dict(max_iter=2.5), "max_iter must be an int >= 0, got 2.5"),
    (dict(samples=0), "samples must be an int >= 1, got 0"),
])
def test_every_relaxations_options_are_checked_before_the_search_runs(relaxation, bad, match):
    """One rule for every relaxation's options (relaxations.option_problems), applied before the encoder runs:
    softmax-k-times and the perturbed top-k once took a negative temperature -- the worst candidates ranked
    first, silently -- and took any scaling as 'none'."""
    d = dictionary()
    model, sample = build("lstm", d), batch(d)
    model.encoder.forward = None  # (the search must not reach it)
    with pytest.raises(ValueError, match=f"soft_beam_search: {match}"):
        run(model, sample, d, beam=2, relaxation=relaxation, **{"epsilon": 0.5, **bad})


@pytest.mark.parametrize("relaxation", ["soft_topk", "softmax_k_times", "perturbed"])
def test_a_temperature_below_the_models_float_range_is_refused_by_the_operator_not_turned_to_nan(relaxation):
    """The options' rule cannot know the scores' type; the operators hold the temperature to it: a float32 model's
    search with epsilon 1e-46 (0 in float32) is refused, a float64 model's runs with finite results."""
    d = dictionary()
    sample = batch(d)
    with pytest.raises(ValueError, match="epsilon=1e-46 is outside float32's range"):
        run(build("lstm", d, dtype=torch.float32), sample, d, beam=2, relaxation=relaxation, epsilon=1e-46)
    out = run(build("lstm", d), sample, d, beam=2, relaxation=relaxation, epsilon=1e-46)
    assert bool(torch.isfinite(out.nll).all())


def test_a_pruning_size_that_is_not_an_int_and_a_vocabulary_without_tokens_are_named_as_such():
    from softtopk_fairseq.modules.soft_beam_search import search_option_problems, vocabulary_problems

    assert search_option_problems(5, 5.0) == ["candidates must be an int, 0 (all) or >= beam, got 5.0"]
    assert vocabulary_problems(3, 1, pad=1, eos=2) == []
    assert vocabulary_problems(2, 1, pad=0, eos=1) == [
        "the vocabulary of 2 tokens has none to extend a beam with besides pad and eos"]


def test_a_beam_the_vocabulary_cannot_fill_and_foreign_special_tokens_are_refused():
    """The first step extends the one live beam with every token but pad and eos: a beam larger than that would
    repeat hypotheses (it once returned identical ones, silently); pad and eos must be tokens of the decoder."""
    d = dictionary(2)  # fairseq's 4 special symbols and 2 words: 4 tokens to extend with
    model, sample = build("lstm", d), batch(d)
    assert len(d) == 6 and run(model, sample, d, beam=4).hypotheses.shape[1] == 4
    with pytest.raises(ValueError, match=r"soft_beam_search: beam must be <= 4, the tokens a first step can extend "
                                         r"with \(the vocabulary of 6 less pad and eos\), got 5"):
        run(model, sample, d, beam=5)
    ni = sample["net_input"]
    with pytest.raises(ValueError, match=r"soft_beam_search: pad=1 and eos=99 must be two tokens of the vocabulary "
                                         r"\(0..5\)"):
        soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=d.pad(), eos=99, beam=2)
    with pytest.raises(ValueError, match=r"soft_beam_search: --soft-beam-size must be <= 4, the tokens a first step "
                                         r"can extend with \(the vocabulary of 6 less pad and eos\), got 5"):
        SoftBeamSearchCriterion(TinyTask(d), SoftBeamSearchConfig(sentence_avg=False, soft_beam_size=5))


def test_a_target_that_is_not_token_rows_is_refused_naming_what_it_is_before_the_encoder_runs():
    """A float or 3-d target failed deep inside (gather's dtype, an unpacking); an all-pad row was "empty target"
    without saying which."""
    d = dictionary()
    model, sample = build("lstm", d), batch(d)
    model.encoder.forward = None  # (the search must not reach it)
    ni, target = sample["net_input"], sample["target"]

    def search(target):
        return soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], target, pad=d.pad(), eos=d.eos(), beam=2)

    with pytest.raises(TypeError, match="soft_beam_search: target must hold integer token ids, got torch.float32"):
        search(target.float())
    with pytest.raises(ValueError, match=r"soft_beam_search: target must be a \(bsz, T\) tensor of gold token ids, "
                                         rf"got \({target.shape[0]}, {target.shape[1]}, 1\)"):
        search(target.unsqueeze(-1))
    emptied = target.clone()
    emptied[[0, 2]] = d.pad()
    with pytest.raises(ValueError, match=rf"soft_beam_search: target rows \[0, 2\] are empty \(all pad={d.pad()}\)"):
        search(emptied)


def test_a_target_the_search_would_misread_is_refused_naming_the_rows_and_the_fix():
    """Left-padded, without its eos, or with a teacher-forcing input that does not start from eos (where the
    beams start): the loss was finite and wrong."""
    d = dictionary()
    model, sample = build("lstm", d), batch(d)
    ni, target = sample["net_input"], sample["target"]
    lengths = target.ne(d.pad()).sum(1)
    assert int(lengths.min()) < target.shape[1], "the batch needs a padded row"

    def search(target, teacher_forcing=None):
        return soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], target, pad=d.pad(), eos=d.eos(), beam=2,
                                teacher_forcing=teacher_forcing)

    left_padded = torch.stack([row.roll(int(target.shape[1] - n)) for row, n in zip(target, lengths)])
    padded_rows = (lengths < target.shape[1]).nonzero().flatten().tolist()
    with pytest.raises(ValueError, match=rf"target rows {re.escape(str(padded_rows[:8]))} are not right-padded "
                                         rf"\(pad={d.pad()} before a token\); fairseq's --left-pad-target must be "
                                         "False$"):  # (only that: its rows do end in eos)
        search(left_padded)
    no_eos = target.clone()
    no_eos[1, int(lengths[1]) - 1] = d.eos() + 1
    with pytest.raises(ValueError, match=rf"^soft_beam_search: target rows \[1\] do not end in eos={d.eos()}"):
        search(no_eos)
    teacher_forcing = ni["prev_output_tokens"].clone()
    search(target, teacher_forcing)  # (fairseq's own: accepted)
    teacher_forcing[2, 0] = d.eos() + 1
    with pytest.raises(ValueError, match=rf"teacher_forcing rows \[2\] do not start with eos={d.eos()}"):
        search(target, teacher_forcing)


@pytest.mark.parametrize("rho, mode, tf_pass", [(0.5, "sum", "separate"), (0.0, "sum", "auto"),
                                                (0.5, "sum", "search"), (0.3, "sample", "auto")])
def test_the_criterion_refuses_a_decoder_started_from_another_token_in_every_pass(rho, mode, tf_pass):
    """The beams start from eos: with a task whose decoder starts from bos, the search's own teacher-forced rows
    were refused, but the separate pass (auto's choice on CPU) and rho 0 returned a finite L_SOFT of a search
    started elsewhere than the model was trained to."""
    d = dictionary(12)
    model = build("lstm", d, dtype=torch.float32)
    sample = batch(d)
    sample["net_input"]["prev_output_tokens"][1, 0] = d.bos()
    criterion = _criterion(TinyTask(d), rho, teacher_forcing_mode=mode, teacher_forcing_pass=tf_pass)
    torch.manual_seed(0)  # (sample mode: seed 0 draws L_SOFT at rho 0.3)
    with pytest.raises(ValueError, match=rf"(prev_output_tokens|teacher_forcing) rows \[1\] .*eos={d.eos()}"):
        criterion(model, sample)


def test_the_criterion_logs_its_keys_in_one_order_whichever_pass_a_batch_draws():
    """fairseq's all-reduce of the workers' logs concatenates their values in the order of each worker's keys: in
    sample mode that order followed the drawn pass, so workers that drew differently would sum one key's value
    into another's."""
    d = dictionary(12)
    model = build("lstm", d, dtype=torch.float32)
    criterion = _criterion(TinyTask(d), 0.5, teacher_forcing_mode="sample", report_accuracy=True)
    orders = set()
    for seed in range(8):
        torch.manual_seed(seed)
        log = criterion(model, batch(d))[2]
        orders.add(tuple(log))
    assert len(orders) == 1


@pytest.mark.parametrize("relaxation", ["soft_topk", "softmax_k_times", "perturbed"])
def test_the_solvers_reports_are_logged_for_the_relaxation_that_runs_one(relaxation):
    """softmax_k_times and the perturbed top-k run no solver: their soft_topk_iters 0 (and error 0) read as a
    solver that converged at once. They log the search's own metrics only."""
    from fairseq.logging import metrics as fairseq_metrics

    d = dictionary(12)
    model = build("lstm", d, dtype=torch.float32)
    log = _criterion(TinyTask(d), 0.5, soft_beam_relaxation=relaxation)(model, batch(d))[2]
    with fairseq_metrics.aggregate() as agg:
        SoftBeamSearchCriterion.reduce_metrics([log])
    shown = set(agg.get_smoothed_values())
    solver = {"soft_topk_iters", "soft_topk_err", "soft_topk_capped"}
    assert (solver <= shown) == (relaxation == "soft_topk") and not (solver & shown and relaxation != "soft_topk")
    assert {"soft_loss", "pruned_mass"} <= shown
    assert ("soft_topk_iters" in log) == (relaxation == "soft_topk")


def test_duplicate_hypotheses_counts_the_beams_that_repeat_a_better_one():
    eos, pad = 2, 1
    hyps = torch.tensor([[[5, 6, eos], [5, 7, eos], [5, 6, eos]],      # the third repeats the first
                         [[5, 6, eos], [5, 6, eos], [5, 6, eos]],      # one hypothesis three times
                         [[5, eos, pad], [5, 6, eos], [6, 5, eos]]])  # three distinct
    assert duplicate_hypotheses(hyps).tolist() == [1, 2, 0]


def test_duplicate_beams_are_logged_per_sentence():
    """argmax bookkeeping at a high temperature lets every rank follow the same candidate: the beam holds one
    hypothesis k times, which the logs show as k - 1 duplicates per sentence; topk bookkeeping never repeats one."""
    from fairseq.logging import metrics as fairseq_metrics

    d = dictionary(12)
    model = build("lstm", d, dtype=torch.float32)
    sample = batch(d)
    shown = {}
    for bookkeeping in ("argmax", "topk"):
        log = _criterion(TinyTask(d), 0.5, soft_beam_scaling="none", soft_beam_epsilon=2.0,
                         soft_beam_bookkeeping=bookkeeping)(model, sample)[2]
        assert log["soft_nsentences"] == 3
        with fairseq_metrics.aggregate() as agg:
            SoftBeamSearchCriterion.reduce_metrics([log, log])
        shown[bookkeeping] = agg.get_smoothed_values()["duplicate_beams"]
    assert shown == {"argmax": 2.0, "topk": 0.0}  # beam 3: 2 of 3 final beams repeat the best


def test_teacher_forcings_own_nll_is_logged_apart_from_the_mixed_one_in_sample_mode():
    """In sample mode nll_loss / ppl mix teacher forcing's NLL with the search's (a batch that draws L_SOFT reports
    the search's), and tf_loss is label-smoothed: tf_nll_loss and tf_ppl are teacher forcing's NLL alone."""
    from fairseq.logging import metrics as fairseq_metrics

    d = dictionary(12)
    model = build("lstm", d, dtype=torch.float32)
    sample = batch(d)
    criterion = _criterion(TinyTask(d), 0.5, teacher_forcing_mode="sample")
    logs = {}
    for seed in range(8):
        torch.manual_seed(seed)
        log = criterion(model, sample)[2]
        logs["tf" if log["tf_ntokens"] else "soft"] = log
    with fairseq_metrics.aggregate() as agg:
        SoftBeamSearchCriterion.reduce_metrics([logs["tf"], logs["soft"]])
    shown = agg.get_smoothed_values()
    tf_nll = float(logs["tf"]["nll_loss"]) / sample["ntokens"] / math.log(2)
    assert shown["tf_nll_loss"] == pytest.approx(tf_nll, abs=1e-3) and shown["nll_loss"] != pytest.approx(tf_nll)
    assert shown["tf_ppl"] == pytest.approx(2 ** tf_nll, rel=1e-2)


def test_the_criterion_refuses_the_solver_flags_by_the_operators_rule():
    with pytest.raises(ValueError, match=r"soft_beam_search: --soft-topk-tol must be a finite number >= 0 \(0: "
                                         r"up to --soft-topk-max-iter steps, Newton stopping earlier at its rounding "
                                         r"floor\), got -1.0; --soft-topk-max-iter must be an int >= 0, got -3"):
        SoftBeamSearchCriterion(TinyTask(dictionary()), SoftBeamSearchConfig(sentence_avg=False, soft_topk_tol=-1.0,
                                                                            soft_topk_max_iter=-3))


# -------------------------------------------------------------------------------- gradients -----------

@pytest.mark.parametrize("arch", ARCHS)
def test_soft_path_gradients_reach_encoder_decoder_and_embeddings(arch):
    d = dictionary(12)
    model = build(arch, d)
    sample = batch(d)
    run(model, sample, d, beam=3, epsilon=0.5).nll.sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for part in ("encoder.", "decoder."):
        assert any(g is not None and float(g.abs().sum()) > 0 for n, g in grads.items() if n.startswith(part))
    assert float(model.decoder.embed_tokens.weight.grad.abs().sum()) > 0
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)


def _finite_difference_check(model, loss_fn, n_params=6, h=1e-4):
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    loss_fn().backward()
    g = torch.Generator().manual_seed(0)
    checked = 0
    for p in params:
        if p.grad is None or float(p.grad.abs().max()) == 0:
            continue
        i = int(torch.randint(p.numel(), (1,), generator=g))
        flat = p.data.view(-1)
        orig = float(flat[i])
        with torch.no_grad():
            flat[i] = orig + h
            up = float(loss_fn())
            flat[i] = orig - h
            down = float(loss_fn())
            flat[i] = orig
        fd = (up - down) / (2 * h)
        analytic = float(p.grad.view(-1)[i])
        assert math.isclose(fd, analytic, rel_tol=1e-5, abs_tol=1e-7), (fd, analytic)
        checked += 1
        if checked == n_params:
            break
    assert checked == n_params


@pytest.mark.parametrize("options", [
    dict(relaxation="soft_topk", epsilon=0.5, scaling="none"),
    dict(relaxation="soft_topk", epsilon=0.5, scaling="none", candidates=10),
    dict(relaxation="soft_topk", epsilon=0.05, scaling="paper"),
    dict(relaxation="soft_topk", epsilon=0.05, scaling="paper", candidates=7),  # fewer than the live ones at step 0
    dict(relaxation="softmax_k_times", epsilon=0.5),
    dict(relaxation="softmax_k_times", epsilon=0.05, scaling="paper"),
])
def test_soft_loss_matches_finite_differences(options):
    d = dictionary(10)
    model = build("lstm", d)
    sample = batch(d, bsz=2, tgt_lens=(4, 3))
    _finite_difference_check(model, lambda: run(model, sample, d, beam=3, **options).nll.sum())


@pytest.mark.parametrize("relaxation", ["soft_topk", "softmax_k_times", "perturbed"])
@pytest.mark.parametrize("candidates", [0, 10])
def test_paper_scaling_gradients_are_finite_for_every_relaxation(relaxation, candidates):
    """Banned tokens and dead beams are -inf candidates at every step; under the paper scaling the temperature
    depends on the scores, and excluding those candidates must not leak a NaN into its gradient (the perturbed
    relaxation once divided them by sigma: 0 * inf in sigma's gradient, NaN in every parameter's)."""
    d = dictionary(10)
    torch.manual_seed(0)
    model = build("lstm", d)
    sample = batch(d, bsz=3, tgt_lens=(5, 3, 4))
    out = run(model, sample, d, beam=3, relaxation=relaxation, epsilon=0.3, scaling="paper", samples=4,
              candidates=candidates)
    out.nll.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.parametrize("relaxation", ["soft_topk", "softmax_k_times", "perturbed"])
@pytest.mark.parametrize("candidates", [0, 10])
def test_a_sentence_whose_model_output_is_nan_gets_a_nan_loss_and_the_others_are_unchanged(relaxation, candidates):
    """NaN log-probabilities (a model output that went NaN, or overflowed float16) make that sentence's L_SOFT
    NaN and the gradients non-finite -- what fairseq's trainer looks for to skip the batch -- instead of the
    operator's error ending the run; never a finite loss (the scaled relaxations once took a NaN candidate for
    an excluded one). The other sentences' losses are the clean run's (the deterministic relaxations: the
    perturbed one draws fresh noise)."""
    d = dictionary(10)
    sample = batch(d)
    src = sample["net_input"]["src_tokens"]
    token = int(src[0, 0])
    assert not bool((src[1:] == token).any())  # only sentence 0 reads it
    torch.manual_seed(0)
    clean = run(build("lstm", d), sample, d, beam=3, relaxation=relaxation, scaling="paper", samples=4,
                candidates=candidates)
    model = build("lstm", d)
    with torch.no_grad():
        model.encoder.embed_tokens.weight[token].fill_(torch.nan)
    torch.manual_seed(0)
    out = run(model, sample, d, beam=3, relaxation=relaxation, scaling="paper", samples=4, candidates=candidates)
    assert bool(torch.isnan(out.nll[0])) and bool(torch.isfinite(out.nll[1:]).all())
    if relaxation != "perturbed":
        torch.testing.assert_close(out.nll[1:], clean.nll[1:], rtol=0, atol=0)
    out.nll.sum().backward()
    assert not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def test_perturbed_soft_loss_with_fixed_noise_matches_finite_differences(monkeypatch):
    """With the noise fixed (the same seed for every evaluation), the perturbed A is piecewise constant in the
    parameters: the loss's derivative is then the gradient with A held fixed, which finite differences check
    to 1e-5 (the step is far too small to change which candidate a sample picks). A's own gradient -- the
    Monte-Carlo Jacobian estimate -- is checked against the closed-form derivative of its expectation in
    tests/test_perturbed_topk.py; here it must only change the gradient, not break it."""
    class FixedA(Perturbed):
        def relax(self, kept):
            relaxed = super().relax(kept)
            return relaxed._replace(A=relaxed.A.detach())

    d = dictionary(10)
    model = build("lstm", d)
    sample = batch(d, bsz=2, tgt_lens=(4, 3))
    options = dict(beam=3, relaxation="perturbed", epsilon=0.5, scaling="paper", samples=8, candidates=10)

    def loss(**changed):
        torch.manual_seed(0)  # the op draws its noise seed from torch's generator: the same noise every call
        return run(model, sample, d, **{**options, **changed}).nll.sum()

    model.zero_grad()
    loss().backward()
    full = [p.grad.clone() for p in model.parameters()]
    fixed_a = FixedA(3, 0.5, scaling="paper", samples=8)  # a relaxation object in place of a name
    _finite_difference_check(model, lambda: loss(relaxation=fixed_a))
    fixed = [p.grad for p in model.parameters()]
    assert all(torch.isfinite(g).all() for g in full)
    assert any(not torch.allclose(a, b) for a, b in zip(full, fixed))  # A's Jacobian estimate contributes


# ------------------------------------------------------------------------------------ pruning -----------

def test_pruning_keeps_hypotheses_and_its_mass_bound_holds():
    d = dictionary(30)
    model = build("lstm", d).eval()
    sample = batch(d)
    with torch.no_grad():
        exact = run(model, sample, d, beam=3, epsilon=1e-3)
        pruned = run(model, sample, d, beam=3, epsilon=1e-3, candidates=8)
    assert torch.equal(exact.hypotheses, pruned.hypotheses)
    assert float(exact.pruned_mass.abs().sum()) == 0 and float(pruned.pruned_mass.min()) >= 0


def test_more_candidates_than_live_ones_is_finite():
    """M larger than the live candidates of step 0 (one beam, V - 2 tokens): -inf entries are kept, the bound
    is 0 there and nothing turns NaN."""
    d = dictionary(6)  # V = 10, so step 0 has 8 live candidates
    model = build("lstm", d)
    out = run(model, batch(d), d, beam=3, epsilon=0.5, candidates=20)
    assert torch.isfinite(out.nll).all() and torch.isfinite(out.pruned_mass).all()
    out.nll.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    for relaxation in ("soft_topk", "softmax_k_times"):
        with torch.no_grad():
            out = run(model, batch(d), d, beam=3, epsilon=0.5, candidates=28, relaxation=relaxation)
        assert torch.isfinite(out.pruned_mass).all() and float(out.pruned_mass.min()) >= 0


@pytest.mark.parametrize("relaxation", [OptimalTransport, SoftmaxKTimes, Perturbed])
def test_the_searchs_pruned_mass_is_the_sum_of_each_steps_bound(relaxation, monkeypatch):
    """The search keeps each step's ``pruned_terms`` and bounds all steps at once: the same as each step's
    ``pruned_mass`` summed over the steps (per sentence), for every relaxation's terms."""
    per_step, terms_of_step = [], relaxation.pruned_terms

    def recording(self, relaxed, kept, rest):
        terms = terms_of_step(self, relaxed, kept, rest)
        per_step.append(self.pruned_bound(*terms))
        return terms

    monkeypatch.setattr(relaxation, "pruned_terms", recording)
    d = dictionary(20)
    sample = batch(d, bsz=3, tgt_lens=(4, 3, 6))
    name = {OptimalTransport: "soft_topk", SoftmaxKTimes: "softmax_k_times", Perturbed: "perturbed"}[relaxation]
    with torch.no_grad():
        out = run(build("lstm", d), sample, d, beam=3, epsilon=0.5, candidates=6, relaxation=name)
    assert len(per_step) == 5 and float(out.pruned_mass.min()) > 0  # T - 1 steps, each pruning something
    torch.testing.assert_close(out.pruned_mass, torch.stack(per_step).sum(0).float())


@pytest.mark.parametrize("epsilon", [0.05, 0.3, 1.0])
def test_pruned_mass_bound_bounds_the_exact_solution(epsilon):
    """The bound is derived at the kept problem's potentials; check it also bounds the mass that the pruned
    candidates get when the whole problem is solved (the figure a user cares about)."""
    torch.manual_seed(0)
    k, M = 4, 12
    for _ in range(20):
        scores = torch.randn(5, 60, dtype=torch.float64) * 2
        full = soft_topk(scores, k, sorted=True, epsilon=epsilon)
        kept, idx = scores.topk(M, -1)
        relaxation = OptimalTransport(k, epsilon, "none")
        rest = scores.scatter(1, idx, -torch.inf)
        bound = relaxation.pruned_mass(relaxation.relax(kept), kept, rest.clone())
        true = full.sum(-1).sum(-1) - full.gather(1, idx.unsqueeze(-1).expand(-1, -1, k)).sum(-1).sum(-1)
        assert bool((true <= bound + 1e-12).all()), (true, bound)
    # softmax_k_times, rank 0: the exact pruned mass S_p / (S_p + S).
    relaxation = SoftmaxKTimes(1, epsilon, "none")
    got = relaxation.pruned_mass(relaxation.relax(kept), kept, rest.clone())
    want = 1 - torch.softmax(scores / epsilon, -1).gather(1, idx).sum(-1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("sigma", [0.3, 1.0, 3.0])
def test_perturbed_pruned_mass_bound_bounds_the_full_problems_expectation(sigma):
    """The perturbed bound holds for the expectation: checked against a large-sample estimate of the mass the
    pruned candidates get in the full perturbed problem (its Monte-Carlo error is far below the margins)."""
    from softtopk_fairseq.ops import perturbed_topk

    torch.manual_seed(0)
    k, M = 3, 8
    scores = torch.randn(6, 40, dtype=torch.float64) * 2
    kept, idx = scores.topk(M, -1)
    full = perturbed_topk(scores, k, sigma=sigma, samples=20000, sorted=True,
                          generator=torch.Generator().manual_seed(1))
    true = k - full.gather(1, idx.unsqueeze(-1).expand(-1, -1, k)).sum((-1, -2))
    rest = scores.scatter(1, idx, -torch.inf)
    relaxation = Perturbed(k, sigma, "none")
    bound = relaxation.pruned_mass(relaxation.relax(kept), kept, rest.clone())
    assert bool((true <= bound + 0.01).all()), (true, bound)
    assert bool((bound <= k * (1 + 1e-12)).all()) and bool((bound > 0).all())
    if sigma == 0.3:  # small noise: the bound is informative, not the cap
        assert float(bound.max()) < 0.5 * k


# ------------------------------------------------------------------------------------ criterion ---------

def _criterion(task, rho, **kw):
    return SoftBeamSearchCriterion(task, SoftBeamSearchConfig(sentence_avg=False, label_smoothing=0.1,
                                                             teacher_forcing_ratio=rho, soft_beam_size=3, **kw))


def _loss_and_grads(criterion, model, sample):
    model.zero_grad()
    loss, sample_size, log = criterion(model, sample)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], log


@pytest.mark.parametrize("arch", ["lstm", "transformer"])
def test_rho_one_is_exactly_label_smoothed_cross_entropy(arch):
    d = dictionary(12)
    model = build(arch, d, dtype=torch.float32, dropout=0.0)
    sample = batch(d)
    task = TinyTask(d)
    stock = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    loss_a, grads_a, _ = _loss_and_grads(stock, model, sample)
    loss_b, grads_b, log = _loss_and_grads(_criterion(task, 1.0), model, sample)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert "soft_loss" not in log


@pytest.fixture
def lstm_losses():
    """A float64 LSTM, its batch and task, and the pure teacher-forcing and pure L_SOFT losses on it."""
    d = dictionary(12)
    model = build("lstm", d, dtype=torch.float64)
    sample = batch(d)
    task = TinyTask(d)
    tf, _, _ = _criterion(task, 1.0)(model, sample)
    soft, _, soft_log = _criterion(task, 0.0, soft_beam_epsilon=0.5)(model, sample)
    return model, sample, task, tf, soft, soft_log


def test_rho_mixes_the_two_losses(lstm_losses):
    model, sample, task, tf, soft, log0 = lstm_losses
    mixed, size, log = _criterion(task, 0.8, soft_beam_epsilon=0.5)(model, sample)
    torch.testing.assert_close(mixed, 0.8 * tf + 0.2 * soft)
    assert size == sample["ntokens"]
    for key in ("loss", "nll_loss", "tf_loss", "soft_loss", "soft_topk_iters", "pruned_mass"):
        assert key in log
    assert log0["nll_loss"] == log0["soft_loss"]  # rho = 0: no teacher-forcing pass, nll is the beam's


@pytest.mark.parametrize("arch", ["lstm", "transformer", "rnnsearch"])
def test_sum_mode_runs_the_encoder_once_for_both_losses(arch):
    """fairseq's encoder-then-decoder forwards: one encoder pass serves the teacher-forcing decoder and the beam
    search, with the same losses and gradients as two passes (no dropout here: the passes are deterministic); a
    model with a forward of its own keeps its forward for L_tf and runs the encoder again for the search."""
    d = dictionary(12)
    model = build(arch, d, dtype=torch.float64)
    sample = batch(d)
    task = TinyTask(d)
    calls = []
    model.encoder.register_forward_hook(lambda *args: calls.append(1))
    tf, _, _ = _criterion(task, 1.0)(model, sample)
    soft, _, _ = _criterion(task, 0.0, soft_beam_epsilon=0.5)(model, sample)
    calls.clear()
    shared_loss, shared_grads, log = _loss_and_grads(_criterion(task, 0.6, soft_beam_epsilon=0.5,
                                                               report_accuracy=True), model, sample)
    assert len(calls) == 1
    assert log["total"] == sample["ntokens"] and 0 <= log["n_correct"] <= log["total"]  # --report-accuracy
    torch.testing.assert_close(shared_loss, 0.6 * tf.detach() + 0.4 * soft.detach())

    class OwnForward(type(model)):
        def forward(self, src_tokens, src_lengths, prev_output_tokens):
            return super().forward(src_tokens, src_lengths, prev_output_tokens)

    model.__class__ = OwnForward
    calls.clear()
    loss, grads, _ = _loss_and_grads(_criterion(task, 0.6, soft_beam_epsilon=0.5), model, sample)
    assert len(calls) == 2
    torch.testing.assert_close(loss, shared_loss)
    for a, b in zip(grads, shared_grads):
        torch.testing.assert_close(a, b)


def test_rnnsearch_projects_the_keys_once_per_encoder_output():
    """RNNsearch's incremental decoding projects the annotations' keys once for an encoder output passed to every
    step, as the soft beam search passes it -- its full pass's log-probabilities all the same -- and again for
    every other one: a generator's reorder of the encoder output (here the sentences reversed at every step,
    where the keys of the first step would be another sentence's)."""
    d = dictionary(12)
    model = build("rnnsearch", d).eval()
    sample = batch(d)
    ni = sample["net_input"]
    bsz, T = sample["target"].shape
    projections = []
    model.decoder.attention.key_proj.register_forward_hook(lambda *args: projections.append(1))
    with torch.no_grad():
        full = model(**ni)[0]
        run(model, sample, d, beam=3, epsilon=0.5, candidates=6)
        assert len(projections) == 2  # one for the full pass, one for all the search's steps
        projections.clear()
        reverse = torch.arange(bsz - 1, -1, -1)
        for reorder in (False, True):
            encoder_out = model.encoder(ni["src_tokens"], src_lengths=ni["src_lengths"])
            state, order, steps = {}, torch.arange(bsz), []
            for t in range(T):
                if reorder and t:
                    encoder_out = model.encoder.reorder_encoder_out(encoder_out, reverse)
                    model.decoder.reorder_incremental_state_scripting(state, reverse)
                    order = order[reverse]
                out = model.decoder(ni["prev_output_tokens"][order, :t + 1], encoder_out=encoder_out,
                                    incremental_state=state)[0][:, -1]
                steps.append(out[torch.argsort(order)])
            assert len(projections) == (T if reorder else 1)
            projections.clear()
            torch.testing.assert_close(torch.stack(steps, 1), full, rtol=0, atol=1e-12)


TOPK_ATTENTION = {"transformer_topk_attn": dict(topk_attn_k=2, topk_attn_layers="encoder-decoder,decoder-self"),
                  "lstm_topk_attn": dict(topk_attn_k=2, decoder_attention="True")}


@pytest.mark.parametrize("arch", ARCHS + tuple(TOPK_ATTENTION))
def test_teacher_forced_rows_leave_the_beams_alone_and_give_teacher_forcing_log_probs(arch):
    """One teacher-forced row per sentence beside the beams: the beams' search is unchanged, and the row's
    log-probabilities are fairseq's own incremental decoding of the gold prefix (to rounding) -- which is its full
    pass's at the real positions (to float32 rounding: the full transformer pass computes its attention softmax
    in float32 even for a float64 model). Also with SOFT top-k attention in the decoder."""
    d = dictionary(12)
    model = build(arch, d, **TOPK_ATTENTION.get(arch, {})).eval()
    sample = batch(d)
    ni = sample["net_input"]
    T = sample["target"].shape[1]
    with torch.no_grad():
        plain = run(model, sample, d, beam=3, epsilon=0.5, candidates=6)
        joint = run(model, sample, d, beam=3, epsilon=0.5, candidates=6, teacher_forcing=ni["prev_output_tokens"])
        encoder_out, state = model.encoder(ni["src_tokens"], src_lengths=ni["src_lengths"]), {}
        incremental = torch.stack([torch.log_softmax(model.decoder(
            ni["prev_output_tokens"][:, :t + 1], encoder_out=encoder_out, incremental_state=state)[0][:, -1], -1)
            for t in range(T)], 1)
        full = torch.log_softmax(model(**ni)[0], -1)
    assert plain.teacher_forced_lprobs is None
    assert torch.equal(joint.hypotheses, plain.hypotheses)
    for name in ("nll", "hypothesis_scores", "solver_iterations", "solver_error", "pruned_mass"):
        torch.testing.assert_close(getattr(joint, name), getattr(plain, name), rtol=0, atol=1e-12)
    torch.testing.assert_close(joint.teacher_forced_lprobs, incremental, rtol=0, atol=1e-12)
    real = sample["target"].ne(d.pad())
    torch.testing.assert_close(joint.teacher_forced_lprobs[real], full[real], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="teacher_forcing of shape"):
        run(model, sample, d, beam=3, teacher_forcing=ni["prev_output_tokens"][:, 1:])


@pytest.mark.parametrize("arch", ARCHS)
def test_teacher_forcing_in_the_search_is_the_separate_pass_in_one_decoder_call_per_step(arch):
    """``--teacher-forcing-pass search``: the sum-mode loss, its logs and gradients of ``separate`` (to the float32
    rounding of fairseq's own normalisation there), with one decoder call per target position instead of one more
    for teacher forcing; ``auto`` is ``separate`` on CPU."""
    d = dictionary(12)
    model = build(arch, d, dtype=torch.float64)
    sample = batch(d)
    task = TinyTask(d)
    calls = []
    model.decoder.register_forward_hook(lambda *args: calls.append(1))
    runs = {}
    for tf_pass in ("separate", "search", "auto"):
        calls.clear()
        criterion = _criterion(task, 0.6, soft_beam_epsilon=0.5, teacher_forcing_pass=tf_pass, report_accuracy=True)
        runs[tf_pass] = (*_loss_and_grads(criterion, model, sample), len(calls))
    T = sample["target"].shape[1]
    (loss, grads, log, calls_search), (ref_loss, ref_grads, ref_log, calls_separate) = runs["search"], runs["separate"]
    assert (calls_search, calls_separate) == (T, T + 1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for key in ("tf_loss", "soft_loss", "nll_loss"):
        assert math.isclose(float(log[key]), float(ref_log[key]), rel_tol=1e-6), key
    assert (log["n_correct"], log["total"]) == (ref_log["n_correct"], ref_log["total"])
    scale = max(float(g.abs().max()) for g in ref_grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)
    auto_loss, auto_grads, _, calls_auto = runs["auto"]
    assert calls_auto == T + 1 and torch.equal(auto_loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(auto_grads, ref_grads))


def test_layer_drop_is_drawn_once_per_criterion_call():
    """``--decoder-layerdrop``: fairseq draws the layers each time a layer list is iterated -- at every decoding
    step of the beam search. The criterion keeps one draw for its whole call: the decoder layer runs at every step
    (and in the teacher-forcing pass) or at none; the draw still varies between calls, and the list iterates as
    fairseq's again afterwards."""
    d = dictionary(12)
    model = build("transformer", d, decoder_layerdrop=0.5)
    sample = batch(d)
    task = TinyTask(d)
    T = sample["target"].shape[1]
    calls = []
    model.decoder.layers[0].register_forward_hook(lambda *args: calls.append(1))
    for rho, tf_pass, runs in ((0.0, "auto", T), (0.5, "separate", T + 1), (0.5, "search", T)):
        seen = set()
        for seed in range(8):
            torch.manual_seed(seed)
            calls.clear()
            _criterion(task, rho, soft_beam_epsilon=0.5, teacher_forcing_pass=tf_pass)(model, sample)
            seen.add(len(calls))
        assert seen == {0, runs}, (rho, tf_pass, seen)
    assert type(model.decoder.layers) is LayerDropModuleList and not hasattr(model.decoder.layers, "drawn")


def test_sample_mode_draws_one_loss_per_training_batch_with_probability_rho(lstm_losses):
    """Each training batch runs one pass; its log has the keys of both, the other's 0 (fairseq sums workers' and
    --update-freq's logs over the first one's keys: a key missing there was dropped); validation computes both,
    weighted as in sum mode (it once reported one loss drawn at random)."""
    model, sample, task, tf, soft, _ = lstm_losses
    crit = _criterion(task, 0.7, soft_beam_epsilon=0.5, teacher_forcing_mode="sample", report_accuracy=True)
    both = _criterion(task, 0.7, soft_beam_epsilon=0.5, report_accuracy=True)
    keys = set(both(model, sample)[2])
    torch.manual_seed(0)
    picks = []
    for _ in range(40):
        loss, _, log = crit(model, sample)
        picks.append(log["tf_ntokens"] > 0)
        assert set(log) == keys and (log["tf_ntokens"] > 0) != (log["soft_ntokens"] > 0)
        assert torch.is_tensor(log["tf_loss"]) and torch.is_tensor(log["soft_loss"])  # (all-reduced with tensors)
        assert (log["total"] > 0) == picks[-1] and (log["soft_topk_steps"] > 0) != picks[-1]
        torch.testing.assert_close(loss, tf if picks[-1] else soft)
    assert 0.45 < sum(picks) / len(picks) < 0.95  # Binomial(40, 0.7): outside this with p < 1e-3
    crit.eval()
    for _ in range(3):
        loss, _, log = crit(model, sample)
        torch.testing.assert_close(loss, 0.7 * tf + 0.3 * soft)
        assert log["tf_ntokens"] > 0 and log["soft_ntokens"] > 0


def test_criterion_rejects_bad_flags():
    task = TinyTask(dictionary(8))
    for kw, match in ((dict(rho=1.5), "teacher-forcing-ratio"), (dict(rho=0.5, soft_beam_epsilon=0), "epsilon"),
                      (dict(rho=0.5, soft_beam_candidates=2), "candidates"),
                      (dict(rho=0.5, soft_beam_candidates=-1), r"--soft-beam-candidates must be 0 \(all\) or >="),
                      (dict(rho=0.5, soft_beam_epsilon=float("inf")), "--soft-beam-epsilon must be a finite number"),
                      (dict(rho=0.5, soft_beam_relaxation="perturbed", soft_beam_epsilon=0), "soft-beam-epsilon"),
                      (dict(rho=0.5, soft_beam_relaxation="perturbed", soft_beam_samples=0), "soft-beam-samples"),
                      (dict(rho=0.5, soft_beam_relaxation="hard_topk"), "--soft-beam-relaxation must be one of"),
                      (dict(rho=0.5, soft_beam_scaling="nats"), "--soft-beam-scaling must be one of")):
        rho = kw.pop("rho")
        with pytest.raises(ValueError, match=match):
            _criterion(task, rho, **kw)
    # Outside fairseq a config without sentence_avg holds fairseq's interpolation string, which is truthy.
    with pytest.raises(ValueError, match="sentence_avg"):
        SoftBeamSearchCriterion(task, SoftBeamSearchConfig())


def test_rho_zero_warns_that_teacher_forcing_flags_are_ignored():
    """rho 0 computes no L_tf, so label smoothing and token accuracy -- both teacher forcing's -- do nothing: the
    criterion says so instead of logging no accuracy and an unsmoothed loss in silence."""
    task = TinyTask(dictionary(8))
    with pytest.warns(UserWarning, match=r"--label-smoothing and --report-accuracy apply to teacher forcing's L_tf, "
                                         r"which --teacher-forcing-ratio 0 leaves out: ignored"):
        _criterion(task, 0.0, report_accuracy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _criterion(task, 0.5, report_accuracy=True)  # L_tf computed: both apply
        SoftBeamSearchCriterion(task, SoftBeamSearchConfig(sentence_avg=False, teacher_forcing_ratio=0.0,
                                                           soft_beam_size=3))  # neither given: nothing to say


def test_criterion_defaults_are_the_config_fields():
    """Each default is written once, in SoftBeamSearchConfig: a criterion built from it searches with them."""
    config = SoftBeamSearchConfig(sentence_avg=False)
    criterion = SoftBeamSearchCriterion(TinyTask(dictionary(8)), config)
    assert criterion.rho == config.teacher_forcing_ratio == 0.8 and not criterion.sample_mode
    assert criterion.search_options == dict(beam=5, relaxation="soft_topk", epsilon=0.1, scaling="paper", tol=None,
                                            max_iter=None, candidates=0, bookkeeping="argmax",
                                            samples=config.soft_beam_samples)


def test_decoder_without_embed_tokens_is_a_clear_error():
    d = dictionary(8)
    model = build("lstm", d)
    del model.decoder.embed_tokens
    model.decoder.embed_tokens = None
    with pytest.raises(TypeError, match="embed_tokens"):
        run(model, batch(d), d, beam=2)


def test_a_model_without_an_incremental_decoder_is_a_clear_error():
    """A fairseq decoder that is not incremental (FairseqDecoder) failed mid-search with an AttributeError on a
    method of fairseq's; it is named up front with what the search needs."""
    from fairseq.models import FairseqDecoder, FairseqEncoderDecoderModel

    d = dictionary(8)

    class FullPassDecoder(FairseqDecoder):
        def __init__(self):
            super().__init__(d)
            self.embed_tokens = torch.nn.Embedding(len(d), 8)

    model = FairseqEncoderDecoderModel(build("lstm", d).encoder, FullPassDecoder())
    with pytest.raises(TypeError, match=r"soft_beam_search: FairseqEncoderDecoderModel lacks "
                                        r"decoder.reorder_incremental_state_scripting: the search needs a fairseq "
                                        r"encoder-decoder model .* incremental"):
        run(model, batch(d), d, beam=2)


def test_rows_capped_at_max_iter_are_logged_and_warned_about_once():
    """The search reads nothing back per step, so soft_topk's own max_iter warning is off there; the criterion
    counts the capped rows in its one read per batch (``soft_topk_capped``, per step in fairseq's logs) and warns
    with one text -- shown once by Python's default filter."""
    from fairseq import metrics

    from softtopk_fairseq.criterions.soft_beam_search import CAPPED_WARNING

    d = dictionary(12)
    model, sample, task = build("lstm", d, dtype=torch.float64), batch(d), TinyTask(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither soft_topk's warning nor the criterion's
        _, _, log = _criterion(task, 0.5, soft_beam_epsilon=0.5)(model, sample)
    assert log["soft_topk_capped"] == 0
    out = run(model, sample, d, beam=3, epsilon=0.05, max_iter=1)
    assert out.solver_capped.shape == out.solver_iterations.shape and int(out.solver_capped.sum()) > 0
    with pytest.warns(RuntimeWarning) as caught:
        _, _, log = _criterion(task, 0.5, soft_beam_epsilon=0.05, soft_topk_max_iter=1)(model, sample)
    assert [str(w.message) for w in caught] == [CAPPED_WARNING]  # not soft_topk's, once per step
    assert 0 < log["soft_topk_capped"] <= log["soft_sentence_steps"]  # rows: one per sentence and step
    with metrics.aggregate() as agg:
        SoftBeamSearchCriterion.reduce_metrics([log, log])
    assert agg.get_smoothed_values()["soft_topk_capped"] == round(log["soft_topk_capped"] / log["soft_topk_steps"], 4)


def test_the_logged_solver_error_is_the_mean_of_the_batches_largest_whatever_the_number_of_workers():
    """fairseq sums the logs of all workers and --update-freq batches; soft_topk_err must not grow with them."""
    from fairseq import metrics

    d = dictionary(12)
    model, sample, task = build("lstm", d, dtype=torch.float64), batch(d), TinyTask(d)
    _, _, log = _criterion(task, 0.5, soft_beam_epsilon=0.05, soft_topk_max_iter=2)(model, sample)
    assert log["soft_batches"] == 1 and log["soft_topk_err_max"] > 0
    other = dict(log, soft_topk_err_max=3 * log["soft_topk_err_max"])
    for logs, want in (([log], log["soft_topk_err_max"]), ([log] * 8, log["soft_topk_err_max"]),
                       ([log, other], 2 * log["soft_topk_err_max"])):
        with metrics.aggregate() as agg:
            SoftBeamSearchCriterion.reduce_metrics(logs)
        assert agg.get_smoothed_values()["soft_topk_err"] == pytest.approx(want, rel=1e-6, abs=1e-8), len(logs)


def test_a_fully_sharded_model_is_refused_naming_the_backends_that_work():
    """Under --ddp-backend fully_sharded the parameters exist whole only inside the wrapper's forward; the search
    calls the encoder and decoder itself. (The wrapper is recognised by its class name: fairseq's, fairscale's
    and torch's are all FullyShardedDataParallel.)"""
    class FullyShardedDataParallel(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    d = dictionary(12)
    model, sample, task = build("lstm", d), batch(d), TinyTask(d)
    for rho in (0.5, 0.0):
        with pytest.raises(NotImplementedError, match="--ddp-backend fully_sharded is not supported.*use "
                                                      "--ddp-backend pytorch_ddp or legacy_ddp"):
            _criterion(task, rho)(FullyShardedDataParallel(model), sample)
