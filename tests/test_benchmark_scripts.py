"""The benchmark scripts run end to end (tiny sizes or a tiny checkpoint; their figures come from real runs)."""
import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from file_tree import snapshot

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("script,args,rows", [
    ("bench_soft_beam.py", ["--archs", "lstm", "--candidates", "20", "--beam", "2", "--methods", "ot", "perturbed"], 9),
    ("bench_topk_attention.py", [], 6),
])
def test_benchmark_script_prints_its_table(script, args, rows):
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), *args, "--bsz", "4", "--src-len", "5",
                          "--tgt-len", "4", "--vocab", "60", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == rows + 1, out.stdout  # header + one row per configuration


def test_soft_beam_benchmark_times_a_baseline_alternately_in_the_process():
    """On a GPU bench_soft_beam takes each row's ratio against teacher-forcing updates timed alternately with the
    row's own (time_updates' ``baseline``): the order of the updates, checked on CPU."""
    sys.path.insert(0, BENCH)
    from bench_soft_beam import build_model_and_sample, time_updates, warmup_updates

    cfg = dict(arch="lstm", bsz=2, src_len=3, tgt_len=3, vocab=40, threads=1, device="cpu")
    model, task, sample, device = build_model_and_sample(cfg)
    calls = []

    def criterion_named(name):
        def criterion(model, sample):
            calls.append(name)
            loss = model(**sample["net_input"])[0].float().logsumexp(-1).mean()
            return loss, 1, {}
        return criterion

    def baseline():
        calls.append("built")
        return build_model_and_sample(cfg)[0], criterion_named("tf")

    seconds, _, peak, tf_seconds = time_updates(model, criterion_named("row"), sample, device, 3, 2, baseline)
    assert calls == ["row", "row", "built", "tf", "tf"] + ["tf", "row"] * 3
    assert seconds > 0 and tf_seconds > 0 and peak > 0
    calls.clear()
    assert time_updates(model, criterion_named("row"), sample, device, 2, 1)[3] is None
    assert calls == ["row"] * 3
    assert [warmup_updates(dict(device=d, warmup=w)) for d, w in [("cpu", None), ("cuda:0", None), ("cuda", 2)]] == [
        1, 5, 2]


def test_phases_benchmark_makes_soft_topks_checks_in_the_search_and_restores_them():
    """soft_beam_phases.py's ``checks_made``: a soft beam search on the Triton backend (under the interpreter
    here) reads back two values per step while active -- the status bits and the iteration counts -- and one
    per search after it (the empty-target check); and the script's table on CPU."""
    sys.path.insert(0, BENCH)
    import torch
    from host_reads import HostReads
    from soft_beam_phases import checks_made
    from tiny_models import batch, build, dictionary

    from softtopk_fairseq.modules.soft_beam_search import soft_beam_search
    from softtopk_fairseq.ops import use_backend

    d = dictionary(12)
    model, sample = build("lstm", d, dtype=torch.float32), batch(d, tgt_lens=(5, 4, 6))
    ni = sample["net_input"]
    encoder_out = model.encoder(ni["src_tokens"], src_lengths=ni["src_lengths"])  # (it reads the padding: fairseq's)

    def reads():
        with use_backend("triton"), HostReads() as mode:
            soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=d.pad(), eos=d.eos(),
                             beam=3, scaling="paper", encoder_out=encoder_out)
        return mode.count

    with checks_made():
        assert reads() >= 1 + 2 * 5  # 6 steps, the last without a relaxed top-k (+1 when a row reaches max_iter)
    assert reads() == 1
    out = subprocess.run([sys.executable, os.path.join(BENCH, "soft_beam_phases.py"), "--bsz", "2", "--src-len",
                          "3", "--tgt-len", "3", "--vocab", "40", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["update", "teacher forcing", "sum", "sum, checks made", "sum, CUDA graphs"], out.stdout
    assert all(float(cell) > 0 for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line
               and "update" not in line for cell in line.split("|")[2:7]), out.stdout  # the phases and the total


def test_graph_batches_benchmark_prints_one_row_per_epoch():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "soft_beam_graph_batches.py"), "--batches", "2",
                          "--epochs", "2", "--bsz-choices", "2", "3", "--src-lens", "3", "4", "--tgt-lens", "3", "4",
                          "--vocab", "40", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows] == ["epoch", "1", "2"], out.stdout
    assert all(float(cell) > 0 for r in rows[1:] for cell in r[1:6]), out.stdout
    assert all(r[6].strip() == "0" for r in rows[1:]), out.stdout  # on CPU nothing is captured


