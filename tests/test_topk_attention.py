"""Top-k attention: the weights function, the fairseq layers, and the architectures (Python level)."""
import copy

import pytest
import torch

from fairseq.models.lstm import AttentionLayer
from fairseq.modules import MultiheadAttention
from softtopk_fairseq.models.topk_attention import TopkAttentionLayer, TopkMultiheadAttention
from softtopk_fairseq.modules import relaxations
from softtopk_fairseq.modules.topk_attention import topk_attention_weights
from tiny_models import batch, build, dictionary

NEG = -torch.inf


# ------------------------------------------------------------------------------- the weights ----------

@pytest.mark.parametrize("mode", relaxations.names("attention"))
def test_k_at_least_the_valid_keys_is_softmax(mode):
    torch.manual_seed(0)
    scores = torch.randn(4, 3, 6, dtype=torch.float64)
    scores[0, :, 4:] = NEG                      # 4 valid keys in row 0
    for k in (4, 6, 9):
        got = topk_attention_weights(scores[:1], k, mode=mode, epsilon=0.05)
        torch.testing.assert_close(got, torch.softmax(scores[:1], -1), rtol=1e-12, atol=1e-12)
    got = topk_attention_weights(scores[1:], 6, mode=mode)
    torch.testing.assert_close(got, torch.softmax(scores[1:], -1), rtol=1e-12, atol=1e-12)


def test_hard_mode_keeps_exactly_the_top_k():
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    w = topk_attention_weights(scores, 2, mode="hard_topk")
    want = torch.softmax(torch.tensor([[3.0, NEG, 2.0, NEG, NEG]]), -1)
    torch.testing.assert_close(w, want)


def test_soft_mode_concentrates_on_k_keys_and_tends_to_hard():
    torch.manual_seed(1)
    # Well-separated scores (gaps >= 0.25), so epsilon = 1e-3 is far below every gap.
    scores = torch.stack([torch.randperm(40) for _ in range(16)]).double() * 0.25
    hard = topk_attention_weights(scores, 5, mode="hard_topk")
    soft = topk_attention_weights(scores, 5, mode="soft_topk", epsilon=1e-3)
    torch.testing.assert_close(soft, hard, atol=1e-6, rtol=0)
    smooth = topk_attention_weights(scores, 5, mode="soft_topk", epsilon=0.5)
    top5 = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(5, -1).indices, True)
    plain = torch.softmax(scores, -1)
    assert bool(((smooth * top5).sum(-1) > (plain * top5).sum(-1)).all())  # more mass on the top 5


def test_perturbed_mode_tends_to_hard_and_trains_in_every_arch():
    """--topk-attn-mode perturbed: tiny noise gives the hard top-k weights; in the three top-k archs a training
    step with it (and eval with it) gives finite outputs and gradients on the attention parameters."""
    torch.manual_seed(3)
    scores = torch.stack([torch.randperm(40) for _ in range(8)]).double() * 0.25
    hard = topk_attention_weights(scores, 5, mode="hard_topk")
    torch.testing.assert_close(topk_attention_weights(scores, 5, mode="perturbed", epsilon=1e-4, samples=4),
                               hard, atol=1e-9, rtol=0)
    smooth = topk_attention_weights(scores, 5, mode="perturbed", epsilon=0.5, samples=64)
    top5 = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(5, -1).indices, True)
    assert bool(((smooth * top5).sum(-1) > (torch.softmax(scores, -1) * top5).sum(-1)).all())
    d = dictionary(12)
    ni = batch(d)["net_input"]
    for arch in ("transformer_topk_attn", "lstm_topk_attn", "rnnsearch_topk_attn"):
        model = build(arch, d, dtype=torch.float32, topk_attn_k=2, topk_attn_mode="perturbed", topk_attn_samples=8)
        out, _ = model(**ni)
        out.pow(2).mean().backward()
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        assert {m.topk_mode for m in model.modules() if hasattr(m, "topk_mode")} == {"perturbed"}
        assert {m.topk_samples for m in model.modules() if hasattr(m, "topk_samples")} == {8}
        with torch.no_grad():
            assert torch.isfinite(model.eval()(**ni)[0]).all()


