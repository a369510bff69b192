"""The short Multi30k en-fr study: the WMT14 recipe's own scripts on 29k pairs of real text, at CPU scale (short
runs; the converged study is ``experiments/multi30k_converged/driver.py``).

    python experiments/multi30k_short/driver.py run    --data ../shared/data/multi30k_en_fr --workdir work/study
    python experiments/multi30k_short/driver.py report --workdir work/study            # markdown tables
    python experiments/multi30k_short/driver.py plot   --workdir work/study --out docs/figures

``run`` prepares the data with ``examples/wmt14_en_fr/prepare.py`` (sentencepiece, 8k), pre-trains one
teacher-forcing RNNsearch with ``train.sh``, then fine-tunes it for ``--finetune-updates`` updates per
run and seed with ``finetune_soft_beam.sh`` (continued teacher forcing = rho 1; soft beam search with the
paper's settings; the softmax-k-times relaxation; a small epsilon / rho / beam / pruning / iterations sweep
scored on ``val`` only; then the sweep's best setting on ``val`` with every seed, scored on test too), and
scores every checkpoint with ``evaluate.sh`` (beam 5, sacrebleu) on val and test_2016_flickr. The
attention rows train a small transformer from scratch with softmax, SOFT top-k and hard top-k
encoder-decoder attention. CPU-sized changes to the recipe (smaller model, Adam at a constant rate,
fewer updates) are passed as extra arguments, which the scripts put last. Results accumulate in
``WORKDIR/results.jsonl``; a run already there is skipped, so ``run`` resumes after an interruption.
"""
import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(HERE))  # experiments/: the ledger
from ledger import append_row, mean_std, rows_by_key  # noqa: E402
from softtopk_fairseq.pipeline.run import quiet_warnings_env, run_logged  # noqa: E402

RECIPE = os.path.join(REPO_ROOT, "examples", "wmt14_en_fr")

# CPU scale: the rnnsearch default size (256-unit GRUs), Adam at a constant rate (the recipe's manual
# schedule with one entry), batches of at most 4096 tokens.
COMMON = ["--cpu", "--max-tokens", "4096", "--batch-size", "256", "--num-workers", "0",
          "--save-interval-updates", "0", "--log-interval", "10", "--optimizer", "adam",
          "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0"]
PRETRAIN = ["--arch", "rnnsearch", "--lr", "0.001", "--update2lr", "{'1': 0.001}"]
FINETUNE = ["--arch", "rnnsearch", "--lr", "0.0001"]
TF_RUN = ["--teacher-forcing-ratio", "1.0"]  # the criterion at rho = 1 is label_smoothed_cross_entropy exactly
PAPER = ["--teacher-forcing-ratio", "0.8", "--soft-beam-size", "5", "--soft-beam-epsilon", "0.1",
         "--soft-beam-scaling", "paper", "--soft-beam-candidates", "50"]
# The criterion's epsilon flag, and its name in the rows recorded before it was renamed (their ``extra``).
EPSILON_FLAGS = ("--soft-beam-epsilon", "--soft-topk-epsilon")


# Run name -> extra arguments of finetune_soft_beam.sh (after the recipe's defaults), one run per seed.
FINETUNE_RUNS = {"tf": TF_RUN, "soft_beam": PAPER,
                 # Temperature 0.1 nats (measured before the scaling applied to softmax_k_times) ...
                 "softmax_k_times": PAPER + ["--soft-beam-relaxation", "softmax_k_times", "--soft-beam-scaling",
                                             "none"],
                 # ... and the same temperature as the OT operator's at eps 0.1 with the paper's scaling.
                 "softmax_k_times_paper_scaling": PAPER + ["--soft-beam-relaxation", "softmax_k_times"]}


def sweep_runs(args) -> Dict[str, List[str]]:
    runs = {}
    for eps in args.sweep_epsilon:
        runs[f"soft_beam_eps{eps:g}"] = PAPER + ["--soft-beam-epsilon", f"{eps:g}"]
    for rho in args.sweep_rho:
        runs[f"soft_beam_rho{rho:g}"] = PAPER + ["--teacher-forcing-ratio", f"{rho:g}"]
    for beam in args.sweep_beam:
        runs[f"soft_beam_beam{beam}"] = PAPER + ["--soft-beam-size", str(beam)]
    for m in args.sweep_candidates:
        runs[f"soft_beam_M{m}"] = PAPER + ["--soft-beam-candidates", str(m)]
    for it in args.sweep_max_iter:
        runs[f"soft_beam_iter{it}"] = PAPER + ["--soft-topk-max-iter", str(it)]
    if args.sweep_bookkeeping:
        # k distinct beams: with the paper's scaling, argmax bookkeeping makes every beam the same (docs/results/temperature.md).
        runs["soft_beam_topk_bookkeeping"] = PAPER + ["--soft-beam-bookkeeping", "topk"]
    return runs


