"""Golden cases: outputs and gradients of the operators, the soft beam-search criterion and the top-k attention,
computed the same way by ``record.py`` (which saved them, in ``golden.pt``, with the code as it was before a
refactoring) and by ``tests/test_golden.py`` (which recomputes them with the code as it is): behaviour unchanged,
proven value by value.

Every case is a function returning ``{name: tensor}``; :data:`CASES` lists them. Inputs are seeded; the
perturbed top-k draws its noise from a seeded generator (the operator) or from torch's seeded default generator
(the criterion and the attention). Run under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it) so that the
Triton kernels run on CPU tensors.
"""
from typing import Callable, Dict

import torch

Tensor = torch.Tensor
Case = Callable[[], Dict[str, Tensor]]

BACKENDS = ("torch", "cpu", "triton")


def backends_here():
    """BACKENDS but the Triton one where its triton is too old (the lowest supported torch pins one): its recorded
    values are then not compared (test_golden.py)."""
    from softtopk_fairseq.ops import backends

    return tuple(b for b in BACKENDS if b != "triton" or backends.TRITON.usable() is None)

# torch's CPU reductions split their work by the thread count, and the split changes the last bits: every case
# is computed with this many threads (the count golden.pt was recorded with), whatever the machine or an earlier
# test set.
THREADS = 2


def computed(case: Case) -> Dict[str, Tensor]:
    """``case()`` with :data:`THREADS` threads, the caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return case()
    finally:
        torch.set_num_threads(before)


def portable_parameters(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every parameter drawn anew, uniform in +-3 / sqrt(fan-in) (the tiny models' sharpened scale),
    from a seeded generator in float64: the same bits on every CPU. (torch's normal_, which fairseq's
    initialisations use, fills float32 tensors with vector code whose last bits depend on the CPU's vector
    width.)"""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            bound = 3.0 / (p.shape[-1] if p.dim() > 1 else 8) ** 0.5
            p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound)
    return model