@pytest.mark.parametrize("mode", relaxations.names("attention"))
def test_masked_keys_get_zero_weight_and_zero_gradient_and_nothing_is_nan(mode):
    torch.manual_seed(2)
    scores = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(5, 10, dtype=torch.bool)
    mask[:, 7:] = True       # padding
    mask[1, :] = True        # a fully masked row (e.g. a padding query)
    mask[2, 2:] = True       # fewer valid keys (2) than k
    w = topk_attention_weights(scores.masked_fill(mask, NEG), 3, mode=mode, epsilon=0.05)
    assert torch.isfinite(w).all()
    assert float(w.detach()[mask].abs().max()) == 0.0
    torch.testing.assert_close(w.sum(-1), torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    (w * torch.randn_like(w)).sum().backward()
    assert torch.isfinite(scores.grad).all() and float(scores.grad[mask].abs().max()) == 0.0


@pytest.mark.parametrize("mode", relaxations.names("attention"))
@pytest.mark.parametrize("dim", [-1, 0])
def test_a_row_with_a_nan_or_plus_inf_score_gets_nan_weights_in_every_mode_and_the_others_do_not_change(mode, dim):
    """As torch.softmax gives (and fairseq's trainer expects from a float16 overflow of q.k): NaN weights on
    that row -- not the operator's error, and never finite weights (a NaN key is not a masked one); the other
    rows are the clean call's (the perturbed mode draws fresh noise: its clean rows only sum to 1)."""
    torch.manual_seed(4)
    clean = torch.randn(5, 8)
    clean[:, 6:] = NEG            # padding
    bad = clean.clone()
    bad[1, 2] = torch.inf         # an overflow
    bad[3, 0] = torch.nan
    bad[4, :] = torch.nan         # a whole row of NaN: not a fully masked row (zeros)
    if dim == 0:
        clean, bad = clean.t(), bad.t()
    torch.manual_seed(0)
    w_clean = topk_attention_weights(clean, 3, mode=mode, epsilon=0.2, dim=dim)
    torch.manual_seed(0)
    w = topk_attention_weights(bad, 3, mode=mode, epsilon=0.2, dim=dim)
    if dim == 0:
        w, w_clean = w.t(), w_clean.t()
    assert bool(torch.isnan(w[[1, 3, 4], :6]).all())
    good = [0, 2]
    if mode == "perturbed":
        torch.testing.assert_close(w[good].sum(-1), torch.ones(2))
    else:
        torch.testing.assert_close(w[good], w_clean[good], rtol=0, atol=0)


@pytest.mark.parametrize("mode", [m for m in relaxations.names("attention") if m != "perturbed"])
def test_compiled_a_row_with_a_nan_or_plus_inf_score_gets_nan_weights_too(mode):
    """Under torch.compile(fullgraph=True) the operator's refusal could not reach the NaN fallback: the SOFT top-k
    attention raised BadScoresError. (The perturbed mode draws its noise seed on the host: no full graph.)"""
    torch.manual_seed(4)
    scores = torch.randn(2, 3, 6)
    scores[0, 0, 0] = torch.nan
    scores[1, 2, 3] = torch.inf
    eager = topk_attention_weights(scores, 2, mode=mode, epsilon=0.2)
    torch.compiler.reset()
    compiled = torch.compile(lambda s: topk_attention_weights(s, 2, mode=mode, epsilon=0.2), fullgraph=True,
                             backend="aot_eager")(scores)
    assert bool(compiled[0, 0].isnan().all()) and bool(compiled[1, 2].isnan().all())
    torch.testing.assert_close(compiled, eager, equal_nan=True)


def test_soft_weights_gradcheck():
    torch.manual_seed(3)
    scores = torch.randn(3, 7, dtype=torch.float64)
    scores[0, 5:] = NEG
    scores.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: topk_attention_weights(s, 3, mode="soft_topk", epsilon=0.3), (scores,))


def test_far_keys_do_not_make_nan_gradients():
    """A key far below the top k has A ~ 0 in float32; log A is floored, so no inf * 0."""
    scores = torch.tensor([[10.0, 9.0, 8.0, -200.0, -1e4]], requires_grad=True)
    w = topk_attention_weights(scores, 2, mode="soft_topk", epsilon=0.01)
    w[0, 0].backward()
    assert torch.isfinite(scores.grad).all() and torch.isfinite(w).all()


# -------------------------------------------------------------------------------- the layers ----------