def best_sweep_run(results: Dict[str, dict], names: List[str], seed: int):
    """The sweep run with the highest val BLEU at ``seed``, if it beats the paper's setting there; else None.

    Chosen on val only, so the test score of the confirmed run is not selected on test."""
    val = {name: results[f"{name}.seed{seed}"]["bleu"]["valid"] for name in names if f"{name}.seed{seed}" in results}
    if not val:
        return None
    best = max(val, key=val.get)
    paper = results.get(f"soft_beam.seed{seed}")
    return best if paper is None or val[best] > paper["bleu"]["valid"] else None


ATTENTION = {
    "softmax": ["--topk-attn-mode", "softmax"],
    "soft_topk": ["--topk-attn-mode", "soft_topk"],
    "hard_topk": ["--topk-attn-mode", "hard_topk"],
}
TRANSFORMER = ["--arch", "transformer_topk_attn", "--share-all-embeddings", "--encoder-layers", "2",
               "--decoder-layers", "2", "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
               "--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256",
               "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0.1",
               "--topk-attn-k", "4", "--topk-attn-epsilon", "0.1", "--topk-attn-inference", "same",
               "--lr", "0.001", "--update2lr", "{'1': 0.001}"]


def sh(cmd: List[str], log: str, env_extra=None) -> str:
    """Run ``cmd`` with the pipeline's runner (output to stdout and ``log``; raises on failure), fairseq's own
    deprecation warnings filtered (``quiet_warnings_env``)."""
    env = dict(quiet_warnings_env(), PYTHON=sys.executable, **(env_extra or {}))
    return run_logged(cmd, log, env=env)


def load_results(workdir: str) -> Dict[str, dict]:
    """Recorded runs by key (the last row of each)."""
    return rows_by_key(os.path.join(workdir, "results.jsonl"))


def record(workdir: str, row: dict) -> None:
    append_row(os.path.join(workdir, "results.jsonl"), row)


def evaluate(data: str, ckpt: str, subsets: List[str]) -> Dict[str, float]:
    bleu = {}
    for subset in subsets:
        out = sh(["bash", os.path.join(RECIPE, "evaluate.sh"), data, ckpt],
                 os.path.join(os.path.dirname(ckpt), f"evaluate.{subset}.log"), {"SUBSET": subset, "BEAM": "5"})
        bleu[subset] = json.loads(out[out.index("{"):])["score"]
    return bleu


def train_and_score(args, key: str, group: str, script: str, positional: List[str], extra: List[str],
                    subsets: List[str], done: Dict[str, dict], **info) -> None:
    """``bash RECIPE/script DATA *positional SAVE_DIR *extra``, then score its last checkpoint; skip if done."""
    if key in done:
        print(f"{key}: done before, skipped", flush=True)
        return
    data = data_dir(args)
    save = os.path.join(args.workdir, "checkpoints", key)
    os.makedirs(save, exist_ok=True)
    start = time.time()
    sh(["bash", os.path.join(RECIPE, script), data, *positional, save, *extra], os.path.join(save, "train.log"))
    seconds = time.time() - start
    bleu = evaluate(data, os.path.join(save, "checkpoint_last.pt"), subsets)
    record(args.workdir, {"key": key, "group": group, "train_s": round(seconds, 1), "bleu": bleu, "extra": extra,
                          **info})


def data_dir(args) -> str:
    """The prepared data: WORKDIR/data, or another study's with ``--prepared`` (same BPE: comparable runs)."""
    return args.prepared or os.path.join(args.workdir, "data")