def test_operator_benchmark_prints_its_table():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_soft_topk.py"), "--shapes", "generic",
                          "--repeats", "1", "--peer-repeats", "2", "--no-unrolled", "--threads", "1"],
                         capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| generic")]
    assert len(rows) == 1 and rows[0].count("|") == 18, out.stdout


def test_softmax_k_times_benchmark_compares_with_a_git_revision():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_softmax_k_times.py"), "--against", "HEAD",
                          "--shapes", "4x30", "2x7", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| 4x30") or line.startswith("| 2x7")]
    assert len(rows) == 2 and all(float(row[5]) > 0 for row in rows), out.stdout


@pytest.mark.parametrize("backends", [[], ["--backends", "triton", "torch"]])  # Triton: the interpreter here
def test_unsorted_k_benchmark_prints_its_table(backends):
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_unsorted_k.py"), "--rows", "4", "--n", "300",
                          "--ks", "5", "150", "299", "--peer-repeats", "2", "--threads", "1", *backends],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows[1:]] == ["5", "150", "299"], out.stdout
    converged = [c.strip() for r in rows[1:] for c, name in zip(r, rows[0]) if name.strip().endswith("converged")]
    assert converged == ["100%"] * 6, out.stdout  # both backends, every k (k = n - 1 included)


def test_perturbed_gradient_variance_prints_its_table():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "perturbed_gradient_variance.py"), "--shapes", "generic",
                          "--samples", "2", "--seeds", "3", "--threads", "1"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 2 * 2 + 1, out.stdout  # header, (unsorted, sorted) x control variate, criterion
    cosines = [float(line.split("|")[-2]) for line in rows[1:]]
    assert all(-1 <= c < 1 for c in cosines)  # a Monte-Carlo estimate: never exactly the same over seeds


def test_multi30k_study_reports_and_plots_recorded_runs(tmp_path):
    sys.path.insert(0, BENCH)
    import multi30k_study as study

    work = tmp_path / "study"
    work.mkdir()
    paper = ["--cpu", *study.PAPER]
    rows = [("tf.seed1", "tf", [], {"valid": 40.0, "test": 41.0}),
            ("tf.seed2", "tf", [], {"valid": 42.0, "test": 43.0}),
            ("soft_beam.seed1", "soft_beam", paper, {"valid": 39.0, "test": 40.0}),
            ("soft_beam_eps1.seed1", "soft_beam_eps1", paper + ["--soft-topk-epsilon", "1"], {"valid": 38.0})]
    for key, group, extra, bleu in rows:
        study.record(str(work), {"key": key, "group": group, "train_s": 10.0, "bleu": bleu, "extra": extra})
        (work / "checkpoints" / key).mkdir(parents=True)
        (work / "checkpoints" / key / "train.log").write_text(
            "2026-11-22 10:26:38 | INFO | train_inner | epoch 001:     50 / 139 loss=7.255, nll_loss=6.311, "
            "ppl=79.38, num_updates=50, lr=0.001\n"
            "2026-11-22 10:27:38 | INFO | train_inner | epoch 001:    100 / 139 loss=6.1, nll_loss=5.5, "
            "num_updates=100, lr=0.001\n"
            "2026-11-22 10:50:04 | INFO | train | epoch 001 | loss 4.9 | soft_loss 5.6 | pruned_mass 5 | gnorm 0.873 "
            "| clip 30 | num_updates 50\n"
            "2026-11-22 10:50:04 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 4.172 | nll_loss 2.724 "
            "| tf_loss 4.172 | ppl 6.6 | num_updates 50\n")
    results = study.load_results(str(work))
    assert study.best_sweep_run(results, ["soft_beam_eps1"], seed=1) is None  # 38 < the paper setting's 39
    study.record(str(work), {"key": "soft_beam_eps1.seed1", "group": "soft_beam_eps1", "train_s": 10.0,
                             "bleu": {"valid": 39.5}, "extra": paper + ["--soft-topk-epsilon", "1"]})
    results = study.load_results(str(work))
    assert results["soft_beam_eps1.seed1"]["bleu"] == {"valid": 39.5}  # the later row of a key wins
    assert study.best_sweep_run(results, ["soft_beam_eps1", "soft_beam_rho0.5"], seed=1) == "soft_beam_eps1"
    assert study.best_sweep_run(results, ["soft_beam_eps1"], seed=2) is None  # not run at that seed
    study.record(str(work), {"key": "soft_beam_eps1.seed1", "group": "soft_beam_eps1", "train_s": 10.0,
                             "bleu": {"valid": 38.0}, "extra": paper + ["--soft-topk-epsilon", "1"]})
    table = study.report(type("A", (), {"workdir": str(work)}))
    assert "| tf | 2 | 41.00 ± 1.41 | 42.00 ± 1.41 | 2.724 | 10 |" in table
    assert "| soft_beam_eps1 | 1 | 38.00 | - | 2.724 | 10 |" in table
    assert "| soft_beam_eps1 | 38.00 | 2.724 | 0.873 / 30 % | 5.6 | 5 |" in table  # seed-1 details from the log
    assert study.last_value(paper + ["--soft-topk-epsilon", "1"], "--soft-topk-epsilon") == "1"
    assert study.training_curve(str(work / "checkpoints" / "tf.seed1" / "train.log"), "nll_loss") == [
        (50, 6.311), (100, 5.5)]
    study.main(["plot", "--workdir", str(work), "--out", str(tmp_path / "fig")])
    assert sorted(os.listdir(tmp_path / "fig")) == ["multi30k_bleu_vs_epsilon.png", "multi30k_training_curves.png"]


