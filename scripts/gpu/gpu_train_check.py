"""A short end-to-end fairseq run of the plugin on a GPU with mixed precision: train, fine-tune, generate.

    python scripts/gpu/gpu_train_check.py --workdir work/gpu_check/train [--precisions fp16 amp]

fairseq 0.12's ``--bf16`` means "on a TPU" (it sets ``--tpu``; on a GPU the trainer then asks for an XLA device),
so on a GPU its mixed-precision modes are ``--fp16`` and ``--amp``; bf16 through our code is covered by
tests/test_mixed_precision.py (a bf16 model and bf16 autocast, on CPU and CUDA).

On a word-level toy en->fr corpus (4,000 training pairs, the demo's generator): with the first precision,
the demo transformer trained with teacher forcing for ``--updates`` updates, then fine-tuned for
``--finetune-updates`` with ``soft_beam_search`` (rho 0.8, beam 5, eps 0.1 paper scaling, M 50), and
``transformer_topk_attn`` (SOFT top-k encoder-decoder attention, k 4) trained from scratch for ``--updates``;
each decoded with ``fairseq-generate --beam 5`` (sacrebleu, word level). With each further precision the
two plugin runs repeat for ``--short-updates`` updates. The fine-tuning runs once more with
``--soft-beam-cuda-graphs`` (its updates/s against the eager run's: fairseq's own batches, every size captured as
it comes). Every logged loss and gradient norm must be finite
(fp16's skipped overflow steps are counted, not failures). Prints one markdown table and writes it with the
raw figures to ``WORKDIR/summary.json``; exits non-zero when a run fails or logs a non-finite value. A
fairseq-train killed by a signal *after* it logged "done training" (some GPU images abort every fairseq-train
at exit, plain fairseq too) counts as finished, with the signal in the table's ``exit`` column.
``--precisions none --cpu`` runs the same on CPU in full precision (what the tests do, tiny).
"""
import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from softtopk_fairseq.pipeline import toy_corpus  # noqa: E402
from softtopk_fairseq.pipeline.run import (ARCH_ARGS, KEEP_LAST_BATCH, USER_DIR, fairseq_cmd,  # noqa: E402
                                           quiet_warnings_env)

PRECISION_FLAGS = {"none": [], "fp16": ["--fp16"], "amp": ["--amp"]}
SOFT_BEAM = ["--criterion", "soft_beam_search", "--label-smoothing", "0.1", "--teacher-forcing-ratio", "0.8",
             "--soft-beam-size", "5", "--soft-beam-epsilon", "0.1", "--soft-beam-scaling", "paper",
             "--soft-beam-candidates", "50"]
TF = ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
TOPK_ATTN = ["--arch", "transformer_topk_attn", "--topk-attn-mode", "soft_topk", "--topk-attn-k", "4",
             "--topk-attn-epsilon", "0.1"]


# fairseq-train's last log line once training and its last checkpoint are done.
DONE_TRAINING = "done training in"


def run(cmd, log_path, done_marker=None):
    """Runs ``cmd`` with its output in ``log_path``; returns (output, seconds, abort). A non-zero exit fails --
    except a death by signal after ``done_marker`` was logged: on some GPU images every fairseq-train (plain
    fairseq too) aborts at interpreter exit ("terminate called without an active exception") after its work is
    done and saved. That exit is returned as ``abort`` (e.g. "SIGABRT after 'done training in'") and shown in
    the table, not hidden."""
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=quiet_warnings_env())
    seconds = time.perf_counter() - start
    with open(log_path, encoding="utf-8") as f:
        output = f.read()
    # ``cmd`` runs without a shell, so a death by signal N shows only as -N; an exit status above 128 is the
    # program's own (sys.exit(134) is a failure, not a SIGABRT).
    signum = -proc.returncode if proc.returncode < 0 else 0
    if signum and done_marker is not None and done_marker in output:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        abort = f"{name} after {done_marker!r}"
        print(f"gpu_train_check: warning: exited with {abort} (log: {log_path}); its work was done, counted as "
              "finished", flush=True)
        return output, seconds, abort
    if proc.returncode != 0:
        raise RuntimeError(f"failed ({proc.returncode}): {' '.join(cmd)}\n{output[-4000:]}")
    return output, seconds, None