def run(args) -> None:
    os.makedirs(args.workdir, exist_ok=True)
    data = data_dir(args)
    d = args.data
    if not os.path.exists(os.path.join(data, "bin", "dict.fr.txt")):
        sh([sys.executable, os.path.join(RECIPE, "prepare.py"), "--dest", data, "--train", f"{d}/train",
            "--valid", f"{d}/val", "--test", f"{d}/test_2016_flickr", "--bpe", "sentencepiece", "--bpe-size", str(args.bpe_size),
            "--workers", "2"], os.path.join(args.workdir, "prepare.log"))
    done = load_results(args.workdir)
    both = ["valid", "test"]
    if "pretrain" in done and done["pretrain"].get("seed", 1) != args.pretrain_seed:
        sys.exit(f"{args.workdir} holds a model pre-trained with seed {done['pretrain'].get('seed', 1)}, not "
                 f"--pretrain-seed {args.pretrain_seed}: use another --workdir")
    if "pretrain" in args.stages:
        train_and_score(args, "pretrain", "pretrain", "train.sh", [],
                        COMMON + PRETRAIN + ["--max-update", str(args.pretrain_updates),
                                             "--seed", str(args.pretrain_seed)],
                        both, done, seed=args.pretrain_seed, updates=args.pretrain_updates)
    pretrained = os.path.join(args.workdir, "checkpoints", "pretrain", "checkpoint_last.pt")

    def finetune(key, group, extra, seed, subsets):
        train_and_score(args, key, group, "finetune_soft_beam.sh", [pretrained],
                        COMMON + FINETUNE + extra + ["--max-update", str(args.finetune_updates), "--seed", str(seed)],
                        subsets, done, seed=seed, updates=args.finetune_updates)

    if "finetune" in args.stages:
        for seed in args.seeds:
            for name in args.finetune_runs:
                extra = FINETUNE_RUNS[name]
                finetune(f"{name}.seed{seed}", name, extra, seed, both)
    if "sweep" in args.stages:
        for name, extra in sweep_runs(args).items():
            finetune(f"{name}.seed{args.seeds[0]}", name, extra, args.seeds[0], ["valid"])
    if "best" in args.stages:
        done = load_results(args.workdir)
        sweep = sweep_runs(args)
        name = best_sweep_run(done, list(sweep), args.seeds[0])
        print(f"best sweep run on val: {name or 'none beats the paper setting'}", flush=True)
        for seed in args.seeds if name else []:
            key = f"{name}.seed{seed}"
            if key in done and "test" not in done[key]["bleu"]:
                # Scored on val only as a sweep point: add its test score, same checkpoint.
                ckpt = os.path.join(args.workdir, "checkpoints", key, "checkpoint_last.pt")
                record(args.workdir, {**done[key], "bleu": {**done[key]["bleu"], **evaluate(data, ckpt, ["test"])}})
            else:
                finetune(key, name, sweep[name], seed, both)
    if "attention" in args.stages:
        for seed in args.seeds[: args.attention_seeds]:
            for name in args.attention_modes:
                extra = ATTENTION[name]
                train_and_score(args, f"attn_{name}.seed{seed}", f"attn_{name}", "train.sh", [],
                                COMMON + TRANSFORMER + extra
                                + ["--max-update", str(args.attention_updates), "--seed", str(seed)],
                                both, done, seed=seed, updates=args.attention_updates)