@pytest.fixture(scope="module")
def tiny_checkpoint(toy_data_bin, tmp_path_factory):
    from fairseq_cli import USER_DIR, fairseq, tiny_arch

    save = tmp_path_factory.mktemp("bench_checkpoint")
    fairseq("train", toy_data_bin, "--user-dir", USER_DIR, "--cpu", "--seed", "1", *tiny_arch("lstm"),
            "--optimizer", "adam", "--lr", "0.005", "--max-tokens", "400", "--max-update", "2", "--save-dir", save,
            "--no-epoch-checkpoints", "--num-workers", "0", "--required-batch-size-multiple", "1")
    return save / "checkpoint_last.pt"


@pytest.mark.parametrize("script,args", [
    ("soft_beam_grad_norms.py", ["--eval-mode"]),
    ("soft_beam_duplicates.py", ["--beam", "2"]),
    ("soft_beam_backend_drift.py", ["--beam", "2"]),
])
def test_checkpoint_scripts_print_their_tables(tiny_checkpoint, toy_data_bin, script, args):
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), str(tiny_checkpoint), str(toy_data_bin),
                          "--max-tokens", "200", "--candidates", "10", *args],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    if script == "soft_beam_grad_norms.py":  # teacher forcing + one row per setting, finite figures
        sys.path.insert(0, BENCH)
        import soft_beam_grad_norms

        assert len(rows) == 2 + len(soft_beam_grad_norms.SETTINGS), out.stdout
        assert all(float(cell) < float("inf") for row in rows[1:] for cell in row[1:]), out.stdout
    elif script == "soft_beam_duplicates.py":  # 2 scalings x 2 bookkeepings, "d / n" with n > 0
        assert len(rows) == 5 and all(int(row[2].split("/")[1]) > 0 for row in rows[1:]), out.stdout
    else:  # one row per decoding step; step 0 sees the same scores in both runs
        assert len(rows) >= 3 and float(rows[1][1]) == 0.0, out.stdout
        assert all(float(row[3]) < 1e-4 for row in rows[1:]), out.stdout  # the solvers agree on the same scores


def test_pruning_script_compares_every_m_with_the_exact_search(tiny_checkpoint, toy_data_bin, tmp_path):
    out = subprocess.run([sys.executable, os.path.join(BENCH, "soft_beam_pruning.py"), str(tiny_checkpoint),
                          str(toy_data_bin), "--max-tokens", "200", "--batches", "1", "--beam", "2", "--candidates",
                          "4", "20", "0", "--json", str(tmp_path / "rows.jsonl")],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "rows.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [(r["setting"], r["candidates"]) for r in rows] == [
        ("paper", 4), ("paper", 20), ("paper", 0), ("topk_nats", 4), ("topk_nats", 20), ("topk_nats", 0)]
    exact = [r for r in rows if r["candidates"] == 0]
    assert all(r["grad_cosine"] == pytest.approx(1.0) and r["pruned_mass"] == 0 for r in exact)
    assert all(-1 <= r["grad_cosine"] <= 1 + 1e-9 and 0 <= r["duplicate_rate"] <= 1 for r in rows)
    assert any(r["pruned_mass"] > 0 for r in rows if r["candidates"] == 4)  # M 4 of 2 x V prunes something