def train_stats(output):
    """Logged training records (fairseq's json log lines): final loss, updates/s, non-finite values."""
    records = []
    for line in output.splitlines():
        m = re.search(r"(\{.*\})\s*$", line)
        if m and '"loss"' in m.group(1):
            try:
                records.append(json.loads(m.group(1)))
            except ValueError:
                continue
    bad = [r for r in records for key in ("loss", "gnorm", "tf_loss", "soft_loss")
           if key in r and not math.isfinite(float(r[key]))]
    ups = [float(r["ups"]) for r in records if "ups" in r]
    return {"records": len(records), "final_loss": float(records[-1]["loss"]) if records else float("nan"),
            "non_finite": len(bad), "ups": ups[-1] if ups else float("nan"),
            "overflows": len(re.findall(r"gradient overflow detected", output))}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--precisions", nargs="+", default=["fp16", "amp"], choices=list(PRECISION_FLAGS))
    p.add_argument("--updates", type=int, default=300)
    p.add_argument("--finetune-updates", type=int, default=100)
    p.add_argument("--short-updates", type=int, default=50)
    p.add_argument("--train-pairs", type=int, default=4000)
    p.add_argument("--size", default="demo", choices=["demo", "tiny"])
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    raw, bin_dir = os.path.join(a.workdir, "raw"), os.path.join(a.workdir, "bin")
    os.makedirs(raw, exist_ok=True)
    for split, n, seed in (("train", a.train_pairs, 1), ("valid", 200, 2), ("test", 200, 3)):
        toy_corpus.write_split(os.path.join(raw, split), n, seed)
    run([*fairseq_cmd("preprocess"), "--source-lang", "en", "--target-lang", "fr", "--trainpref", f"{raw}/train",
         "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", bin_dir, "--joined-dictionary",
         "--workers", "4"], os.path.join(a.workdir, "preprocess.log"))
    device = ["--cpu"] if a.cpu else []
    base = [bin_dir, "--user-dir", USER_DIR, *device, "--seed", "1", *ARCH_ARGS["transformer"][a.size],
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--max-tokens", "4096",
            "--no-epoch-checkpoints", "--save-interval-updates", "0", "--log-format", "json", "--log-interval", str(max(1, min(10, a.finetune_updates, a.short_updates))),
            "--num-workers", "0", "--disable-validation", *KEEP_LAST_BATCH]
    scratch = ["--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100"]
    rows = []

    def train(name, precision, updates, extra, restore=None):
        save = os.path.join(a.workdir, f"{name.replace(', ', '_').replace(' ', '_')}_{precision}")
        args = [*base, *PRECISION_FLAGS[precision], *extra, "--max-update", str(updates), "--save-dir", save]
        if restore:
            args += ["--restore-file", restore, "--reset-optimizer", "--reset-lr-scheduler", "--reset-meters",
                     "--reset-dataloader", "--lr", "1e-4", "--lr-scheduler", "fixed"]
        else:
            args += scratch
        output, seconds, abort = run([*fairseq_cmd("train"), *args], save + ".log", done_marker=DONE_TRAINING)
        row = dict(run=name, precision=precision, updates=updates, seconds=round(seconds, 1), **train_stats(output))
        if abort:
            row["exit"] = abort
        rows.append(row)
        print(json.dumps(row), flush=True)
        return os.path.join(save, "checkpoint_last.pt")

    def bleu(row, checkpoint, precision):
        out, _, _ = run([*fairseq_cmd("generate"), bin_dir, "--user-dir", USER_DIR, *device, "--path", checkpoint,
                      "--gen-subset", "test", "--beam", "5", "--batch-size", "128", "--scoring", "sacrebleu",
                      *PRECISION_FLAGS[precision if precision != "amp" else "none"], *KEEP_LAST_BATCH],
                     checkpoint + ".generate.log")
        hyps = len(re.findall(r"^H-\d+\t", out, flags=re.M))
        m = re.search(r"BLEU = ([0-9.]+)", out)
        row.update(bleu=float(m.group(1)) if m else float("nan"), hypotheses=hyps)

    first, *rest = a.precisions
    tf_ckpt = train("teacher_forcing", first, a.updates, TF)
    bleu(rows[-1], tf_ckpt, first)
    soft_ckpt = train("soft_beam_search", first, a.updates + a.finetune_updates, SOFT_BEAM, restore=tf_ckpt)
    bleu(rows[-1], soft_ckpt, first)
    graphs_ckpt = train("soft_beam_search, CUDA graphs", first, a.updates + a.finetune_updates,
                        [*SOFT_BEAM, "--soft-beam-cuda-graphs"], restore=tf_ckpt)
    bleu(rows[-1], graphs_ckpt, first)
    topk_ckpt = train("topk_attn", first, a.updates, [*TOPK_ATTN, *TF])
    bleu(rows[-1], topk_ckpt, first)
    for precision in rest:
        train("soft_beam_search", precision, a.updates + a.short_updates, SOFT_BEAM, restore=tf_ckpt)
        train("topk_attn", precision, a.short_updates, [*TOPK_ATTN, *TF])
    print("\n| run | precision | updates (to) | wall s | updates/s (last log) | final loss | non-finite logged | "
          "fp16 overflow skips | BLEU beam 5 (test, 200 sents) | exit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = f"{r['bleu']:.2f} ({r['hypotheses']} hyps)" if "bleu" in r else "-"
        print(f"| {r['run']} | {r['precision']} | {r['updates']} | {r['seconds']} | {r['ups']} | {r['final_loss']:.3f} "
              f"| {r['non_finite']} | {r['overflows']} | {b} | {r.get('exit', 0)} |")
    with open(os.path.join(a.workdir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    failed = [r for r in rows if r["non_finite"] or not math.isfinite(r["final_loss"]) or r.get("hypotheses") == 0]
    if failed:
        raise SystemExit(f"gpu_train_check: non-finite or empty results in {[r['run'] + '/' + r['precision'] for r in failed]}")


if __name__ == "__main__":
    main()