def _scores(seed: int, shape, dtype=torch.float32, scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _value_and_grad(fn, x: Tensor, seed: int) -> Dict[str, Tensor]:
    """``fn(x)`` and d<fn(x), G>/dx for a fixed random G (the output's shape)."""
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    if not out.requires_grad:  # a constant of x (e.g. the temperature without scaling)
        return {"out": out.detach()}
    g = _scores(seed + 1000, out.shape, out.dtype)
    (grad,) = torch.autograd.grad((out * g).sum(), x)
    return {"out": out.detach(), "grad": grad}


def _named(prefix: str, results: Dict[str, Tensor]) -> Dict[str, Tensor]:
    return {f"{prefix}.{name}": value for name, value in results.items()}


# ------------------------------------------------------------------------------------------- the operator ----

def soft_topk_cases() -> Dict[str, Tensor]:
    """soft_topk on every backend: unsorted and sorted, both scalings, a mask, largest=False, -inf entries."""
    from softtopk_fairseq.ops import soft_topk

    found = {}
    x = _scores(1, (6, 23), scale=2.0)
    x[1, 3] = -torch.inf  # an excluded entry
    mask = _scores(2, (6, 23)) > -0.8
    mask[2, :] = False
    mask[2, :2] = True  # a row with fewer valid entries than k (unsorted: all 1)
    for backend in backends_here():
        for sorted in (False, True):
            for scaling in ("none", "paper"):
                k = 3 if sorted else 5
                for name, kwargs in (("plain", {}), ("mask", {"mask": mask}), ("smallest", {"largest": False})):
                    xx = x if name != "smallest" else torch.where(x == -torch.inf, torch.inf, x)

                    infos = []

                    def fn(s, kwargs=kwargs):
                        out, info = soft_topk(s, k, epsilon=0.3, sorted=sorted, scaling=scaling, backend=backend,
                                              return_info=True, **kwargs)
                        infos.append(info)
                        return out

                    key = f"soft_topk.{backend}.{'sorted' if sorted else 'unsorted'}.{scaling}.{name}"
                    found.update(_named(key, _value_and_grad(fn, xx, 3)))
                    found[key + ".iterations"] = infos[0].iterations.float()
                    found[key + ".temperature"] = infos[0].temperature.detach()
    # float64 on the PyTorch path, Sinkhorn, and another dim
    x64 = _scores(4, (3, 4, 11), dtype=torch.float64)
    for method in ("newton", "sinkhorn"):
        for sorted in (False, True):
            def fn(s, method=method, sorted=sorted):
                return soft_topk(s, 2, dim=1, epsilon=0.5, sorted=sorted, method=method, scaling="paper")

            found.update(_named(f"soft_topk.float64.{method}.{sorted}", _value_and_grad(fn, x64, 5)))
    return found


def unchecked_cases() -> Dict[str, Tensor]:
    """soft_topk(check_errors=False): a NaN row comes out NaN, the others as if alone."""
    from softtopk_fairseq.ops import soft_topk

    found = {}
    x = _scores(6, (4, 17))
    x[2, 5] = torch.nan
    for backend in backends_here():
        for sorted in (False, True):
            out = soft_topk(x, 3, sorted=sorted, epsilon=0.2, scaling="paper", backend=backend, check_errors=False)
            found[f"unchecked.{backend}.{sorted}"] = out
    return found


def relaxation_op_cases() -> Dict[str, Tensor]:
    """softmax_k_times, perturbed_topk (seeded), effective_epsilon and divide_by_temperature."""
    from softtopk_fairseq.ops import divide_by_temperature, effective_epsilon, perturbed_topk, softmax_k_times

    found = {}
    x = _scores(7, (5, 19), scale=3.0)
    x[0, 4] = -torch.inf
    for scaling in ("none", "paper"):
        found.update(_named(f"softmax_k_times.{scaling}", _value_and_grad(
            lambda s: softmax_k_times(s, 4, epsilon=0.4, scaling=scaling), x, 8)))
        found.update(_named(f"effective_epsilon.{scaling}", _value_and_grad(
            lambda s: effective_epsilon(s, 4, epsilon=0.4, sorted=True, scaling=scaling), x, 9)))
    for sorted in (False, True):
        def fn(s, sorted=sorted):
            return perturbed_topk(s, 4, sigma=0.5, samples=32, sorted=sorted,
                                  generator=torch.Generator().manual_seed(11))

        found.update(_named(f"perturbed_topk.{sorted}", _value_and_grad(fn, x, 10)))
    t = _scores(12, (5,)).abs() + 0.5
    xt = x.detach().clone().requires_grad_(True)
    tt = t.clone().requires_grad_(True)
    out = divide_by_temperature(xt, tt)
    g = _scores(13, out.shape)
    gx, gt = torch.autograd.grad((torch.where(torch.isfinite(out), out, 0.0) * g).sum(), (xt, tt))
    found.update({"divide_by_temperature.out": out.detach(), "divide_by_temperature.grad_x": gx,
                  "divide_by_temperature.grad_t": gt})
    return found


# -------------------------------------------------------------------------------------------- the search ----

# The criterion's model parameters (portable_parameters): chosen so that no discrete choice of the search (a beam's
# predecessor, the candidates kept) sits on a near-tie that another CPU's rounding flips (tests/golden/spread.py
# measured every seed tried).
CRITERION_MODEL_SEED = 0


def criterion_cases() -> Dict[str, Tensor]:
    """One soft beam-search update (the criterion's loss, then every parameter's gradient) for the LSTM, the
    transformer and RNNsearch with each relaxation; the OT relaxation also in float32 (the C kernels) and pruned."""
    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion
    from tiny_models import ARCHS, TinyTask, batch, build, dictionary

    found = {}
    d = dictionary()
    settings = {
        "ot": dict(soft_beam_relaxation="soft_topk"),
        "softmax_k_times": dict(soft_beam_relaxation="softmax_k_times"),
        "perturbed": dict(soft_beam_relaxation="perturbed", soft_beam_epsilon=0.3, soft_beam_samples=8),
        "ot_nats_topk": dict(soft_beam_relaxation="soft_topk", soft_beam_scaling="none", soft_beam_epsilon=1.0,
                             soft_beam_bookkeeping="topk"),
        "ot_pruned": dict(soft_beam_relaxation="soft_topk", soft_beam_candidates=7),
    }
    for arch in ARCHS:
        for name, options in settings.items():
            for dtype in (torch.float64, torch.float32):
                if dtype == torch.float32 and not name.startswith("ot"):
                    continue
                model = portable_parameters(build(arch, d, dtype=dtype), CRITERION_MODEL_SEED)
                model.train()
                sample = batch(d)
                cfg = SoftBeamSearchConfig(sentence_avg=False, label_smoothing=0.1, teacher_forcing_ratio=0.5,
                                           soft_beam_size=3, **options)
                criterion = SoftBeamSearchCriterion(TinyTask(d), cfg)
                torch.manual_seed(21)
                loss, _, logs = criterion(model, sample)
                loss.backward()
                key = f"criterion.{arch}.{name}.{str(dtype).removeprefix('torch.')}"
                found[key + ".loss"] = loss.detach()
                found[key + ".soft_loss"] = torch.as_tensor(float(logs["soft_loss"]))
                for pname, p in model.named_parameters():
                    if p.grad is not None:
                        found[f"{key}.grad.{pname}"] = p.grad
    return found


# ------------------------------------------------------------------------------------------ the attention ----

# The attention modes: the golden file's label of each (the names of version 0.1) -> its name now.
MODES = {"softmax": "softmax", "soft": "soft_topk", "hard": "hard_topk", "perturbed": "perturbed"}


def attention_cases() -> Dict[str, Tensor]:
    """topk_attention_weights in every mode (forward, backward), and a transformer_topk_attn layer's forward and
    backward in every mode."""
    from softtopk_fairseq.modules.topk_attention import topk_attention_weights

    found = {}
    s = _scores(14, (2, 3, 9), scale=2.0)
    s[0, 1, 6:] = -torch.inf  # padding
    s[1, 2, :] = -torch.inf   # a fully masked query
    for label, mode in MODES.items():
        torch.manual_seed(15)
        found.update(_named(f"attention_weights.{label}", _value_and_grad(
            lambda x: topk_attention_weights(x, 3, mode=mode, epsilon=0.2, samples=8), s, 16)))
    found.update(_layer_cases())
    return found


def _layer_cases() -> Dict[str, Tensor]:
    import argparse

    import softtopk_fairseq.fairseq_plugin  # noqa: F401
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
    from tiny_models import TinyTask, batch, dictionary

    found = {}
    d = dictionary()
    sample = batch(d)
    for label, mode in MODES.items():
        torch.manual_seed(17)
        args = argparse.Namespace(arch="transformer_topk_attn", dropout=0.0, max_source_positions=64,
                                  max_target_positions=64, encoder_embed_dim=8, decoder_embed_dim=8,
                                  encoder_layers=1, decoder_layers=1, encoder_ffn_embed_dim=16,
                                  decoder_ffn_embed_dim=16, encoder_attention_heads=2, decoder_attention_heads=2,
                                  topk_attn_k=2, topk_attn_mode=mode, topk_attn_epsilon=0.2, topk_attn_samples=8)
        ARCH_CONFIG_REGISTRY["transformer_topk_attn"](args)
        model = portable_parameters(ARCH_MODEL_REGISTRY["transformer_topk_attn"].build_model(args, TinyTask(d)),
                                    17).double()
        model.train()
        torch.manual_seed(18)
        out, extra = model(**sample["net_input"])
        out.sum().backward()
        found[f"attention_layer.{label}.out"] = out.detach()
        found[f"attention_layer.{label}.attn"] = extra["attn"][0].detach()
        for pname, p in model.named_parameters():
            if p.grad is not None and "encoder_attn" in pname:
                found[f"attention_layer.{label}.grad.{pname}"] = p.grad
    return found


CASES: Dict[str, Case] = {
    "soft_topk": soft_topk_cases,
    "unchecked": unchecked_cases,
    "relaxation_ops": relaxation_op_cases,
    "criterion": criterion_cases,
    "attention": attention_cases,
}