def test_profile_script_counts_synchronisations():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "profile_soft_beam.py"), "--bsz", "4", "--src-len", "5",
                          "--tgt-len", "4", "--vocab", "60", "--threads", "1", "--rows", "5"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Self CPU time total" in out.stdout
    # Adam's reads of its CPU step counters (one per parameter tensor on CPU) are told apart from the update's own.
    reported = re.search(r"host-device synchronisations per update: (\d+) \((\d+) scalar reads, less the optimizer "
                         r"step's (\d+) ", out.stdout)
    assert reported, out.stdout
    syncs, reads, step_reads = map(int, reported.groups())
    assert step_reads > 0 and syncs == reads - step_reads > 0


def test_gpu_train_check_runs_on_cpu_in_full_precision(tmp_path):
    """The fairseq part of gpu_check.sh, tiny and on CPU (fairseq's --bf16 means a TPU without CUDA)."""
    out = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_train_check.py"), "--workdir", str(tmp_path),
                          "--precisions", "none", "--cpu", "--size", "tiny", "--updates", "8", "--finetune-updates",
                          "2", "--train-pairs", "100"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["teacher_forcing", "soft_beam_search",
                                                           "soft_beam_search, CUDA graphs", "topk_attn"]
    assert all("(200 hyps)" in r for r in rows[1:])  # every test sentence decoded


