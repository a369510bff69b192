"""Time per update and peak memory of ``soft_beam_search`` against ``label_smoothed_cross_entropy``.

Same model, same batch (Multi30k-sized by default: 128 sentences, source 14 / target 16 tokens, an 8k joint
vocabulary as in the README's sentencepiece run), the pipeline's demo-size LSTM and transformer. One update =
criterion forward + backward + Adam step. Each configuration runs in its own process, so the peak resident
memory it reports (``ru_maxrss``) is that configuration's own; the ratios are taken within one run -- on a GPU
within the configuration's process, against teacher-forcing updates timed alternately with its own.

    .venv/bin/python benchmarks/bench_soft_beam.py                  # CPU, the figures in docs/results.md
    .venv/bin/python benchmarks/bench_soft_beam.py --device cuda    # on a GPU (peak = max_memory_allocated)
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from softtopk_fairseq.modules.soft_beam_search import PERTURBED_SAMPLES, RELAXATIONS

ARCHS = {
    "lstm": dict(arch="lstm", encoder_embed_dim=128, decoder_embed_dim=128, encoder_hidden_size=256,
                 decoder_hidden_size=256, decoder_out_embed_dim=128, encoder_bidirectional=True,
                 share_decoder_input_output_embed=True, dropout=0.1),
    "transformer": dict(arch="transformer", share_all_embeddings=True, encoder_layers=2, decoder_layers=2,
                        encoder_embed_dim=128, decoder_embed_dim=128, encoder_ffn_embed_dim=256,
                        decoder_ffn_embed_dim=256, encoder_attention_heads=4, decoder_attention_heads=4,
                        dropout=0.1),
}


def build_model_and_sample(cfg, extra_args=None):
    """The demo-size model of ``cfg['arch']`` (``extra_args`` override its arguments) on an 8k dictionary, and a
    random Multi30k-sized batch; returns (model, task, sample, device)."""
    import torch

    torch.set_num_threads(cfg["threads"])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def update_criterion(name, task):
    """The criterion of an update kind the GPU benchmarks compare: ``"teacher forcing"`` is
    label_smoothed_cross_entropy (0.1); any other name the ``sum`` update -- soft_beam_search, rho 0.8, M 50,
    paper scaling, teacher forcing in the search --, with ``--soft-beam-cuda-graphs`` when the name ends in
    "graphs"."""
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion

    if name == "teacher forcing":
        return LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    return SoftBeamSearchCriterion(task, SoftBeamSearchConfig(
        sentence_avg=False, label_smoothing=0.1, teacher_forcing_ratio=0.8, soft_beam_candidates=50,
        soft_topk_scaling="paper", teacher_forcing_pass="search", soft_beam_cuda_graphs=name.endswith("graphs")))


def one_update(model, criterion, sample, optimizer, device):
    """Forward + backward + optimizer step, finished on the device; returns the logging output."""
    import torch

    optimizer.zero_grad()
    loss, _, log = criterion(model, sample)
    loss.backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return log


def timed_update(model, criterion, sample, optimizer, device):
    """Seconds of one update (:func:`one_update`, the device idle before it) and its logging output."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    log = one_update(model, criterion, sample, optimizer, device)
    return time.perf_counter() - start, log


def time_updates(model, criterion, sample, device, repeats, warmup, baseline=None):
    """Median seconds of ``repeats`` updates (forward + backward + Adam step, after ``warmup`` untimed ones), the
    last logging output, the peak memory in MiB (CUDA: max allocated; CPU: this process's max RSS) and, given
    ``baseline`` (a function that builds another (model, criterion) for ``sample``), the median seconds of that
    one's updates, timed alternately with these (else None). The peak is then read after the warm-up, before
    the baseline's model exists."""
    import torch

    def timed(model, criterion, optimizer):
        return timed_update(model, criterion, sample, optimizer, device)

    def peak_mib():
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    log, peak, base = {}, None, None
    for _ in range(warmup if baseline is None else max(warmup, 1)):  # allocators, caches, a GPU's clocks
        _, log = timed(model, criterion, optimizer)
    if baseline is not None:
        peak = peak_mib()
        base_model, base_criterion = baseline()
        base_optimizer = torch.optim.Adam(base_model.parameters(), lr=1e-4)
        for _ in range(warmup):
            timed(base_model, base_criterion, base_optimizer)
        base = []
    times = []
    for _ in range(repeats):
        if base is not None:
            base.append(timed(base_model, base_criterion, base_optimizer)[0])
        seconds, log = timed(model, criterion, optimizer)
        times.append(seconds)
    return (statistics.median(times), log, peak_mib() if peak is None else peak,
            None if base is None else statistics.median(base))


def child(cfg):
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion

    model, task, sample, device = build_model_and_sample(cfg)
    if cfg["criterion"] == "tf":
        criterion = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    else:
        criterion = SoftBeamSearchCriterion(task, SoftBeamSearchConfig(
            sentence_avg=False, label_smoothing=0.1, teacher_forcing_ratio=cfg["rho"], soft_beam_size=cfg["beam"],
            soft_beam_candidates=cfg["candidates"], soft_topk_method=cfg["method"], soft_topk_scaling=cfg["scaling"],
            perturbed_samples=cfg["samples"], teacher_forcing_pass=cfg["tf_pass"]))

    def teacher_forcing():  # the baseline: the same model built again (same seed), teacher forcing's criterion
        tf_model, tf_task, _, _ = build_model_and_sample(cfg)
        return tf_model, LabelSmoothedCrossEntropyCriterion(tf_task, False, 0.1)

    # On a GPU the ratio to teacher forcing is taken in this process, alternately (see main()).
    interleave = cfg["criterion"] != "tf" and device.type == "cuda"
    seconds, log, peak, tf_seconds = time_updates(model, criterion, sample, device, cfg["repeats"],
                                                  warmup_updates(cfg), teacher_forcing if interleave else None)
    print(json.dumps({"seconds": seconds, "peak_mib": peak, "tf_seconds": tf_seconds,
                      "pruned_mass": float(log.get("pruned_mass", 0)) / max(log.get("soft_sentence_steps", 1), 1),
                      "iters": float(log.get("soft_topk_iters", 0)) / max(log.get("soft_topk_steps", 1), 1)}))