def test_multihead_attention_in_softmax_mode_equals_fairseq():
    torch.manual_seed(4)
    stock = MultiheadAttention(8, 2, dropout=0.0, encoder_decoder_attention=True)
    topk = TopkMultiheadAttention.convert(copy.deepcopy(stock), k=3, epsilon=0.1, mode="softmax", inference="same")
    q, kv = torch.randn(4, 3, 8), torch.randn(6, 3, 8)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[2, 4:] = True
    a, wa = stock(q, kv, kv, key_padding_mask=pad, static_kv=True)
    b, wb = topk(q, kv, kv, key_padding_mask=pad, static_kv=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(wa, wb)
    topk.configure_topk(6, 0.1, "soft_topk", "same")  # k >= number of keys: softmax again
    torch.testing.assert_close(topk(q, kv, kv, key_padding_mask=pad, static_kv=True)[0], a)
    topk.configure_topk(2, 0.1, "hard_topk", "same")
    _, w = topk(q, kv, kv, key_padding_mask=pad, static_kv=True)
    assert int((w[:, 0] > 0).sum(-1).max()) <= 2 * 2  # head-averaged: at most k keys per head


def test_multihead_attention_takes_torchs_bool_masks_and_refuses_what_fairseqs_path_would_misread():
    """The layer takes fairseq's own path (not PyTorch's fused attention), which adds attn_mask to the scores: a
    bool mask (True = blocked, as PyTorch's attention and fairseq's fused path read it) raised blocked scores by 1
    -- query 0 of a causal mask put most of its weight on the future. It masks them, as the stock layer does; a
    per-head 3-D mask and a query of the wrong width are refused by name (not torch shape errors)."""
    torch.manual_seed(6)
    stock = MultiheadAttention(8, 2, self_attention=True).eval()
    topk = TopkMultiheadAttention.convert(copy.deepcopy(stock), k=2, epsilon=0.1, mode="softmax", inference="same")
    x = torch.randn(5, 3, 8)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    additive = torch.zeros(5, 5).masked_fill(causal, -torch.inf)
    want, want_w = stock(x, x, x, attn_mask=causal)
    for mask in (causal, causal.to(torch.uint8), additive):
        got, got_w = topk(x, x, x, attn_mask=mask)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_w, want_w)
    topk.configure_topk(2, 0.1, "soft_topk", "same")
    _, w = topk(x, x, x, attn_mask=causal)
    assert float(w.detach()[:, 0, 1:].abs().max()) == 0.0  # nothing on the future
    with pytest.raises(ValueError, match=r"TopkMultiheadAttention: attn_mask has shape \(6, 5, 5\); it must be "
                                         r"\(tgt_len, src_len\) with tgt_len = 5"):
        topk(x, x, x, attn_mask=causal.expand(6, 5, 5))
    with pytest.raises(ValueError, match=r"TopkMultiheadAttention: the query's last dimension is 6, the layer's "
                                         r"embed_dim is 8"):
        topk(x[..., :6], x[..., :6], x[..., :6])
    assert "k=2, mode=soft_topk, inference=same, epsilon=0.1" in repr(topk)  # (the printout fairseq-train logs)


def test_lstm_attention_layer_in_softmax_mode_equals_fairseq_and_hard_selects_k():
    torch.manual_seed(5)
    stock = AttentionLayer(8, 6, 8)
    topk = TopkAttentionLayer.convert(copy.deepcopy(stock), k=2, epsilon=0.1, mode="softmax", inference="same")
    x, src = torch.randn(3, 8), torch.randn(5, 3, 6)
    pad = torch.zeros(5, 3, dtype=torch.bool)
    pad[3:, 1] = True
    for got, want in zip(topk(x, src, pad), stock(x, src, pad)):
        torch.testing.assert_close(got, want)
    topk.configure_topk(2, 0.1, "hard_topk", "same")
    _, w = topk(x, src, pad)
    w = w.detach()
    assert (w > 0).sum(0).tolist() == [2, 2, 2] and float(w[pad].abs().max()) == 0.0


def test_inference_mode_switches_only_in_eval():
    layer = TopkAttentionLayer.convert(AttentionLayer(4, 4, 4), k=2, epsilon=0.1, mode="soft_topk", inference="hard_topk")
    assert layer.train().active_topk_mode == "soft_topk" and layer.eval().active_topk_mode == "hard_topk"
    layer.configure_topk(2, 0.1, "soft_topk", "same")
    assert layer.eval().active_topk_mode == "soft_topk"
    with pytest.raises(ValueError, match="top-k attention: --topk-attn-k must be an int >= 1, got 0"):
        layer.configure_topk(0, 0.1, "soft_topk", "same")
    with pytest.raises(ValueError, match=r"--topk-attn-inference must be one of .*, got 'sparse'; "
                                         r"--topk-attn-epsilon must be a finite number > 0, got inf"):
        layer.configure_topk(2, float("inf"), "soft_topk", "sparse")