@pytest.mark.parametrize("script", ["gpu_check.sh"])
def test_gpu_check_without_cuda_says_so_and_exits_0(script, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check.sh would run everything")
    root = os.path.dirname(BENCH)
    out = subprocess.run(["bash", os.path.join(root, "scripts", script), str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, SOFTTOPK_PYTHON=sys.executable))
    assert out.returncode == 0 and "no CUDA device" in out.stdout, out.stdout + out.stderr


def test_converged_study_picks_the_sweeps_best_on_val_once_the_sweep_is_complete(tmp_path, capsys):
    sys.path.insert(0, BENCH)
    import multi30k_converged as converged
    from jsonl_ledger import append_row, rows_by_key

    ledger = tmp_path / "ledger.jsonl"
    args = argparse.Namespace(ledger=str(ledger), workdir=str(tmp_path), prepared=None, sweep_seed=2, seeds=[1, 2, 3])
    study = converged.Study(args)
    val = {"soft_beam_paper": 40.0, "soft_beam_topk_bookkeeping": 41.0, "soft_beam_nats": 41.0}
    assert study.run_name("tf") == "tf"
    for i, (name, bleu) in enumerate(val.items()):
        assert study.run_name(converged.BEST) is None  # the sweep is not complete yet
        assert "not complete at seed 2" in capsys.readouterr().out
        append_row(str(ledger), {"key": f"finetune.{name}.seed2", "stage": "finetune", "seed": 2,
                                 "bleu": {"valid": bleu, "test": 50.0 - i}})
    append_row(str(ledger), {"key": "finetune.soft_beam_nats.seed1", "stage": "finetune", "seed": 1,
                             "bleu": {"valid": 99.0, "test": 0.0}})  # another seed: not the sweep's
    # the best val BLEU at the sweep seed, the earlier in SWEEP on a tie; test BLEU plays no part
    assert study.run_name(converged.BEST) == "soft_beam_topk_bookkeeping"
    rows = rows_by_key(str(ledger))
    assert converged.sweep_choice(rows, 1) is None
    assert converged.sweep_choice({**rows, "finetune.soft_beam_paper.seed2": {"bleu": {"valid": 41.5}}}, 2) \
        == "soft_beam_paper"


def test_converged_study_runs_resumes_and_reports_on_tiny_data(tmp_path):
    """The converged study's driver end to end on a toy corpus at tiny sizes: pre-training with validation
    BLEU and early stopping, fine-tuning from its best checkpoint, one attention run, the ledger (a second
    `run` skips what is recorded), the hypotheses kept beside it, a pre-training whose workdir is gone
    trained again only when asked (--retrain-missing), and the report with paired differences computed from
    the kept hypotheses alone."""
    from softtopk_fairseq.pipeline import toy_corpus

    data = tmp_path / "raw"
    data.mkdir()
    for split, n, seed in (("train", 120, 1), ("val", 10, 2), ("test_2016_flickr", 8, 3)):
        toy_corpus.write_split(str(data / split), n, seed)
    rnn = "--encoder-embed-dim 8 --decoder-embed-dim 8 --encoder-hidden-size 8 --decoder-hidden-size 8 " \
          "--attention-dim 8 --maxout-dim 8"
    common = ["--data", str(data), "--workdir", str(tmp_path / "work"), "--ledger", str(tmp_path / "ledger.jsonl"),
              "--bpe-size", "90", "--seeds", "1", "--max-epoch", "2", "--patience", "1"]
    script = os.path.join(BENCH, "multi30k_converged.py")

    def driver(*args):
        out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout

    driver("run", *common, "--stages", "pretrain", "--extra-args", rnn)
    # (no --candidates: the pruning comparison, run first, picks M for the soft fine-tuning; batches of 16
    # sentences: 8 updates an epoch, so that most validations fall inside the epoch)
    driver("run", *common, "--stages", "finetune", "pruning", "--runs", "tf", "soft_beam_paper",
           "--finetune-epochs", "1", "--finetune-validate-updates", "2", "--pruning-batches", "1",
           "--extra-args", rnn + " --batch-size 16")
    tiny_transformer = ("--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 8 --decoder-embed-dim 8 "
                        "--encoder-ffn-embed-dim 16 --decoder-ffn-embed-dim 16 --encoder-attention-heads 2 "
                        "--decoder-attention-heads 2 --topk-attn-k 2")
    driver("run", *common, "--stages", "attention", "--attention-modes", "softmax", "soft_topk",
           "hard_topk", "perturbed", "perturbed_64", "--extra-args", tiny_transformer)
    with open(tmp_path / "ledger.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["key"] for r in rows] == ["pretrain.rnnsearch.seed1", "pruning.rnnsearch.seed1", "finetune.tf.seed1",
                                        "finetune.soft_beam_paper.seed1", "attention.softmax.seed1",
                                        "attention.soft_topk.seed1", "attention.hard_topk.seed1",
                                        "attention.perturbed.seed1", "attention.perturbed_64.seed1"]
    for row, samples in ((rows[-2], None), (rows[-1], "64")):
        perturbed = row["extra"]  # trained perturbed, validated and scored with the hard top-k it smooths
        assert perturbed[perturbed.index("--topk-attn-mode") + 1] == "perturbed"
        assert perturbed.count("--topk-attn-inference") == 1
        assert perturbed[perturbed.index("--topk-attn-inference") + 1] == "hard"
        given = perturbed[perturbed.index("--topk-attn-samples") + 1] if "--topk-attn-samples" in perturbed else None
        assert given == samples  # the default arm: the layers' default (16)
    pruning = rows[1]["rows"]
    assert [(p["setting"], p["candidates"]) for p in pruning][:3] == [("paper", 50), ("paper", 200), ("paper", 0)]
    # M of the paper-setting fine-tuning: the smallest M whose gradient is within cosine 0.99 of exact, else exact
    close = [p["candidates"] for p in pruning if p["setting"] == "paper" and p["candidates"] and p["grad_cosine"] >= 0.99]
    extra = rows[3]["extra"]
    assert extra[extra.index("--soft-beam-candidates") + 1] == str(min(close, default=0))
    rows = [r for r in rows if r["stage"] != "pruning"]
    for tuned in rows[1:3]:  # the checkpoint scored is the best of all validations, inside the epoch as well
        assert [p["updates"] for p in tuned["val_curve"]] == [2, 4, 6, 8] and tuned["unsaved_validations"] == []
        best = max(p["bleu"] for p in tuned["val_curve"])
        assert tuned["scored_updates"] == tuned["best_updates"] == \
            max(p["updates"] for p in tuned["val_curve"] if p["bleu"] == best)  # fairseq: the last of ties
    pre = rows[0]
    assert pre["val_curve"] and all(0 <= p["bleu"] <= 100 for p in pre["val_curve"])
    assert pre["epochs"] <= 2 and isinstance(pre["converged"], bool)
    assert pre["converged"] or pre["epochs"] == 2  # stopped by --patience, or by the --max-epoch cap
    assert all(set(r["bleu"]) == {"valid", "test"} for r in rows)
    assert all(len(r["train_s_starts"]) == 1 and 0 <= r["train_s_starts"][0] <= r["train_s"] + 1 for r in rows)
    kept = tmp_path / "ledger.hyps"
    for r in rows:
        for subset in ("valid", "test"):
            with gzip.open(kept / f"{r['key']}.{subset}.fr.gz", "rt") as f:
                assert f.read() == (tmp_path / "work" / "checkpoints" / r["key"] / f"{subset}.beam5.fr").read_text()
    again = driver("run", *common, "--stages", "pretrain", "finetune", "--runs", "tf", "--extra-args", rnn)
    assert "pretrain.rnnsearch.seed1: in the ledger, skipped" in again and "finetune.tf.seed1: in the ledger" in again
    # One workdir, one ledger, one data set: other inputs, missing inputs or a ledger of other data stop the
    # driver before it trains or writes anything.
    with open(tmp_path / "ledger.jsonl") as f:
        recorded = [json.loads(line) for line in f]
    assert len({r["data_fingerprint"] for r in recorded}) == 1 and len(recorded[0]["data_fingerprint"]) == 16
    assert set(json.loads((tmp_path / "work" / "data" / "source.json").read_text())["files"]) == {
        f"{split}.{lang}" for split in ("train", "val", "test_2016_flickr") for lang in ("en", "fr")}

    def refused(data_dir, ledger, expected):
        args = ["run", *common, "--stages", "pretrain", "finetune", "--runs", "tf", "--extra-args", rnn]
        args[args.index("--data") + 1], args[args.index("--ledger") + 1] = str(data_dir), str(ledger)
        before = snapshot(tmp_path / "work")
        ledger_before = (tmp_path / "ledger.jsonl").read_text()
        out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and expected in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
        assert snapshot(tmp_path / "work") == before
        assert (tmp_path / "ledger.jsonl").read_text() == ledger_before

    other = tmp_path / "other"
    shutil.copytree(data, other)
    with open(other / "train.en", "a") as f:
        f.write("one more line\n")
    refused(other, tmp_path / "ledger.jsonl", "differs (train.en)")
    (other / "val.fr").unlink()
    refused(other, tmp_path / "ledger.jsonl", "lacks val.fr")
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({**recorded[0], "key": "attention.softmax.seed9", "data_fingerprint": "0" * 16})
                       + "\n")
    refused(data, foreign, "other prepared data")
    # Another session's workdir: the checkpoints are gone, the ledger and the kept hypotheses are not.
    shutil.rmtree(tmp_path / "work" / "checkpoints")
    skipped = driver("run", *common, "--stages", "finetune", "--runs", "softmax_k_times", "--extra-args", rnn)
    assert "is in the ledger but" in skipped and "--retrain-missing" in skipped
    driver("run", *common, "--stages", "finetune", "--runs", "softmax_k_times", "--retrain-missing",
           "--finetune-epochs", "1", "--finetune-validate-updates", "2", "--candidates", "10", "--extra-args", rnn)
    with open(tmp_path / "ledger.jsonl") as f:
        keys = [json.loads(line)["key"] for line in f]
    assert keys[-2:] == ["pretrain.rnnsearch.seed1.rerun", "finetune.softmax_k_times.seed1"]
    table = driver("report", "--workdir", str(tmp_path / "work"), "--ledger", str(tmp_path / "ledger.jsonl"),
                   "--patience", "1")
    assert "| rerun of |" in table and "| pretrain.rnnsearch.seed1 |" in table
    assert "| finetune.soft_beam_paper - finetune.tf | valid |" in table
    assert "| attention.soft_topk - attention.softmax | test |" in table
    assert "| attention.soft_topk - attention.hard_topk | valid |" in table
    assert "| attention.perturbed - attention.hard_topk | test |" in table
    assert "| attention.perturbed_64 - attention.perturbed | valid |" in table
    assert "Pruning on pruning.rnnsearch.seed1" in table and "| paper | exact |" in table
    assert "--candidates auto: the smallest M" in table and f"paper {min(close, default=0) or 'exact'}" in table
    assert re.search(r"\| finetune.soft_beam_paper - finetune.tf \| valid \| [-+]\d+\.\d\d \| [-+]?\d+\.\d\d \| "
                     r"\d\.\d{3} \|", table), table  # a difference and a paired-bootstrap p-value