BATCH_KEYS = ("bsz", "src_len", "tgt_len", "vocab", "repeats", "warmup", "threads", "device")


def warmup_updates(cfg) -> int:
    """Untimed updates before the timed ones: ``--warmup``, else 1 on CPU and 5 on a GPU (after one warm-up,
    teacher forcing took 0.026 and 0.025 s/update on an H200 as the first configuration of a run, 0.018 s after
    other GPU work had run: what ran on the device and the host just before shows in a short timing)."""
    if cfg.get("warmup") is not None:
        return cfg["warmup"]
    return 5 if cfg["device"].startswith("cuda") else 1


def add_batch_arguments(p, repeats):
    """The batch, vocabulary and timing options shared by the training-step benchmarks."""
    p.add_argument("--bsz", type=int, default=128, help="sentences per batch")
    p.add_argument("--src-len", type=int, default=14)
    p.add_argument("--tgt-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=repeats, help="timed updates (median) after the warm-up")
    p.add_argument("--warmup", type=int, default=None, help="untimed updates first (default: 1 on CPU, 5 on a GPU)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--child", help=argparse.SUPPRESS)


def batch_config(a):
    return {key: getattr(a, key) for key in BATCH_KEYS}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", nargs="+", default=["lstm", "transformer"], choices=sorted(ARCHS))
    p.add_argument("--candidates", nargs="+", type=int, default=[500, 50],
                   help="--soft-beam-candidates values to run (0 = all k*V, exact)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--rho", type=float, default=0.8)
    p.add_argument("--methods", nargs="+", default=["ot"], choices=list(RELAXATIONS),
                   help="--soft-topk-method values to run (each at the criterion's default temperature / sigma)")
    p.add_argument("--perturbed-samples", type=int, default=PERTURBED_SAMPLES)
    p.add_argument("--scaling", default="paper", choices=["paper", "none"], help="--soft-topk-scaling")
    p.add_argument("--teacher-forcing-passes", nargs="+", default=["search", "separate"],
                   choices=["search", "separate"], help="--teacher-forcing-pass values of the sum-mode rows")
    add_batch_arguments(p, repeats=3)
    a = p.parse_args()
    if a.child:
        return child(json.loads(a.child))
    base = dict(batch_config(a), beam=a.beam, rho=a.rho, scaling=a.scaling, samples=a.perturbed_samples,
                tf_pass=a.teacher_forcing_passes[0])

    def measure(**cfg):
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps({**base, **cfg})],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    print(f"batch {a.bsz} x (src {a.src_len}, tgt {a.tgt_len}), vocab {a.vocab}, beam {a.beam}, rho {a.rho}, "
          f"scaling {a.scaling}, perturbed samples {a.perturbed_samples}, {a.threads} threads, {a.device}, "
          f"median of {a.repeats} updates after {warmup_updates(batch_config(a))} untimed")
    if a.device.startswith("cuda"):
        # Baselines from separate processes moved 0.018-0.026 s/update between two runs on one H200 (a 1.4x
        # swing of every ratio); updates timed alternately in one process share the host's and the GPU's state.
        print("x teacher forcing on a GPU: against teacher-forcing updates of the same model, timed alternately "
              "with the row's own in its process (the teacher-forcing row: its own process)")
    print("| arch | criterion | method | candidates M | s / update | x teacher forcing | peak MiB | x TF peak | "
          "pruned-mass bound / step | solver iters |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arch in a.archs:
        tf = measure(arch=arch, criterion="tf", candidates=0, method="ot")
        print(f"| {arch} | label_smoothed_cross_entropy | - | - | {tf['seconds']:.3f} | 1.00 | {tf['peak_mib']:.0f} "
              f"| 1.00 | - | - |", flush=True)
        for method, m in ((method, m) for method in a.methods for m in a.candidates):
            label = "all (exact)" if m <= 0 else str(m)
            rows = [(f"soft_beam_search, rho {a.rho}, sum, teacher forcing {tf_pass}",
                     measure(arch=arch, criterion="soft", candidates=m, method=method, tf_pass=tf_pass))
                    for tf_pass in a.teacher_forcing_passes]
            if 0 < a.rho < 1:
                only = measure(arch=arch, criterion="soft", candidates=m, rho=0.0, method=method)
                rows.append(("soft_beam_search, rho 0 (L_SOFT only)", only))
                # --teacher-forcing-mode sample: one of the two losses per batch, so its expected update time
                # is the rho-weighted mean of the two measured times.
                t_tf = only["tf_seconds"] or tf["seconds"]
                rows.append((f"soft_beam_search, rho {a.rho}, sample (expected: rho t_TF + (1-rho) t_SOFT)",
                             dict(only, seconds=a.rho * t_tf + (1 - a.rho) * only["seconds"],
                                  peak_mib=max(tf["peak_mib"], only["peak_mib"]))))
            for name, r in rows:
                ratio = r["seconds"] / (r["tf_seconds"] or tf["seconds"])
                print(f"| {arch} | {name} | {method} | {label} | {r['seconds']:.3f} | {ratio:.2f} "
                      f"| {r['peak_mib']:.0f} | {r['peak_mib'] / tf['peak_mib']:.2f} | {r['pruned_mass']:.2e} "
                      f"| {r['iters']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
