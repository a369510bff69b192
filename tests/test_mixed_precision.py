"""Mixed precision through the soft_beam_search criterion and the top-k attention archs: a few training
updates under each regime fairseq offers, with every loss and gradient finite. On CPU what torch allows
there: bf16 autocast of the forward, and a model cast to bf16 (what fairseq's --bf16 does); on CUDA also
float16 (autocast, fairseq's --amp; and a model cast to float16, --fp16). The operator computes in float32
inside either way (soft_topk upcasts half-precision scores)."""
import pytest
import torch

from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion
from tiny_models import TinyTask, batch, build, dictionary

REGIMES = [("cpu", "autocast_bf16"), ("cpu", "bf16_model")]
if torch.cuda.is_available():
    REGIMES += [("cuda", r) for r in ("autocast_bf16", "bf16_model", "autocast_fp16", "fp16_model")]


def _prepare(model, sample, device, regime):
    model = model.to(device)
    if regime.endswith("_model"):
        model = model.to(torch.bfloat16 if regime.startswith("bf16") else torch.float16)
    sample = {k: ({kk: vv.to(device) for kk, vv in v.items()} if isinstance(v, dict)
                  else v.to(device) if torch.is_tensor(v) else v) for k, v in sample.items()}
    return model, sample


def _autocast(device, regime):
    if not regime.startswith("autocast"):
        return torch.autocast(device, enabled=False)
    return torch.autocast(device, dtype=torch.bfloat16 if "bf16" in regime else torch.float16)


def _train_updates(model, criterion, sample, device, regime, updates=3):
    """Forward, backward, Adam step ``updates`` times; every loss and gradient must be finite, and the
    parameters must move."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    before = [p.detach().clone() for p in model.parameters()]
    logs = []
    for _ in range(updates):
        optimizer.zero_grad()
        with _autocast(device, regime):
            loss, _, log = criterion(model, sample)
        assert torch.isfinite(loss).all(), (regime, loss)
        loss.float().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(bool(torch.isfinite(g).all()) for g in grads), regime
        optimizer.step()
        logs.append(log)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    return logs


@pytest.mark.parametrize("device,regime", REGIMES)
@pytest.mark.parametrize("arch", ["lstm", "transformer", "rnnsearch"])
@pytest.mark.parametrize("tf_pass", ["auto", "search"])  # auto: separate on CPU, search on CUDA
def test_soft_beam_search_trains_in_mixed_precision(device, regime, arch, tf_pass):
    d = dictionary(12)
    model, sample = _prepare(build(arch, d, dtype=torch.float32, dropout=0.1), batch(d), device, regime)
    criterion = SoftBeamSearchCriterion(TinyTask(d), SoftBeamSearchConfig(
        sentence_avg=False, label_smoothing=0.1, teacher_forcing_ratio=0.5, soft_beam_size=3, soft_beam_candidates=8,
        teacher_forcing_pass=tf_pass))
    logs = _train_updates(model, criterion, sample, device, regime)
    for log in logs:
        for key in ("tf_loss", "soft_loss"):
            assert torch.isfinite(torch.as_tensor(log[key], dtype=torch.float32)), (key, log)
        assert log["soft_topk_err_max"] < 1e-3  # the OT solve itself ran in float32 and converged


@pytest.mark.parametrize("device,regime", REGIMES)
@pytest.mark.parametrize("arch", ["transformer_topk_attn", "lstm_topk_attn"])
@pytest.mark.parametrize("mode", ["soft_topk", "hard_topk"])
def test_topk_attention_trains_in_mixed_precision(device, regime, arch, mode):
    d = dictionary(12)
    extra = dict(topk_attn_k=2, topk_attn_mode=mode)
    if arch.startswith("transformer"):
        extra["topk_attn_layers"] = "encoder-decoder,decoder-self"
    model, sample = _prepare(build(arch, d, dtype=torch.float32, dropout=0.1, **extra), batch(d), device, regime)
    _train_updates(model, LabelSmoothedCrossEntropyCriterion(TinyTask(d), False, 0.1), sample, device, regime)


def _overflow_in_forward(projection):
    """Make the forward overflow as float16 can: +inf in a projection's bias (the scores it feeds come out
    +-inf or NaN)."""
    with torch.no_grad():
        projection.bias.fill_(torch.inf)


@pytest.mark.parametrize("setup", ["soft_beam_search-soft_topk", "soft_beam_search-perturbed",
                                   "transformer_topk_attn-soft_topk",
                                   "transformer_topk_attn-perturbed"])
def test_a_forward_overflow_is_a_batch_fairseqs_loss_scaler_skips(setup):
    """A forward that overflows (float16's range is small) gives a non-finite gradient norm, which fairseq's
    DynamicLossScaler (--fp16) turns into OverflowError -- the trainer skips the batch and lowers the scale --
    as it does for its own criteria and attention; not the operator's ValueError, which would end the run."""
    from fairseq.optim.dynamic_loss_scaler import DynamicLossScaler

    d = dictionary(12)
    name, method = setup.split("-")
    if name == "soft_beam_search":
        model = build("lstm", d, dtype=torch.float32)
        criterion = SoftBeamSearchCriterion(TinyTask(d), SoftBeamSearchConfig(
            sentence_avg=False, teacher_forcing_ratio=0.5, soft_beam_size=3, soft_beam_candidates=8,
            soft_beam_relaxation=method, soft_beam_samples=4))
        _overflow_in_forward(model.decoder.fc_out)
    else:
        model = build(name, d, dtype=torch.float32, topk_attn_k=2, topk_attn_mode=method,
                      topk_attn_layers="encoder-decoder")
        criterion = LabelSmoothedCrossEntropyCriterion(TinyTask(d), False, 0.1)
        _overflow_in_forward(model.decoder.layers[0].encoder_attn.q_proj)
    loss, _, _ = criterion(model, batch(d))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.0)
    assert not bool(torch.isfinite(grad_norm))
    scaler = DynamicLossScaler(init_scale=128.0)
    with pytest.raises(OverflowError):
        scaler.check_overflow(grad_norm)
    assert scaler.loss_scale == 64.0