def test_count_host_ops_breaks_a_soft_beam_update_down_by_source():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "count_host_ops.py"), "--soft-beam", "--backend",
                          "cpu", "--top", "40", "--tgt-len", "5"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lengths 6 / 5" in out.stdout
    total = int(re.search(r"backend cpu: (\d+) tensor operations", out.stdout).group(1))
    tf_ops = int(re.search(r"teacher forcing on the same batch: (\d+) operations", out.stdout).group(1))
    assert 0 < tf_ops < total  # the search costs more than teacher forcing on its own
    rows = {r[1].strip(): int(r[2]) for r in (line.split("|") for line in out.stdout.splitlines())
            if len(r) == 4 and r[2].strip().isdigit()}
    # the decoder steps, the relaxed top-k and PyTorch's own backward all show up, and they add up; the backward
    # by operator too (its gradient accumulation among them), within the engine's total
    assert {"soft_beam_search.py:soft_beam_search", "soft_topk.py:soft_topk", "autograd engine"} <= set(rows)
    sources = {k: v for k, v in rows.items() if not k.startswith("aten.")}
    engine = {k: v for k, v in rows.items() if k.startswith("aten.")}
    assert sum(sources.values()) <= total and min(sources.values()) > 0
    assert "aten.add.Tensor" in engine and sum(engine.values()) <= sources["autograd engine"]