@pytest.mark.parametrize("bad, exc, match", [
    (dict(dim=5), ValueError, r"dim=5 is out of range for scores with 2 dimension\(s\)"),
    (dict(scores=torch.ones(3, 2, dtype=torch.long)), TypeError, "scores must be a floating-point tensor"),
    (dict(k=2.5, mode="hard_topk"), ValueError, "k must be an int >= 1, got 2.5"),
    (dict(k=8, epsilon=-1.0), ValueError, "epsilon must be a finite number > 0, got -1.0"),  # (k >= n: softmax)
    (dict(mode="softmax", samples=0), ValueError, "samples must be an int >= 1, got 0"),
    (dict(mode="sparse"), ValueError, r"mode must be one of \("),
])
def test_topk_attention_weights_checks_its_arguments_in_every_mode(bad, exc, match):
    """Every argument is checked on entry, naming the function: torch's own errors came through for a bad dim,
    integer scores or a float k, and a bad epsilon or sample count passed silently in the modes that do not use
    them."""
    kwargs = dict(scores=torch.randn(3, 6), k=2, mode="soft_topk", epsilon=0.1, dim=-1, samples=4)
    kwargs.update(bad)
    with pytest.raises(exc, match=f"topk_attention_weights: {match}"):
        topk_attention_weights(kwargs.pop("scores"), kwargs.pop("k"), **kwargs)


def test_a_float64_attention_takes_a_temperature_below_float32s_range():
    """The options' rule leaves the range to the operator, which knows the scores' type: float64 scores are computed
    in float64, and a temperature float32 would round to 0 is theirs to use."""
    scores = torch.randn(3, 6, dtype=torch.float64)
    assert bool(torch.isfinite(topk_attention_weights(scores, 2, mode="soft_topk", epsilon=1e-39)).all())
    with pytest.raises(ValueError, match="soft_topk: epsilon=1e-39 is outside float32's range"):
        topk_attention_weights(scores.float(), 2, mode="soft_topk", epsilon=1e-39)


@pytest.mark.parametrize("arch", ["rnnsearch", "rnnsearch_topk_attn"])
def test_rnnsearch_attention_is_over_the_sources_own_positions(arch):
    """fairseq's generator reads the decoder's attention against src_tokens (--print-alignment, --replace-unk):
    the encoder runs on right-padded tokens, and the weights of a left-padded sentence were over those -- on its
    padding columns, the last tokens' weights missing. A left-padded row's weights are the same sentence's alone,
    shifted to its tokens, with zeros on its padding."""
    d = dictionary()
    model = build(arch, d, **({"topk_attn_k": 2} if "topk" in arch else {})).eval()
    ni = batch(d)["net_input"]
    src, pads = ni["src_tokens"], 2
    assert bool(src[-1, :pads].eq(d.pad()).all()) and not bool(src[:-1].eq(d.pad()).any())
    with torch.no_grad():
        attn = model(**ni)[1]["attn"][0]                                     # (B, T, S)
        alone = model(src[-1:, pads:], ni["src_lengths"][-1:], ni["prev_output_tokens"][-1:])[1]["attn"][0]
    assert float(attn[-1, :, :pads].abs().max()) == 0.0
    torch.testing.assert_close(attn[-1, :, pads:], alone[0])
    torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:2], dtype=attn.dtype))


def test_a_layer_refused_by_convert_is_left_as_it_was():
    """convert checks the options before it changes the layer: a refused conversion left a half-converted layer
    behind, whose next forward failed with an AttributeError."""
    layer = AttentionLayer(4, 4, 4)
    with pytest.raises(ValueError, match="top-k attention: --topk-attn-k must be an int >= 1, got 0"):
        TopkAttentionLayer.convert(layer, k=0, epsilon=0.1, mode="soft_topk", inference="same")
    assert type(layer) is AttentionLayer