def report(args) -> str:
    rows = list(load_results(args.workdir).values())
    groups: Dict[str, List[dict]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    # Table order: pre-training, the fine-tuning runs, the sweep, the attention runs.
    order = ["pretrain", *FINETUNE_RUNS, *sorted(g for g in groups if g.startswith("soft_beam_")),
             *(f"attn_{name}" for name in ATTENTION)]
    groups = {g: groups[g] for g in sorted(groups, key=lambda g: order.index(g) if g in order else len(order))}
    lines = ["| run | seeds | BLEU val (beam 5) | BLEU test_2016_flickr (beam 5) | val NLL (bits/token) | "
             "train s per run |", "|---|---|---|---|---|---|"]
    for group, rs in groups.items():
        val = [r["bleu"]["valid"] for r in rs]
        test = [r["bleu"]["test"] for r in rs if "test" in r["bleu"]]
        nll = [v for v in (final_valid(os.path.join(args.workdir, "checkpoints", r["key"], "train.log"), "nll_loss")
                           for r in rs) if v is not None]
        nll_cell = f"{statistics.mean(nll):.3f}" if nll else "-"
        lines.append(f"| {group} | {len(rs)} | {mean_std(val)} | {mean_std(test) if test else '-'} | {nll_cell} | "
                     f"{statistics.mean(r['train_s'] for r in rs):.0f} |")
    # Per-run details at the first seed (the sweep's seed): what the training log says about each objective.
    seed = "seed1"
    lines += ["", f"| run ({seed}) | BLEU val (beam 5) | val NLL (bits/token) | gradient norm / clipped (epoch) | "
              "soft_loss (bits/token) | pruned-mass bound |", "|---|---|---|---|---|---|"]
    for group, rs in groups.items():
        r = next((r for r in rs if r["key"] == f"{group}.{seed}"), None)
        if r is None:
            continue
        log = os.path.join(args.workdir, "checkpoints", r["key"], "train.log")
        t = train_summary(log)
        nll = final_valid(log, "nll_loss")
        lines.append(f"| {group} | {r['bleu']['valid']:.2f} | {'-' if nll is None else f'{nll:.3f}'} | "
                     f"{t.get('gnorm', '-')} / {t.get('clip', '-')} % | {t.get('soft_loss', '-')} | "
                     f"{t.get('pruned_mass', '-')} |")
    table = "\n".join(lines)
    print(table)
    return table


def train_summary(log_path: str) -> Dict[str, str]:
    """Fields of the last end-of-epoch training line of a fairseq log (``| train | epoch ...``)."""
    fields: Dict[str, str] = {}
    if os.path.exists(log_path):
        with open(log_path, encoding="utf-8") as f:
            for line in f:
                if "| train | epoch" in line:
                    fields = dict(re.findall(r"\| (\w+) ([-\d.e+]+)", line))
    return fields


def final_valid(log_path: str, key: str):
    """``key`` of the last validation line of a fairseq log (teacher-forced, on the valid subset), or None."""
    value = None
    if os.path.exists(log_path):
        with open(log_path, encoding="utf-8") as f:
            for line in f:
                m = re.search(rf"valid on 'valid' subset .*\| {key} ([-\d.e+]+)", line)
                if m:
                    value = float(m.group(1))
    return value


def training_curve(log_path: str, key: str) -> List[tuple]:
    points = []
    with open(log_path, encoding="utf-8") as f:
        for line in f:
            if "| train_inner |" in line:
                fields = dict(re.findall(r"(\w+)=([-\d.e+]+)", line))
                if key in fields:
                    points.append((int(fields["num_updates"]), float(fields[key])))
    return points


def last_value(argv: List[str], flag) -> str:
    """The value fairseq takes for ``flag`` (or for the last given of several names of one flag, a tuple): the one
    after its last occurrence."""
    flags = (flag,) if isinstance(flag, str) else tuple(flag)
    return argv[max(i for i, arg in enumerate(argv) if arg in flags) + 1]


def plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    results = load_results(args.workdir)
    # BLEU (val) against epsilon: the sweep plus the paper's 0.1 from the seeded runs.
    eps_points = {}
    for r in results.values():
        extra = r.get("extra") or []
        if r["group"] == "soft_beam" or r["group"].startswith("soft_beam_eps"):
            eps = float(last_value(extra, EPSILON_FLAGS))
            eps_points.setdefault(eps, []).append(r["bleu"]["valid"])
    tf = [r["bleu"]["valid"] for r in results.values() if r["group"] == "tf"]
    if eps_points:
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        xs = sorted(eps_points)
        ax.plot(xs, [statistics.mean(eps_points[x]) for x in xs], "o-",
                label="soft beam search, rho 0.8 (mean; dots: seeds)")
        for x in xs:
            ax.plot([x] * len(eps_points[x]), eps_points[x], ".", color="C0", alpha=0.4)
        if tf:
            ax.axhline(statistics.mean(tf), color="C1", ls="--", label="continued teacher forcing")
        ax.set_xscale("log")
        ax.set_xlabel("epsilon (paper scaling)")
        ax.set_ylabel("BLEU, Multi30k val, beam 5")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "multi30k_bleu_vs_epsilon.png"), dpi=120)
        plt.close(fig)
    # Training curves. Left: pre-training (and from-scratch attention runs). Right: fine-tuning runs as the
    # difference to continued teacher forcing with the same seed -- the same batches, so batch noise cancels.
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    curves = {}
    for key in sorted(results):
        log = os.path.join(args.workdir, "checkpoints", key, "train.log")
        if os.path.exists(log):
            curves[key] = dict(training_curve(log, "nll_loss"))
    if "pretrain" in curves:
        axes[0].plot(list(curves["pretrain"]), list(curves["pretrain"].values()), label="pretrain (rnnsearch)", lw=1)
    scratch: Dict[str, List[Dict[int, float]]] = {}
    for key, pts in curves.items():
        if key.startswith("attn_"):
            scratch.setdefault(key.rpartition(".")[0], []).append(pts)
    for group, runs in sorted(scratch.items()):  # the attention runs: mean over seeds
        updates = sorted(set.intersection(*(set(r) for r in runs)))
        axes[0].plot(updates, [statistics.mean(r[u] for r in runs) for u in updates], lw=1,
                     label=f"{group} (transformer, {len(runs)} seed{'s' if len(runs) > 1 else ''})")
    by_group: Dict[str, List[Dict[int, float]]] = {}
    for key, pts in curves.items():
        group, _, seed = key.rpartition(".")
        baseline = curves.get(f"tf.{seed}")
        if group in ("tf", "pretrain") or group.startswith("attn_") or not baseline:
            continue
        by_group.setdefault(group, []).append({u: v - baseline[u] for u, v in pts.items() if u in baseline})
    for group, diffs in sorted(by_group.items()):
        updates = sorted(set.intersection(*(set(d) for d in diffs)))
        axes[1].plot(updates, [statistics.mean(d[u] for d in diffs) for u in updates], "o-", lw=1, ms=3,
                     label=f"{group} ({len(diffs)} seed{'s' if len(diffs) > 1 else ''})")
    axes[1].axhline(0, color="k", lw=0.8)
    axes[0].set_title("from scratch (teacher forcing)")
    axes[0].set_ylabel("train NLL (bits/token)")
    axes[1].set_title("fine-tuning: minus continued teacher forcing")
    axes[1].set_ylabel("train NLL difference (bits/token)")
    for ax in axes:
        ax.set_xlabel("updates")
        if ax.lines:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "multi30k_training_curves.png"), dpi=120)
    plt.close(fig)
    print(f"figures in {args.out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["run", "report", "plot"])
    p.add_argument("--data", default=os.path.join(REPO_ROOT, "..", "shared", "data", "multi30k_en_fr"))
    p.add_argument("--workdir", default=os.path.join(REPO_ROOT, "work", "study"))
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "docs", "figures"))
    p.add_argument("--stages", nargs="+", default=["pretrain", "finetune", "sweep", "best", "attention"],
                   choices=["pretrain", "finetune", "sweep", "best", "attention"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--bpe-size", type=int, default=8000, help="sentencepiece vocabulary size")
    p.add_argument("--prepared", help="prepared data of another workdir (WORKDIR/data), instead of preparing anew")
    p.add_argument("--pretrain-seed", type=int, default=1,
                   help="seed of the pre-training run (one per workdir: other seeds go to other workdirs)")
    p.add_argument("--pretrain-updates", type=int, default=600)
    p.add_argument("--finetune-updates", type=int, default=50)
    p.add_argument("--finetune-runs", nargs="+", default=list(FINETUNE_RUNS), choices=list(FINETUNE_RUNS),
                   help="which fine-tuning runs the finetune stage makes")
    p.add_argument("--sweep-epsilon", type=float, nargs="*", default=[0.01, 1.0])
    p.add_argument("--sweep-rho", type=float, nargs="*", default=[0.5])
    p.add_argument("--sweep-beam", type=int, nargs="*", default=[3])
    p.add_argument("--sweep-candidates", type=int, nargs="*", default=[200], help="pruning sizes M")
    p.add_argument("--sweep-max-iter", type=int, nargs="*", default=[1], help="solver iteration caps")
    p.add_argument("--no-sweep-bookkeeping", dest="sweep_bookkeeping", action="store_false",
                   help="leave out the --soft-beam-bookkeeping topk run of the sweep")
    p.add_argument("--attention-updates", type=int, default=600)
    p.add_argument("--attention-seeds", type=int, default=1)
    p.add_argument("--attention-modes", nargs="+", default=list(ATTENTION), choices=list(ATTENTION),
                   help="which attention runs (e.g. to split them over two processes)")
    args = p.parse_args(argv)
    {"run": run, "report": report, "plot": plot}[args.command](args)


if __name__ == "__main__":
    main()