def test_count_host_ops_counts_a_topk_attention_training_step():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "count_host_ops.py"), "--topk-attention", "--backend",
                          "cpu"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r[1].strip(): (int(r[2]), int(r[3])) for r in (line.split("|") for line in out.stdout.splitlines())
            if len(r) == 5 and r[2].strip().isdigit()}
    assert set(rows) == {"transformer (softmax)", "transformer_topk_attn soft, all three"}
    # six soft_topk calls and their surroundings come on top of the same transformer's operations
    assert rows["transformer_topk_attn soft, all three"][0] > rows["transformer (softmax)"][0]


def test_count_host_ops_prints_its_table():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "count_host_ops.py"), "--rows", "3", "--n", "12"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 8
    counts = {(r[1].strip(), r[2].strip(), r[3].strip()): int(r[4]) for r in rows}
    assert all(0 < int(r[4]) <= int(r[5]) for r in rows)  # views left out, then counted too
    # the fused unsorted call is a handful of host operations (one kernel each way), the PyTorch path's hundreds
    for backend in ("cpu", "triton") if ("triton", "paper", "unsorted") in counts else ("cpu",):
        assert counts[(backend, "paper", "unsorted")] < counts[("torch", "paper", "unsorted")] / 5


def test_converged_study_fingerprints_the_prepared_data_not_where_it_was_prepared(tmp_path, capsys):
    """The ledger's data fingerprint covers the dictionaries and binarised splits, names and contents, and not
    fairseq-preprocess's log (its arguments, with the workdir's absolute paths): the same data prepared in two
    folders has one fingerprint. Rows of the first version (data_sha256, log included) are named, not refused."""
    sys.path.insert(0, BENCH)
    import multi30k_converged as converged
    from jsonl_ledger import append_row

    def prepared(where, log, train=b"\x01\x02"):
        bin_dir = tmp_path / where / "data" / "bin"
        bin_dir.mkdir(parents=True)
        for name, content in (("dict.en.txt", b"a 3\n"), ("dict.fr.txt", b"b 2\n"), ("train.en-fr.en.bin", train),
                              ("train.en-fr.en.idx", b"\x00"), ("preprocess.log", log)):
            (bin_dir / name).write_bytes(content)
        return str(bin_dir.parent)

    here = converged.prepared_fingerprint(prepared("a", b"Namespace(destdir='/a/data/bin')\n"))
    assert converged.prepared_fingerprint(prepared("b", b"Namespace(destdir='/b/data/bin')\n" * 2)) == here
    assert converged.prepared_fingerprint(prepared("c", b"", train=b"\x01\x03")) != here  # a split's content
    renamed = prepared("d", b"")
    os.rename(os.path.join(renamed, "bin", "dict.fr.txt"), os.path.join(renamed, "bin", "dict.de.txt"))
    assert converged.prepared_fingerprint(renamed) != here  # a file's name

    ledger = tmp_path / "ledger.jsonl"
    study = converged.Study(argparse.Namespace(ledger=str(ledger), workdir=str(tmp_path / "a"), prepared=None))
    study.data_fingerprint = here
    append_row(str(ledger), {"key": "attention.softmax.seed1", "data_sha256": "0" * 16})  # the first version's
    append_row(str(ledger), {"key": "attention.softmax.seed2", "data_fingerprint": here})
    append_row(str(ledger), {"key": "attention.softmax.seed3"})  # before any fingerprint
    study.check_ledger()
    said = [line for line in capsys.readouterr().out.splitlines() if "not checked against" in line]
    assert len(said) == 1 and "attention.softmax.seed1 (" in said[0]
    assert "seed2" not in said[0] and "seed3" not in said[0]
    append_row(str(ledger), {"key": "attention.softmax.seed4", "data_fingerprint": "1" * 16})
    with pytest.raises(SystemExit, match="other prepared data.*attention.softmax.seed4"):
        study.check_ledger()