def test_topk_attention_on_a_transformer_without_cross_attention_is_refused_unless_it_names_other_layers():
    """--no-cross-attention with the default --topk-attn-layers encoder-decoder once converted nothing: a plain
    softmax model trained in silence (lstm_topk_attn without attention is refused likewise)."""
    from softtopk_fairseq.models.topk_attention import TopkMultiheadAttention

    d = dictionary(12)
    with pytest.raises(ValueError, match=r"--topk-attn-layers encoder-decoder: the decoder has no encoder-decoder "
                                         r"attention \(--no-cross-attention\); name decoder-self or encoder-self"):
        build("transformer_topk_attn", d, no_cross_attention=True)
    model = build("transformer_topk_attn", d, no_cross_attention=True, topk_attn_layers="decoder-self")
    assert sum(isinstance(m, TopkMultiheadAttention) for m in model.modules()) == len(model.decoder.layers)


# --------------------------------------------------------------------- incremental == full forward ----

@pytest.mark.parametrize("arch,extra", [
    ("transformer_topk_attn", dict(topk_attn_layers="encoder-decoder,decoder-self,encoder-self", topk_attn_k=2)),
    ("lstm_topk_attn", dict(topk_attn_k=2)),
    ("rnnsearch_topk_attn", dict(topk_attn_k=2)),
])
@pytest.mark.parametrize("mode", ["soft_topk", "hard_topk"])
def test_incremental_decoding_equals_full_forward(arch, extra, mode):
    d = dictionary(12)
    model = build(arch, d, topk_attn_mode=mode, **extra).eval()
    sample = batch(d)
    ni = sample["net_input"]
    with torch.no_grad():
        full, _ = model(**ni)
        enc = model.encoder(ni["src_tokens"], src_lengths=ni["src_lengths"])
        state = {}
        steps = [model.decoder(ni["prev_output_tokens"][:, : t + 1], encoder_out=enc, incremental_state=state)[0]
                 for t in range(ni["prev_output_tokens"].size(1))]
    real = ni["prev_output_tokens"].ne(d.pad())  # padded positions are garbage in fairseq either way
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], rtol=1e-9, atol=1e-9)
    modes = {m.topk_mode for m in model.modules() if hasattr(m, "topk_mode")}
    assert modes == {mode}


# ------------------------------------------------------------------------------- the flags -------------

@pytest.mark.parametrize("arch", ["transformer_topk_attn", "lstm_topk_attn", "rnnsearch_topk_attn"])
def test_flags_come_from_the_config_and_absent_ones_get_its_defaults(arch):
    """The flags are generated from TopkAttentionConfig (help and default written once): parsing sets what is
    given, the architecture fills the rest from the config's fields -- also for saved arguments that predate a
    flag -- and a bad choice is refused by the parser."""
    import argparse
    from dataclasses import fields

    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
    from softtopk_fairseq.models.topk_attention import TopkAttentionConfig, TransformerTopkAttentionConfig

    config = TransformerTopkAttentionConfig if arch.startswith("transformer") else TopkAttentionConfig
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)  # as fairseq's model-flag group
    ARCH_MODEL_REGISTRY[arch].add_args(parser)
    args = parser.parse_args(["--topk-attn-k", "3", "--topk-attn-mode", "hard_topk"])
    given = {name: value for name, value in vars(args).items() if name.startswith("topk_attn")}
    assert given == {"topk_attn_k": 3, "topk_attn_mode": "hard_topk"}  # no parser defaults: the arch sets them
    ARCH_CONFIG_REGISTRY[arch](args)
    want = {f.name: f.default for f in fields(config) if not f.name.startswith("_")}  # _name: fairseq's, no flag
    assert not hasattr(args, "_name")
    assert {name: getattr(args, name) for name in want} == {**want, "topk_attn_k": 3, "topk_attn_mode": "hard_topk"}
    assert (arch == "transformer_topk_attn") == hasattr(args, "topk_attn_layers")
    with pytest.raises(SystemExit):
        parser.parse_args(["--topk-attn-inference", "bogus"])
    saved = argparse.Namespace(topk_attn_k=2, topk_attn_epsilon=0.5, topk_attn_mode="soft_topk", topk_attn_inference="same")
    ARCH_CONFIG_REGISTRY[arch](saved)  # an older checkpoint's arguments, without --topk-attn-samples
    assert saved.topk_attn_samples == TopkAttentionConfig.topk_attn_samples and saved.topk_attn_epsilon == 0.5