def test_converged_study_reads_a_train_log_in_one_pass(tmp_path):
    """Validations, saved checkpoints, early stopping and the start's seconds from fairseq-train's own lines;
    a run resumed once has one log per start, and the report's wall time adds them up."""
    sys.path.insert(0, BENCH)
    import multi30k_converged as converged

    log = tmp_path / "train.1.log"
    log.write_text(
        "2026-11-23 23:22:50 | INFO | fairseq_cli.train | {'_name': None}\n"
        "  a continuation line with no timestamp\n"
        "2026-11-23 23:24:16 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 3.542 | bleu 52.33 | "
        "wps 811.1 | num_updates 50\n"
        "2026-11-23 23:24:17 | INFO | fairseq.checkpoint_utils | Saved checkpoint d/checkpoint_1_50.pt "
        "(epoch 1 @ 50 updates, score 52.33) (writing took 0.19 seconds)\n"
        "2026-11-23 23:30:01 | INFO | valid | epoch 002 | valid on 'valid' subset | loss 3.5 | bleu 52.1 | "
        "num_updates 100\n"
        "2026-11-24 00:01:00 | INFO | fairseq_cli.train | early stop since valid performance hasn't improved "
        "for last 5 runs\n")
    read = converged.TrainLog(str(log))
    assert read.curve == [{"epoch": 1, "updates": 50, "bleu": 52.33}, {"epoch": 2, "updates": 100, "bleu": 52.1}]
    assert read.saved == [50] and read.stopped_early
    assert read.seconds == 38 * 60 + 10  # across midnight
    empty = tmp_path / "train.2.log"
    empty.write_text("")
    assert converged.TrainLog(str(empty)).seconds == 0 and not converged.TrainLog(str(empty)).stopped_early
    assert converged.wall_seconds({"train_s": 5.0, "train_s_starts": [100.0, 7.0]}) == 107.0
    assert converged.wall_seconds({"train_s": 5.0}) == 5.0  # rows written before the field existed


def test_gpu_train_check_counts_an_abort_after_done_training_as_finished_and_any_other_failure_not(tmp_path):
    """Some GPU images abort every fairseq-train at interpreter exit, after its work is saved: that exit is
    reported (returned, for the table), not a failure; an abort before the marker, or any non-zero exit
    without it, still fails."""
    sys.path.insert(0, BENCH)
    import gpu_train_check

    marker = gpu_train_check.DONE_TRAINING
    log = str(tmp_path / "run.log")
    finished = [sys.executable, "-c", f"import os; print('{marker} 1.0 seconds', flush=True); os.abort()"]
    output, _, abort = gpu_train_check.run(finished, log, done_marker=marker)
    assert marker in output and abort == f"SIGABRT after {marker!r}"
    assert gpu_train_check.run([sys.executable, "-c", "print('ok')"], log, done_marker=marker)[2] is None
    with pytest.raises(RuntimeError, match="failed"):
        gpu_train_check.run([sys.executable, "-c", "import os; print('epoch 1', flush=True); os.abort()"], log,
                            done_marker=marker)
    with pytest.raises(RuntimeError, match=r"failed \(3\)"):  # an ordinary error exit, marker or not
        gpu_train_check.run([sys.executable, "-c", f"print('{marker}'); raise SystemExit(3)"], log,
                            done_marker=marker)
    with pytest.raises(RuntimeError, match="failed"):  # run without a shell: status 134 is an exit, not SIGABRT
        gpu_train_check.run([sys.executable, "-c", f"print('{marker}'); raise SystemExit(134)"], log,
                            done_marker=marker)
    with pytest.raises(RuntimeError, match="failed"):  # without a marker (generate) every abort fails
        gpu_train_check.run(finished, log)
