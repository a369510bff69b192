"""The studies' drivers and the one-off analyses (experiments/) run end to end on tiny data or a tiny checkpoint;
their figures come from real runs. The converged study's full run is marked slow; a fast sibling covers its
ledger, resumption, refusals and blind translations with one training run."""
import argparse
import builtins
import gzip
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from file_tree import snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(REPO, "experiments")
ANALYSIS = os.path.join(EXPERIMENTS, "soft_beam_analysis")
CONVERGED = os.path.join(EXPERIMENTS, "multi30k_converged", "driver.py")
SHORT = os.path.join(EXPERIMENTS, "multi30k_short", "driver.py")
TINY_RNNSEARCH = ("--encoder-embed-dim 8 --decoder-embed-dim 8 --encoder-hidden-size 8 --decoder-hidden-size 8 "
                  "--attention-dim 8 --maxout-dim 8")


def load(name, path):
    """The script at ``path`` imported as module ``name`` (the two drivers share a file name)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def script(path, *args, timeout=600):
    out = subprocess.run([sys.executable, path, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def table(stdout):
    """The markdown table rows of ``stdout`` (header first), cells stripped."""
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in stdout.splitlines()
            if line.startswith("| ") and "---" not in line]


# ----------------------------------------------------------------------------- the one-off analyses ----

def test_perturbed_gradient_variance_prints_its_table():
    out = script(os.path.join(EXPERIMENTS, "perturbed_gradient_variance.py"), "--shapes", "generic", "--samples", "2",
                 "--seeds", "3", "--threads", "1")
    rows = table(out)
    assert len(rows) == 1 + 2 * 2 + 1, out  # header, (unsorted, sorted) x control variate, criterion
    assert rows[-1][0].startswith("soft_beam_search L_SOFT")
    cosines = [float(row[-1]) for row in rows[1:]]
    assert all(-1 <= c < 1 for c in cosines)  # a Monte-Carlo estimate: never exactly the same over seeds


def test_softmax_k_times_regression_compares_with_a_git_revision(tmp_path):
    out = script(os.path.join(EXPERIMENTS, "softmax_k_times_regression.py"), "--against", "HEAD", "--shapes", "4x30",
                 "2x7", "--repeats", "1", "--threads", "1", "--json", tmp_path / "rows.jsonl")
    rows = table(out)
    assert [row[0] for row in rows[1:]] == ["4x30", "2x7"] and all(float(row[4]) > 0 for row in rows[1:]), out
    with open(tmp_path / "rows.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [(r["row"], r["baseline"]["row"], r["shape"]) for r in records] == [("this", "HEAD", "4x30"),
                                                                                ("this", "HEAD", "2x7")]


@pytest.mark.parametrize("backends", [[], ["--backends", "triton", "torch"]])  # Triton: the interpreter here
def test_unsorted_any_k_prints_its_table(backends, tmp_path):
    out = script(os.path.join(EXPERIMENTS, "unsorted_any_k.py"), "--rows", "4", "--n", "120", "--ks", "5", "60",
                 "119", "--peer-repeats", "2", "--threads", "1", *backends, "--json", tmp_path / "rows.jsonl")
    rows = table(out)
    assert [r[0] for r in rows[1:]] == ["5", "60", "119"], out
    converged = [c for r in rows[1:] for c, name in zip(r, rows[0]) if name.endswith("converged")]
    assert converged == ["100%"] * 6, out  # both backends, every k (k = n - 1 included)
    with open(tmp_path / "rows.jsonl") as f:
        records = [json.loads(line) for line in f]
    first = backends[1] if backends else "cpu"
    assert {r["shape"] for r in records} == {"4x120 k 5", "4x120 k 60", "4x120 k 119"}
    assert all(r["baseline"] is None if r["row"] == first else r["baseline"]["row"] == first for r in records)


def test_recording_relaxation_sees_every_step_and_changes_nothing():
    """The analyses' recording SOFT top-k, passed to the search as its relaxation, computes what the search's own
    computes (the same output) and records one call per decoding step; with a backend, it solves there."""
    sys.path.insert(0, ANALYSIS)
    import torch
    from checkpoint import RecordingSoftTopK, search
    from tiny_models import batch, build, dictionary

    d = dictionary(12)
    model, sample = build("lstm", d, dtype=torch.float32).eval(), batch(d, tgt_lens=(5, 4, 6))
    with torch.no_grad():
        plain = search(model, sample, d, beam=3, relaxation="soft_topk", epsilon=0.5, scaling="none")
        recording = RecordingSoftTopK(3, 0.5, "none", backend="torch")
        recorded = search(model, sample, d, beam=3, relaxation=recording)
    assert torch.equal(plain.hypotheses, recorded.hypotheses)
    assert torch.allclose(plain.nll, recorded.nll, atol=1e-5)
    assert len(recording.calls) == sample["target"].shape[1] - 1  # the last step has no relaxed top-k
    kept, A = recording.calls[0]
    assert A.shape == (*kept.shape, 3) and torch.allclose(recording.solve(kept, "torch"), A)


@pytest.fixture(scope="module")
def tiny_checkpoint(toy_data_bin, tmp_path_factory):
    from fairseq_cli import USER_DIR, fairseq, tiny_arch

    save = tmp_path_factory.mktemp("analysis_checkpoint")
    fairseq("train", toy_data_bin, "--user-dir", USER_DIR, "--cpu", "--seed", "1", *tiny_arch("lstm"),
            "--optimizer", "adam", "--lr", "0.005", "--max-tokens", "400", "--max-update", "2", "--save-dir", save,
            "--no-epoch-checkpoints", "--num-workers", "0", "--required-batch-size-multiple", "1")
    return save / "checkpoint_last.pt"


@pytest.mark.parametrize("name,args", [
    ("grad_norms.py", ["--eval-mode"]),
    ("duplicates.py", ["--beam", "2"]),
    ("backend_drift.py", ["--beam", "2"]),
])
def test_checkpoint_analyses_print_their_tables(tiny_checkpoint, toy_data_bin, name, args):
    out = script(os.path.join(ANALYSIS, name), tiny_checkpoint, toy_data_bin, "--max-tokens", "200", "--candidates",
                 "10", *args)
    rows = table(out)
    if name == "grad_norms.py":  # teacher forcing + one row per setting, finite figures
        grad_norms = load("grad_norms", os.path.join(ANALYSIS, "grad_norms.py"))
        assert len(rows) == 2 + len(grad_norms.SETTINGS), out
        assert all(float(cell) < float("inf") for row in rows[1:] for cell in row[1:]), out
    elif name == "duplicates.py":  # 2 scalings x 2 bookkeepings, "d / n" with n > 0
        assert len(rows) == 5 and all(int(row[2].split("/")[1]) > 0 for row in rows[1:]), out
    else:  # one row per decoding step; step 0 sees the same scores in both runs
        assert len(rows) >= 3 and float(rows[1][1]) == 0.0, out
        assert all(float(row[3]) < 1e-4 for row in rows[1:]), out  # the solvers agree on the same scores


def test_pruning_analysis_compares_every_m_with_the_exact_search(tiny_checkpoint, toy_data_bin, tmp_path):
    script(os.path.join(ANALYSIS, "pruning.py"), tiny_checkpoint, toy_data_bin, "--max-tokens", "200", "--batches", "1",
           "--beam", "2", "--candidates", "4", "20", "0", "--json", tmp_path / "rows.jsonl")
    with open(tmp_path / "rows.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [(r["setting"], r["candidates"]) for r in rows] == [
        ("paper", 4), ("paper", 20), ("paper", 0), ("topk_nats", 4), ("topk_nats", 20), ("topk_nats", 0)]
    exact = [r for r in rows if r["candidates"] == 0]
    assert all(r["grad_cosine"] == pytest.approx(1.0) and r["pruned_mass"] == 0 for r in exact)
    assert all(-1 <= r["grad_cosine"] <= 1 + 1e-9 and 0 <= r["duplicate_rate"] <= 1 for r in rows)
    assert any(r["pruned_mass"] > 0 for r in rows if r["candidates"] == 4)  # M 4 of 2 x V prunes something


def test_experiments_import_libraries_not_other_scripts():
    """A script in experiments/ (a file with a ``__main__`` block) imports libraries -- experiments/ledger.py,
    multi30k_converged/tuning.py, soft_beam_analysis/checkpoint.py, benchmarks/harness.py and training_step.py --,
    never another script."""
    sources = {}
    for root, _, names in os.walk(EXPERIMENTS):
        for name in (n for n in names if n.endswith(".py")):
            with open(os.path.join(root, name), encoding="utf-8") as f:
                sources[os.path.join(root, name)] = f.read()
    scripts = {os.path.splitext(os.path.basename(path))[0] for path, text in sources.items()
               if '__name__ == "__main__"' in text}
    scripts |= {"bench_soft_topk", "bench_soft_beam", "bench_topk_attention"}
    assert {"driver", "pruning", "unsorted_any_k"} <= scripts and not {"ledger", "tuning", "checkpoint"} & scripts
    for path, text in sources.items():
        imported = set(re.findall(r"^\s*(?:from|import) (\w+)", text, flags=re.M))
        assert not imported & scripts, (path, imported & scripts)


# ------------------------------------------------------------------------------- the short study ----

def test_short_study_reports_and_plots_recorded_runs(tmp_path):
    study = load("multi30k_short_driver", SHORT)
    work = tmp_path / "study"
    work.mkdir()
    paper = ["--cpu", *study.PAPER]
    assert "--soft-beam-epsilon" in study.PAPER and "--soft-topk-epsilon" not in study.PAPER
    rows = [("tf.seed1", "tf", [], {"valid": 40.0, "test": 41.0}),
            ("tf.seed2", "tf", [], {"valid": 42.0, "test": 43.0}),
            ("soft_beam.seed1", "soft_beam", paper, {"valid": 39.0, "test": 40.0}),
            ("soft_beam_eps1.seed1", "soft_beam_eps1", paper + ["--soft-beam-epsilon", "1"], {"valid": 38.0}),
            # a row recorded before the flags were renamed: its arguments keep their old names
            ("soft_beam_eps0.01.seed1", "soft_beam_eps0.01", ["--cpu", "--soft-topk-epsilon", "0.01"],
             {"valid": 30.0})]
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
                             "bleu": {"valid": 39.5}, "extra": paper + ["--soft-beam-epsilon", "1"]})
    results = study.load_results(str(work))
    assert results["soft_beam_eps1.seed1"]["bleu"] == {"valid": 39.5}  # the later row of a key wins
    assert study.best_sweep_run(results, ["soft_beam_eps1", "soft_beam_rho0.5"], seed=1) == "soft_beam_eps1"
    assert study.best_sweep_run(results, ["soft_beam_eps1"], seed=2) is None  # not run at that seed
    study.record(str(work), {"key": "soft_beam_eps1.seed1", "group": "soft_beam_eps1", "train_s": 10.0,
                             "bleu": {"valid": 38.0}, "extra": paper + ["--soft-beam-epsilon", "1"]})
    table_ = study.report(type("A", (), {"workdir": str(work)}))
    assert "| tf | 2 | 41.00 ± 1.41 | 42.00 ± 1.41 | 2.724 | 10 |" in table_
    assert "| soft_beam_eps1 | 1 | 38.00 | - | 2.724 | 10 |" in table_
    assert "| soft_beam_eps1 | 38.00 | 2.724 | 0.873 / 30 % | 5.6 | 5 |" in table_  # seed-1 details from the log
    assert study.last_value(paper + ["--soft-beam-epsilon", "1"], "--soft-beam-epsilon") == "1"
    assert study.last_value(["--soft-topk-epsilon", "3", "--soft-beam-epsilon", "2"], study.EPSILON_FLAGS) == "2"
    assert study.last_value(["--soft-beam-epsilon", "2", "--soft-topk-epsilon", "3"], study.EPSILON_FLAGS) == "3"
    assert study.training_curve(str(work / "checkpoints" / "tf.seed1" / "train.log"), "nll_loss") == [
        (50, 6.311), (100, 5.5)]
    study.main(["plot", "--workdir", str(work), "--out", str(tmp_path / "fig")])
    assert sorted(os.listdir(tmp_path / "fig")) == ["multi30k_bleu_vs_epsilon.png", "multi30k_training_curves.png"]


def test_short_study_runs_the_recipe_with_the_criterions_current_flags():
    """Every argument list the short study hands the recipe names the criterion's and the attention's flags and
    values of this version (the old names still work, but warn)."""
    from fairseq import options

    import softtopk_fairseq.fairseq_plugin  # noqa: F401

    study = load("multi30k_short_driver", SHORT)
    sweep = study.sweep_runs(argparse.Namespace(sweep_epsilon=[0.01], sweep_rho=[0.5], sweep_beam=[3],
                                                sweep_candidates=[200], sweep_max_iter=[1], sweep_bookkeeping=True))
    for extra in [*study.FINETUNE_RUNS.values(), *sweep.values()]:
        assert not {"--soft-topk-epsilon", "--soft-topk-scaling", "--soft-topk-method"} & set(extra), extra
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, ["data", "--user-dir", os.path.join(REPO, "user_dir"), "--arch",
                                                    "rnnsearch", "--criterion", "soft_beam_search", *extra])
        assert args.soft_topk_method is None and args.soft_topk_epsilon is None
    for mode, extra in study.ATTENTION.items():  # (--update2lr, the recipe's schedule, is train.sh's to parse)
        args = options.parse_args_and_arch(options.get_training_parser(), [
            "data", "--user-dir", os.path.join(REPO, "user_dir"), *study.TRANSFORMER[:study.TRANSFORMER.index("--lr")],
            *extra])
        assert str(args.topk_attn_mode) == mode


# ----------------------------------------------------------------------------- the converged study ----

def fake_raw_data(path):
    """A raw data folder whose target language can be read (train.en, train.fr), for the driver's pure logic."""
    path.mkdir(parents=True, exist_ok=True)
    for lang in ("en", "fr"):
        (path / f"train.{lang}").write_text("a\n")
    return str(path)


def _flags(arguments):
    """``{flag: its values}`` of a fairseq command line (a positional argument under ``""``)."""
    flags, flag = {}, ""
    for argument in arguments:
        if argument.startswith("--"):
            flag = argument
            flags[flag] = []
        else:
            flags.setdefault(flag, []).append(argument)
    return flags


def test_the_attention_recipe_documented_is_the_one_the_converged_study_runs(tmp_path):
    """docs/topk_attention.md's recipe (SOFT top-k, seed 1) is the driver's command for that arm, less the
    driver's device, saving and logging flags (the recipe once lacked --required-batch-size-multiple 1, which
    changes the batches)."""
    from readme_examples import fairseq_commands

    converged = load("multi30k_converged_driver", CONVERGED)
    args = converged.parser().parse_args(["run", "--data", fake_raw_data(tmp_path / "raw"), "--workdir",
                                          str(tmp_path)])
    study = converged.Study(args)
    driver = _flags(study.train_args(str(tmp_path / "save"), study.attention_args("soft_topk"), 1))
    recipes = [arguments for _, _, arguments in fairseq_commands(["docs/topk_attention.md"])
               if "--seed" in arguments]
    assert len(recipes) == 1, recipes
    documented = _flags(recipes[0])
    assert documented.pop("") == ["data-bin"] and documented.pop("--user-dir") and driver.pop("--user-dir")
    assert driver.pop("") == [os.path.join(study.data, "bin")]
    for own in ("--save-dir", "--cpu", "--num-workers", "--no-epoch-checkpoints", "--save-interval-updates", "--log-format",
                "--log-interval"):
        driver.pop(own)
    assert documented == driver


def test_converged_study_picks_the_sweeps_best_on_val_once_the_sweep_is_complete(tmp_path, capsys):
    converged = load("multi30k_converged_driver", CONVERGED)
    from ledger import append_row, rows_by_key

    ledger = tmp_path / "ledger.jsonl"
    args = argparse.Namespace(ledger=str(ledger), workdir=str(tmp_path), prepared=None, sweep_seed=2, seeds=[1, 2, 3],
                              data=fake_raw_data(tmp_path / "raw"), blind=None)
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


def tune_study(tmp_path, converged, **kwargs):
    """A converged Study whose training is faked: ``trained`` lists (key, extra, fields) and each run is recorded
    with the val BLEU ``val(key)`` gives; every seed's pre-training is in place as ``pretrain.rnnsearch.seedN``."""
    from ledger import append_row, rows_by_key

    ledger = tmp_path / "ledger.jsonl"
    args = argparse.Namespace(**{**dict(
        ledger=str(ledger), workdir=str(tmp_path / "work"), prepared=None, sweep_seed=None, seeds=[1, 2],
        data=fake_raw_data(tmp_path / "raw"), blind=None, retrain_missing=False, tune_lrs=[1e-3, 5e-4],
        tune_runs=list(converged.TUNE_RUNS), tune_patience=5, tune_max_epoch=30, tune_candidates=50, lr_patience=1,
        patience=5, max_epoch=60), **kwargs})
    study = converged.Study(args)
    trained, val = [], {}

    def train(key, stage, arch, method, seed, extra, save_as=None, fields=None):
        if key in rows_by_key(str(ledger)):  # (as Study.train: a recorded run is skipped)
            return
        trained.append((key, extra, fields))
        append_row(str(ledger), {"key": key, "stage": stage, "method": method, "seed": seed, **fields,
                                 "bleu": {"valid": val.get(key, 50.0), "test": 0.0}})

    for seed in args.seeds:
        key = f"pretrain.rnnsearch.seed{seed}"
        save = tmp_path / "work" / "checkpoints" / key
        save.mkdir(parents=True)
        (save / "checkpoint_best.pt").write_bytes(b"")
        (save / converged.RECORDED_AS).write_text(key + "\n")
        append_row(str(ledger), {"key": key, "stage": "pretrain", "seed": seed, "bleu": {"valid": 1.0, "test": 1.0}})
    study.train = train
    return study, trained, val


def test_converged_study_tunes_every_arm_at_the_rate_the_control_chose_on_one_seed(tmp_path, capsys):
    """Stage ``tune``: on the sweep seed the control runs at every candidate rate first; the rate of its best val
    BLEU (the earlier on a tie) is every arm's, on every seed; a seed before the choice is skipped; each run restarts
    from its seed's recorded pre-training under the convergence rule with its own patience and cap, the soft ones
    with 50 candidates, and its row names its start and rate."""
    converged = load("multi30k_converged_driver", CONVERGED)
    study, trained, val = tune_study(tmp_path, converged, sweep_seed=1)
    study.tune(2)  # the rate is not chosen yet: nothing trained
    assert trained == [] and "not all in the ledger yet" in capsys.readouterr().out
    val.update({"tune.tf.lr0.001.seed1": 50.5, "tune.tf.lr0.0005.seed1": 50.9})
    study.tune(1)
    assert [key for key, _, _ in trained] == ["tune.tf.lr0.001.seed1", "tune.tf.lr0.0005.seed1",
                                              "tune.soft_beam_paper.lr0.0005.seed1",
                                              "tune.soft_beam_rho05.lr0.0005.seed1"]
    # Invoked later for the other seeds only (the first named is then the sweep seed): the rate stays seed 1's,
    # which the ledger shows ran the control at every rate -- seed 2's control runs once, at the chosen rate.
    study.args.seeds, study.args.sweep_seed = [2], None
    assert converged.rate_seed({}, 2) == 2 and converged.rate_seed(converged.rows_by_key(study.ledger), 2) == 1
    study.tune(2)
    assert [key for key, _, _ in trained[4:]] == [f"tune.{name}.lr0.0005.seed2" for name in converged.TUNE_RUNS]
    start = str(tmp_path / "work" / "checkpoints" / "pretrain.rnnsearch.seed2" / "checkpoint_best.pt")
    for key, extra, fields in trained[4:]:
        assert fields == {"start": "pretrain.rnnsearch.seed2", "lr": 5e-4}
        flag = lambda name: extra[len(extra) - 1 - extra[::-1].index(name) + 1]  # noqa: E731 (the last value wins)
        assert flag("--finetune-from-model") == start and flag("--lr") == "0.0005"
        assert flag("--lr-scheduler") == "reduce_lr_on_plateau_resumable" and flag("--patience") == "5"
        assert flag("--max-epoch") == "30" and "--validate-interval-updates" not in extra
        assert flag("--soft-beam-candidates") == ("0" if ".tf." in key else "50")
        assert flag("--teacher-forcing-ratio") == {"tf": "1.0", "soft_beam_paper": "0.8",
                                                   "soft_beam_rho05": "0.5"}[key.split(".")[1]]
    rows = {key: {"bleu": {"valid": 51.0}} for key in ("tune.tf.lr0.001.seed1", "tune.tf.lr0.0005.seed1")}
    assert converged.tune_lr_choice(rows, [1e-3, 5e-4], 1) == 1e-3  # a tie: the earlier rate
    assert converged.tune_lr_choice(rows, [1e-3, 5e-4, 2e-3], 1) is None  # not every rate run yet


def test_converged_study_uses_a_checkpoint_folder_only_for_the_recorded_run_it_holds(tmp_path, capsys):
    """A pre-training's folder counts only when its ``ledger_key`` names a recorded run; else (gone, or a
    retraining interrupted before it was recorded) ``--retrain-missing`` trains -- or continues -- the next rerun
    key, ``.rerun`` then ``.rerun2``, and without the flag nothing is trained."""
    converged = load("multi30k_converged_driver", CONVERGED)
    study, trained, _ = tune_study(tmp_path, converged)
    save = tmp_path / "work" / "checkpoints" / "pretrain.rnnsearch.seed1"
    assert study.pretrained(1) == str(save / "checkpoint_best.pt")
    from ledger import append_row

    append_row(study.ledger, {"key": "pretrain.rnnsearch.seed1.rerun", "stage": "rerun", "seed": 1})
    (save / converged.RECORDED_AS).unlink()  # a retraining in flight: checkpoints, no record
    assert study.pretrained(1) is None and "--retrain-missing" in capsys.readouterr().out and trained == []
    study.args.retrain_missing = True
    study.pretrain = lambda seed, key=None: (trained.append(key), (save / converged.RECORDED_AS).write_text(key))
    assert study.pretrained(1) == str(save / "checkpoint_best.pt") and trained == ["pretrain.rnnsearch.seed1.rerun2"]
    assert list(itertools.islice(converged.rerun_keys("k"), 3)) == ["k.rerun", "k.rerun2", "k.rerun3"]

    # Another workdir: the newest recorded pre-training's copy kept beside the ledger is used, not trained again
    append_row(study.ledger, {"key": "pretrain.rnnsearch.seed1.rerun2", "stage": "rerun", "seed": 1})
    shutil.rmtree(tmp_path / "work")
    kept = tmp_path / "ledger.starts" / "pretrain.rnnsearch.seed1.rerun2.pt"
    kept.parent.mkdir()
    kept.write_bytes(b"weights")
    path = study.pretrained(1)
    assert trained == ["pretrain.rnnsearch.seed1.rerun2"] and open(path, "rb").read() == b"weights"
    assert converged.recorded_as(os.path.dirname(path)) == "pretrain.rnnsearch.seed1.rerun2"


def test_converged_study_keeps_a_start_without_its_optimizer_state(tmp_path):
    """keep_start: the fairseq checkpoint as it was, but for its optimizer state (which a fine-tuning resets)."""
    import torch

    converged = load("multi30k_converged_driver", CONVERGED)
    state = {"cfg": {"model": "rnnsearch"}, "model": {"w": torch.arange(4.0)}, "extra_state": {"epoch": 3},
             "last_optimizer_state": {"state": {0: {"exp_avg": torch.ones(4)}}}}
    torch.save(state, tmp_path / "best.pt")
    converged.keep_start(str(tmp_path / "best.pt"), str(tmp_path / "starts" / "k.pt"))
    kept = torch.load(tmp_path / "starts" / "k.pt", weights_only=False)
    assert kept["last_optimizer_state"] is None and torch.equal(kept["model"]["w"], state["model"]["w"])
    assert kept["cfg"] == state["cfg"] and kept["extra_state"] == state["extra_state"]


def test_converged_study_fingerprints_the_prepared_data_not_where_it_was_prepared(tmp_path, capsys):
    """The ledger's data fingerprint covers the dictionaries and binarised splits, names and contents, and not
    fairseq-preprocess's log (its arguments, with the workdir's absolute paths): the same data prepared in two
    folders has one fingerprint. Rows of the first version (data_sha256, log included) are named, not refused."""
    converged = load("multi30k_converged_driver", CONVERGED)
    from ledger import append_row

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
    study = converged.Study(argparse.Namespace(ledger=str(ledger), workdir=str(tmp_path / "a"), prepared=None,
                                               data=fake_raw_data(tmp_path / "raw"), blind=None))
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
    """Validations, saved checkpoints, early stopping and the start's seconds from fairseq-train's own lines; a run
    resumed once has one log per start, its validations a curve without the ones a restart repeated, and the
    report's wall time adds them up."""
    converged = load("multi30k_converged_driver", CONVERGED)
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
    assert read.code is None  # a log without the line the driver begins it with
    assert read.curve == [{"epoch": 1, "updates": 50, "bleu": 52.33}, {"epoch": 2, "updates": 100, "bleu": 52.1}]
    assert read.saved == [50] and read.stopped_early
    assert read.seconds == 38 * 60 + 10  # across midnight
    empty = tmp_path / "train.2.log"
    empty.write_text("")
    assert converged.TrainLog(str(empty)).seconds == 0 and not converged.TrainLog(str(empty)).stopped_early
    headed = tmp_path / "train.5.log"
    headed.write_text(converged.TrainLog.CODE_LINE.format("0123abc+uncommitted") + log.read_text())
    assert converged.TrainLog(str(headed)).code == "0123abc+uncommitted"
    assert converged.TrainLog(str(headed)).curve == read.curve
    # A start stopped after its validation at update 150, before saving it: the restart from update 100 repeats it.
    stopped, restarted = tmp_path / "train.3.log", tmp_path / "train.4.log"
    stopped.write_text("2026-11-24 01:00:00 | INFO | valid | epoch 003 | valid on 'valid' subset | bleu 52.5 | "
                       "num_updates 150\n")
    restarted.write_text("2026-11-24 02:00:00 | INFO | valid | epoch 003 | valid on 'valid' subset | bleu 52.4 | "
                         "num_updates 150\n")
    starts = [converged.TrainLog(str(path)) for path in (log, empty, stopped, restarted)]
    assert [(p["updates"], p["bleu"]) for p in converged.run_curve(starts)] == [(50, 52.33), (100, 52.1), (150, 52.4)]
    sys.path.insert(0, os.path.dirname(CONVERGED))
    import report
    assert report.wall_seconds({"train_s": 5.0, "train_s_starts": [100.0, 7.0]}) == 107.0
    assert report.wall_seconds({"train_s": 5.0}) == 5.0  # rows written before the field existed


def test_a_runs_code_commit_is_its_snapshots_file_or_gits_head_marked_when_a_tracked_file_changed(tmp_path):
    """code_commit: a snapshot's COMMIT file (background.sh writes one: a snapshot has no git history); else git's
    HEAD, ``+uncommitted`` when a tracked file differs from it (untracked files do not count); else None."""
    converged = load("multi30k_converged_driver", CONVERGED)
    snapshot_dir, repo, plain = tmp_path / "snapshot", tmp_path / "repo", tmp_path / "plain"
    for folder in (snapshot_dir, repo, plain):
        folder.mkdir()
    (snapshot_dir / converged.COMMIT_FILE).write_text("feedc0de\n")
    assert converged.code_commit(str(snapshot_dir)) == "feedc0de"
    assert converged.code_commit(str(plain)) is None
    git = lambda *args: subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                                       check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (repo / "tracked.py").write_text("a = 1\n")
    git("add", "tracked.py")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    (repo / "untracked.py").write_text("b = 2\n")
    assert converged.code_commit(str(repo)) == head
    (repo / "tracked.py").write_text("a = 2\n")
    assert converged.code_commit(str(repo)) == head + "+uncommitted"


def test_converged_study_trains_with_the_criterions_current_flags():
    """Every fine-tuning and attention arm names the flags and values of this version; the ledger's rows keep
    the arguments they were trained with (the en-fr ledger's older rows: the old names, which still parse)."""
    from fairseq import options

    import softtopk_fairseq.fairseq_plugin  # noqa: F401

    converged = load("multi30k_converged_driver", CONVERGED)
    old = {"--soft-topk-epsilon", "--soft-topk-scaling", "--soft-topk-method", "--perturbed-sigma"}
    for name, extra in converged.FINETUNE_RUNS.items():
        assert not old & set(extra), name
        args = options.parse_args_and_arch(options.get_training_parser(), [
            "data", "--user-dir", os.path.join(REPO, "user_dir"), *converged.RNNSEARCH, "--criterion",
            "soft_beam_search", *extra])
        assert str(args.soft_beam_relaxation) == {"softmax_k_times": "softmax_k_times", "perturbed": "perturbed"}.get(
            name, "soft_topk") and args.soft_topk_method is None
    for mode, extra in converged.ATTENTION.items():
        args = options.parse_args_and_arch(options.get_training_parser(), [
            "data", "--user-dir", os.path.join(REPO, "user_dir"), *converged.TRANSFORMER, *extra])
        assert str(args.topk_attn_mode) == mode.split("_patience")[0].removesuffix("_64")
        assert str(args.topk_attn_inference) in ("same", "hard_topk")
    ledger = os.path.join(EXPERIMENTS, "multi30k_converged", "en_fr.jsonl")
    with open(ledger, encoding="utf-8") as f:
        recorded = [json.loads(line) for line in f]
    assert recorded and all(r["pair"] == "en-fr" for r in recorded if "pair" in r)
    assert os.path.isdir(converged.hyps_dir(ledger)) and converged.hyps_dir(ledger).endswith("en_fr.hyps")


def blind_sources(path, lines):
    """A blind test folder: ``news.en``, English sources without references."""
    from softtopk_fairseq.pipeline import toy_corpus

    path.mkdir()
    toy_corpus.write_split(str(path / "tmp"), lines, 7)
    os.rename(path / "tmp.en", path / "news.en")
    os.remove(path / "tmp.fr")
    return path


def toy_raw_data(path):
    from softtopk_fairseq.pipeline import toy_corpus

    path.mkdir()
    for split, n, seed in (("train", 120, 1), ("val", 10, 2), ("test_2016_flickr", 8, 3)):
        toy_corpus.write_split(str(path / split), n, seed)
    return path


def lines_of_gzip(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def report_reading_nothing_from(blind_dir, argv, monkeypatch):
    """The converged driver's ``report`` run in this process, and every path it opened or listed; fails if one of
    them is under ``blind_dir``."""
    converged = load("multi30k_converged_driver", CONVERGED)
    touched = []
    real_open, real_listdir = builtins.open, os.listdir

    def traced_open(file, *args, **kwargs):
        touched.append(os.fspath(file) if isinstance(file, (str, os.PathLike)) else str(file))
        return real_open(file, *args, **kwargs)

    def traced_listdir(path="."):
        touched.append(os.fspath(path))
        return real_listdir(path)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", traced_open)
        m.setattr(os, "listdir", traced_listdir)
        converged.main(["report", *argv])
    assert touched and not [p for p in touched if os.path.abspath(p).startswith(str(blind_dir))], touched
    return touched


def test_converged_study_records_resumes_refuses_and_translates_the_blind_sets(tmp_path, capsys, monkeypatch):
    """The converged driver's ledger logic with one training run: a tiny pre-training is trained, scored and
    recorded, its hypotheses kept beside the ledger and the blind sources (``--blind``) translated into
    LEDGER.blind/KEY.NAME.TGT.gz, one line per source line; a second ``run`` skips it; other inputs, missing
    inputs or a ledger of other data stop the driver before it trains or writes anything; a pre-training in the
    ledger whose workdir is gone is not trained again unless asked; ``report`` reads the ledger and never the
    blind translations."""
    data, blind = toy_raw_data(tmp_path / "raw"), blind_sources(tmp_path / "blind", 3)
    ledger = tmp_path / "ledger.jsonl"
    common = ["--data", str(data), "--workdir", str(tmp_path / "work"), "--ledger", str(ledger), "--bpe-size", "90",
              "--seeds", "1", "--max-epoch", "1", "--patience", "1", "--blind", str(blind)]

    def driver(*args):
        return script(CONVERGED, *args, timeout=900)

    driver("run", *common, "--stages", "pretrain", "--extra-args", TINY_RNNSEARCH)
    with open(ledger) as f:
        rows = [json.loads(line) for line in f]
    key = "pretrain.rnnsearch.seed1"
    assert [r["key"] for r in rows] == [key] and rows[0]["pair"] == "en-fr" and len(rows[0]["data_fingerprint"]) == 16
    assert set(rows[0]["bleu"]) == {"valid", "test"} and rows[0]["epochs"] == 1 and rows[0]["converged"] is False
    for subset in ("valid", "test"):
        assert lines_of_gzip(tmp_path / "ledger.hyps" / f"{key}.{subset}.fr.gz") == \
            (tmp_path / "work" / "checkpoints" / key / "best_scored" / f"{subset}.beam5.fr").read_text().splitlines()
    blind_out = tmp_path / "ledger.blind"
    assert os.listdir(blind_out) == [f"{key}.news.fr.gz"]
    assert os.listdir(tmp_path / "ledger.starts") == [f"{key}.pt"]  # the checkpoint kept for fine-tunings
    assert len(lines_of_gzip(blind_out / f"{key}.news.fr.gz")) == 3  # one hypothesis per source line

    again = driver("run", *common, "--stages", "pretrain", "--extra-args", TINY_RNNSEARCH)
    assert f"{key}: in the ledger, skipped" in again

    def refused(data_dir, ledger_path, expected):
        args = ["run", *common, "--stages", "pretrain", "--extra-args", TINY_RNNSEARCH]
        args[args.index("--data") + 1], args[args.index("--ledger") + 1] = str(data_dir), str(ledger_path)
        before, ledger_before = snapshot(tmp_path / "work"), ledger.read_text()
        out = subprocess.run([sys.executable, CONVERGED, *args], capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and expected in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
        assert snapshot(tmp_path / "work") == before and ledger.read_text() == ledger_before

    other = tmp_path / "other"
    shutil.copytree(data, other)
    with open(other / "train.en", "a") as f:
        f.write("one more line\n")
    refused(other, ledger, "differs (train.en)")
    (other / "val.fr").unlink()
    refused(other, ledger, "lacks val.fr")
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({**rows[0], "key": "attention.softmax.seed9", "data_fingerprint": "0" * 16}) + "\n")
    refused(data, foreign, "other prepared data")

    # Another workdir's ledger: the checkpoints are gone, the ledger and the kept hypotheses are not (nor, here,
    # the checkpoint kept beside the ledger, which would be used instead: test_converged_study_uses_a_checkpoint_...)
    shutil.rmtree(tmp_path / "work" / "checkpoints")
    shutil.rmtree(tmp_path / "ledger.starts")
    skipped = driver("run", *common, "--stages", "finetune", "--runs", "tf", "--extra-args", TINY_RNNSEARCH)
    assert "is in the ledger but" in skipped and "--retrain-missing" in skipped
    with open(ledger) as f:
        assert len(f.readlines()) == 1

    capsys.readouterr()
    report_reading_nothing_from(blind_out, ["--pair", str(ledger), str(data)], monkeypatch)
    page = capsys.readouterr().out
    # its convergence row, from the ledger alone: seed 1, best epoch / stopped at, training hours
    assert re.search(r"\| teacher_forcing \| en-fr \| 1 \| s1 1 / 1 \| s1 \d+\.\d \| 0/1 \|", page), page
    assert "- **Top-k attention, en-fr**: not measured yet." in page  # no claim without runs


def test_converged_study_carries_a_run_in_flight_to_another_machine(tmp_path):
    """``carry`` keeps a run in flight beside the ledger (a run whose best checkpoint is its last carries one
    checkpoint); ``run`` in a workdir without its checkpoints restores it, continues from its last epoch -- one
    log per start, the carried epoch's validation in the row's curve, each start's commit -- and removes it once the
    row is recorded."""
    converged = load("multi30k_converged_driver", CONVERGED)
    data = toy_raw_data(tmp_path / "raw")
    ledger = tmp_path / "ledger.jsonl"
    common = ["--data", str(data), "--workdir", str(tmp_path / "work"), "--ledger", str(ledger), "--bpe-size", "90",
              "--seeds", "1", "--max-epoch", "2", "--patience", "2", "--stages", "pretrain"]
    key = "pretrain.rnnsearch.seed1"
    save, carried = tmp_path / "work" / "checkpoints" / key, tmp_path / "ledger.carried" / key
    # A run stopped after its first epoch (--max-epoch 1 last wins), its record taken back: a run in flight.
    script(CONVERGED, "run", *common, "--extra-args", TINY_RNNSEARCH + " --max-epoch 1", timeout=900)
    ledger.write_text("")
    (save / "ledger_key").unlink()
    shutil.rmtree(tmp_path / "ledger.starts")
    said = script(CONVERGED, "carry", *common)
    assert f"{key}: carried at update" in said and "1 run(s) in flight carried" in said
    assert sorted(os.listdir(carried)) == ["carried_at", "checkpoint_last.pt.planes.zlib.part000",
                                           *(name for name in sorted(os.listdir(save)) if name.startswith("train."))]
    shutil.rmtree(tmp_path / "work" / "checkpoints")  # another machine (the prepared data kept: no need to redo it)

    out = script(CONVERGED, "run", *common, "--extra-args", TINY_RNNSEARCH, timeout=900)
    assert f"{key}: restoring the run carried in {carried}" in out and f"{key}: continuing from" in out
    with open(ledger) as f:
        row, = [json.loads(line) for line in f]
    assert row["key"] == key and row["resumed"] and len(row["train_s_starts"]) == 2
    assert row["code_starts"] == [converged.code_commit(REPO)] * 2  # each start's commit, from its log
    assert [p["epoch"] for p in row["val_curve"]] == [1, 2] and row["epochs"] == 2
    assert not carried.exists() and os.listdir(tmp_path / "ledger.starts") == [f"{key}.pt"]
    assert "0 run(s) in flight carried" in script(CONVERGED, "carry", *common)


def test_the_studys_background_script_runs_the_driver_on_the_pairs_paths_and_carries(tmp_path):
    """background.sh: ``start`` runs the driver's ``run`` from the snapshot on the pair's data, blind sources and
    ledger, resumable (--retrain-missing) and niced; ``carry`` with nothing running runs the driver's ``carry`` on the
    same paths; a verb it does not know is refused."""
    background = os.path.join(EXPERIMENTS, "multi30k_converged", "background.sh")
    shared = tmp_path / "shared"
    (shared / "data" / "blind").mkdir(parents=True)
    toy_raw_data(shared / "data" / "multi30k_en_de")
    env = dict(os.environ, SOFTTOPK_SHARED=str(shared), PAIR="de", SEEDS="2", BACKGROUND_DRY_RUN="1")
    run = lambda *args: subprocess.run(["bash", background, *args], capture_output=True, text=True, env=env,
                                       timeout=300)
    started = run("start", str(tmp_path / "work"))
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("nice -n 19 ") and (
        f"{tmp_path}/work/code/experiments/multi30k_converged/driver.py run --data {shared}/data/multi30k_en_de "
        f"--blind {shared}/data/blind --workdir {tmp_path}/work/en_de --ledger "
        f"{REPO}/experiments/multi30k_converged/en_de.jsonl --stages tune --retrain-missing --seeds 2") \
        in started.stdout, started.stdout
    carried = run("carry", str(tmp_path / "work"))
    assert carried.returncode == 0 and "0 run(s) in flight carried" in carried.stdout, carried.stderr[-2000:]
    assert run("bogus").returncode == 2


def test_a_carried_checkpoint_is_packed_losslessly_and_smaller_than_deflated_as_it_is(tmp_path):
    """pack / unpack: the same bytes back, whatever the length's remainder by the word; a torch checkpoint of float32
    tensors packs smaller than the file deflated as it is (what git would store)."""
    import zlib

    import torch

    converged = load("multi30k_converged_driver", CONVERGED)
    for data in (b"", b"abc", bytes(range(256)) * 3 + b"xy"):
        assert converged.unpack(converged.pack(data)) == data
    generator = torch.Generator().manual_seed(0)
    torch.save({"model": {"w": torch.randn(64, 1024, generator=generator) * 0.05}}, tmp_path / "c.pt")
    data = (tmp_path / "c.pt").read_bytes()
    packed = converged.pack(data)
    assert converged.unpack(packed) == data and len(packed) < 0.95 * len(zlib.compress(data, 9))


def carried_checkpoint(path, updates):
    """A stand-in fairseq checkpoint saved at ``updates``, with an optimizer state."""
    import torch

    torch.save({"model": {"w": torch.full((3,), float(updates))}, "optimizer_history": [{"num_updates": updates}],
                "last_optimizer_state": {"state": {0: {"exp_avg": torch.ones(3)}}}}, path)


def test_a_carried_run_keeps_its_last_checkpoint_and_its_best_as_weights_or_as_scores(tmp_path):
    """carry_run / restore_carried: the last checkpoint packed, in parts of at most the bytes asked for, joined and
    unpacked to the same bytes; the logs; an earlier best checkpoint without the optimizer state (a pre-training's,
    no ``score_best``) or scored in its place (``score_best``: no best checkpoint restored, the scores are, and a second
    carry keeps them); a best that is the last carried once (restored as a copy of it); an earlier version's carry
    (plain parts) restored too."""
    import torch

    converged = load("multi30k_converged_driver", CONVERGED)
    save = tmp_path / "run"
    save.mkdir()
    carried_checkpoint(save / "checkpoint_last.pt", 20)
    carried_checkpoint(save / "checkpoint_best.pt", 10)
    (save / "train.1.log").write_text("first start\n")
    (save / "checkpoint_other.pt").write_text("not carried")
    part_bytes = 200
    assert converged.carry_run(str(save), str(tmp_path / "carried"), part_bytes) == 20
    carried = sorted(os.listdir(tmp_path / "carried"))
    last_parts = [name for name in carried if name.startswith("checkpoint_last.pt.planes.zlib.part")]
    assert len(last_parts) > 1 and all((tmp_path / "carried" / name).stat().st_size <= part_bytes for name in carried)
    assert [name for name in carried if not name.startswith("checkpoint_")] == ["carried_at", "train.1.log"]
    assert (tmp_path / "carried" / "carried_at").read_text() == "20\n"
    converged.restore_carried(str(tmp_path / "carried"), str(tmp_path / "restored"))
    assert sorted(os.listdir(tmp_path / "restored")) == ["checkpoint_best.pt", "checkpoint_last.pt", "train.1.log"]
    best = torch.load(tmp_path / "restored" / "checkpoint_best.pt", weights_only=False)
    assert best["last_optimizer_state"] is None and best["model"]["w"][0] == 10
    assert (tmp_path / "restored" / "checkpoint_last.pt").read_bytes() == (save / "checkpoint_last.pt").read_bytes()

    def score_best(checkpoint, out):  # what Study.score leaves: scores.json, the hypotheses it names, logs
        os.makedirs(os.path.join(out, "blind", "set1"))
        (tmp_path / "scored_from").write_text(checkpoint)
        for name in ("valid.beam5.fr", "test.beam5.fr", "blind/set1/test.beam5.fr", "valid.log"):
            with open(os.path.join(out, name), "w") as f:
                f.write(name)
        with open(os.path.join(out, "scores.json"), "w") as f:
            json.dump({"updates": 10, "bleu": {"valid": 1.5, "test": 2.5}, "blind": {"set1": "blind/set1/test.beam5.fr"},
                       "hypotheses": {"valid": "valid.beam5.fr", "test": "test.beam5.fr"}}, f)

    shutil.rmtree(tmp_path / "restored")
    converged.carry_run(str(save), str(tmp_path / "carried"), score_best=score_best)  # (over the earlier carry)
    assert (tmp_path / "scored_from").read_text() == str(save / "checkpoint_best.pt")
    assert not [name for name in os.listdir(tmp_path / "carried") if name.startswith("checkpoint_best")]
    scored = tmp_path / "carried" / "best_scored"  # what the record reads, not the logs of the scoring
    assert sorted(str(p.relative_to(scored)) for p in scored.rglob("*") if p.is_file()) == \
        ["blind/set1/test.beam5.fr", "scores.json", "test.beam5.fr", "valid.beam5.fr"]
    (tmp_path / "restored").mkdir()
    (tmp_path / "restored" / "checkpoint_best.pt").write_text("a stale save of an earlier start")
    converged.restore_carried(str(tmp_path / "carried"), str(tmp_path / "restored"))
    assert sorted(os.listdir(tmp_path / "restored")) == ["best_scored", "checkpoint_last.pt", "train.1.log"]
    converged.carry_run(str(tmp_path / "restored"), str(tmp_path / "carried_again"), score_best=None)
    assert json.loads((tmp_path / "carried_again" / "best_scored" / "scores.json").read_text())["updates"] == 10

    carried_checkpoint(save / "checkpoint_best.pt", 20)  # the best is the last: carried once
    converged.carry_run(str(save), str(tmp_path / "carried"))
    assert sorted(os.listdir(tmp_path / "carried")) == ["carried_at", "checkpoint_last.pt.planes.zlib.part000",
                                                        "train.1.log"]
    shutil.rmtree(tmp_path / "restored")
    converged.restore_carried(str(tmp_path / "carried"), str(tmp_path / "restored"))
    assert sorted(os.listdir(tmp_path / "restored")) == ["checkpoint_best.pt", "checkpoint_last.pt", "train.1.log"]
    assert (tmp_path / "restored" / "checkpoint_best.pt").read_bytes() == (save / "checkpoint_last.pt").read_bytes()

    earlier = tmp_path / "earlier"  # plain parts, as an earlier version carried them
    earlier.mkdir()
    data = (save / "checkpoint_last.pt").read_bytes()
    (earlier / "checkpoint_last.pt.part000").write_bytes(data[:300])
    (earlier / "checkpoint_last.pt.part001").write_bytes(data[300:])
    converged.restore_carried(str(earlier), str(tmp_path / "from_earlier"))
    assert (tmp_path / "from_earlier" / "checkpoint_last.pt").read_bytes() == data


def test_a_last_checkpoint_cut_short_in_fairseqs_copy_is_replaced_by_the_best_save_it_copied(tmp_path):
    """repair_last (run by carry_run and before a run continues): a checkpoint_last.pt without its zip end record --
    a stop while fairseq copied a new best save to it -- replaced by checkpoint_best.pt; a whole one left; an error
    naming the folder when the best is not whole either."""
    converged = load("multi30k_converged_driver", CONVERGED)
    save = tmp_path / "save"
    save.mkdir()
    carried_checkpoint(save / "checkpoint_best.pt", 20)
    carried_checkpoint(save / "checkpoint_last.pt", 10)
    assert not converged.repair_last(str(save))  # whole: left
    assert converged.checkpoint_updates(str(save / "checkpoint_last.pt")) == 10
    whole = (save / "checkpoint_best.pt").read_bytes()
    (save / "checkpoint_last.pt").write_bytes(whole[:len(whole) // 2])
    assert converged.carry_run(str(save), str(tmp_path / "carried")) == 20
    assert (save / "checkpoint_last.pt").read_bytes() == whole
    (save / "checkpoint_last.pt").write_bytes(whole[:100])
    (save / "checkpoint_best.pt").write_bytes(whole[:200])
    with pytest.raises(SystemExit, match=f"remove {save} to train it from scratch"):
        converged.repair_last(str(save))


def test_a_runs_starts_are_ordered_by_the_checkpoint_each_continued_from(tmp_path):
    """train_logs: a start that continued from update 139 comes after the fresh start even when its name (from the
    clock of the machine it ran on) is earlier, and one that continued from 278 after both; starts from the same
    checkpoint (a start stopped before its first save) keep their names' order."""
    converged = load("multi30k_converged_driver", CONVERGED)
    loaded = "2026-12-02 09:58:46 | INFO | fairseq.trainer | Loaded checkpoint d/ck.pt (epoch {} @ {} updates)\n"
    begin = "2026-12-02 09:58:47 | INFO | fairseq.trainer | begin training epoch {}\n"
    (tmp_path / "train.300.log").write_text("No existing checkpoint found d/checkpoint_last.pt\n" + begin.format(1)
                                            + loaded.format(9, 999))  # (past its first epoch: not read)
    (tmp_path / "train.100.log").write_text(loaded.format(2, 139) + begin.format(2))
    (tmp_path / "train.200.log").write_text(loaded.format(3, 278) + begin.format(3))
    (tmp_path / "train.150.log").write_text(loaded.format(3, 278))  # stopped before its first epoch began
    (tmp_path / "other.log").write_text("")
    assert converged.train_logs(str(tmp_path)) == ["train.300.log", "train.100.log", "train.150.log", "train.200.log"]


def test_a_carry_is_restored_only_ahead_of_the_workdirs_own_run_and_a_recorded_run_is_not_carried(tmp_path):
    """carry_ahead: a carry is restored into a folder without a last checkpoint or with one of fewer updates, not
    over one as far or further; ``carry`` leaves out a run in flight here that the ledger already has (recorded
    where it was continued), but not a pre-training's folder, which holds its reruns."""
    import types

    converged = load("multi30k_converged_driver", CONVERGED)
    save, carried = tmp_path / "work" / "checkpoints" / "tune.tf.lr0.0005.seed1", tmp_path / "carry"
    assert not converged.carry_ahead(str(carried), str(save))  # nothing carried
    save.mkdir(parents=True)
    carried_checkpoint(save / "checkpoint_last.pt", 20)
    converged.carry_run(str(save), str(carried))
    assert not converged.carry_ahead(str(carried), str(save))  # as far
    carried_checkpoint(save / "checkpoint_last.pt", 10)
    assert converged.carry_ahead(str(carried), str(save))  # behind
    (save / "checkpoint_last.pt").unlink()
    assert converged.carry_ahead(str(carried), str(save))
    carried_checkpoint(save / "checkpoint_last.pt", 30)
    assert not converged.carry_ahead(str(carried), str(save))  # further

    pretrain = tmp_path / "work" / "checkpoints" / "pretrain.rnnsearch.seed1"  # its rerun in flight
    pretrain.mkdir()
    carried_checkpoint(pretrain / "checkpoint_last.pt", 5)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(json.dumps({"key": key, "stage": "tune"}) + "\n"
                              for key in ("tune.tf.lr0.0005.seed1", "pretrain.rnnsearch.seed1")))
    raw = toy_raw_data(tmp_path / "raw")
    study = converged.Study(types.SimpleNamespace(ledger=str(ledger), workdir=str(tmp_path / "work"), prepared=None,
                                                  data=str(raw), blind=None))
    study.carry()
    assert os.listdir(tmp_path / "ledger.carried") == ["pretrain.rnnsearch.seed1"]


def test_a_run_stopped_between_its_row_and_its_marker_is_not_carried_again(tmp_path):
    """A stop between a run's ledger row and its ``ledger_key`` marker leaves a folder that reads as in flight:
    recorded_unmarked finds its row by its logs' seconds, so ``carry`` leaves it, and the recorded rerun skipped
    removes a carry of its own logs but keeps a later rerun's."""
    converged = load("multi30k_converged_driver", CONVERGED)
    from ledger import append_row

    own = "pretrain.rnnsearch.seed1"
    save = tmp_path / "work" / "checkpoints" / own
    save.mkdir(parents=True)
    carried_checkpoint(save / "checkpoint_last.pt", 50)
    log = "2026-01-01 00:00:00 | INFO | begin\n2026-01-01 00:01:00 | INFO | done\n"  # 60 s
    (save / "train.1.log").write_text(log)
    study, ledger = bare_study(converged, tmp_path, {})
    append_row(str(ledger), {"key": own, "stage": "pretrain", "train_s_starts": [600.0]})  # the original
    rows = converged.rows_by_key(str(ledger))
    assert converged.recorded_unmarked(str(save), rows) is None
    study.carry()
    assert os.listdir(tmp_path / "ledger.carried") == [own]  # in flight: carried
    shutil.rmtree(tmp_path / "ledger.carried")
    append_row(str(ledger), {"key": f"{own}.rerun", "stage": "rerun", "train_s_starts": [60.0, 120.0]})
    (save / "train.2.log").write_text("2026-01-02 00:00:00 | INFO | begin\n2026-01-02 00:02:00 | INFO | done\n")
    rows = converged.rows_by_key(str(ledger))
    assert converged.recorded_unmarked(str(save), rows) == f"{own}.rerun"
    study.carry()
    assert not (tmp_path / "ledger.carried").exists()

    carry = tmp_path / "ledger.carried" / own  # carried after its first start, recorded after its second
    carry.mkdir(parents=True)
    (carry / "train.1.log").write_text(log)
    row = study.train(f"{own}.rerun", "rerun", "rnnsearch", "teacher_forcing", 1, [], save_as=own)
    assert row["train_s_starts"] == [60.0, 120.0] and not carry.exists()
    carry.mkdir()  # a later rerun's carry: kept
    (carry / "train.3.log").write_text("2026-01-03 00:00:00 | INFO | begin\n2026-01-03 00:00:30 | INFO | done\n")
    study.train(f"{own}.rerun", "rerun", "rnnsearch", "teacher_forcing", 1, [], save_as=own)
    assert carry.exists()


def bare_study(converged, tmp_path, blind):
    """A converged Study on a ledger in ``tmp_path`` and a prepared-data folder holding only its references, its
    blind sets ``blind`` (name -> source), for Study.train with fairseq faked; (study, ledger path)."""
    import types

    data = tmp_path / "data"
    (data / "ref").mkdir(parents=True)
    (data / "ref" / "valid.fr").write_text("ref\n")
    (data / "ref" / "valid.en").write_text("src\n")
    ledger = tmp_path / "ledger.jsonl"
    args = types.SimpleNamespace(ledger=str(ledger), workdir=str(tmp_path / "work"), prepared=str(data),
                                 data=str(data), blind=None, extra_args="", verbose=False)
    study = converged.Study(args)
    study.blind, study.data_fingerprint = blind, "0" * 16
    return study, ledger


def test_a_run_carried_with_its_best_scored_is_recorded_from_those_scores(tmp_path, monkeypatch):
    """Study.train on a run restored with its best checkpoint scored in its place (carry_run's ``score_best``): when
    the continued run gains nothing (no checkpoint_best.pt written), the row's BLEU, its scored update and the kept
    hypotheses and blind translations are the carried ones; when it gains, its new best checkpoint is scored."""
    converged = load("multi30k_converged_driver", CONVERGED)
    study, ledger = bare_study(converged, tmp_path, {"set1": "set1.en"})
    key = "tune.soft_beam_paper.lr0.0005.seed1"
    save = tmp_path / "work" / "checkpoints" / key
    scored = save / "best_scored"
    (scored / "blind").mkdir(parents=True)
    for subset, text in (("valid", "carried valid\n"), ("test", "carried test\n")):
        (scored / f"{subset}.beam5.fr").write_text(text)
    (scored / "blind" / "set1.fr").write_text("carried blind\n")
    (scored / "scores.json").write_text(json.dumps({"updates": 10, "bleu": {"valid": 51.5, "test": 52.5},
                                                    "blind": {"set1": "blind/set1.fr"},
                                                    "hypotheses": {"valid": "valid.beam5.fr", "test": "test.beam5.fr"}}))
    carried_checkpoint(save / "checkpoint_last.pt", 20)
    (save / "train.1.log").write_text("2026-01-01 00:00:00 | INFO | valid on 'valid' subset | epoch 001 | bleu 51.5 "
                                      "| num_updates 10\nSaved checkpoint checkpoint_best.pt (epoch 1 @ 10 updates\n"
                                      "2026-01-01 00:01:00 | INFO | valid on 'valid' subset | epoch 002 | bleu 51 "
                                      "| num_updates 20\nSaved checkpoint checkpoint_last.pt (epoch 2 @ 20 updates\n")

    def fairseq_train(cmd, log, env=None, echo=False, header="", gain=False):  # the continued run's third epoch
        with open(log, "w") as f:
            f.write(header + "2026-01-01 00:02:00 | INFO | valid on 'valid' subset | epoch 003 | "
                    f"bleu {52 if gain else 50} | num_updates 30\n"
                    "Saved checkpoint checkpoint_last.pt (epoch 3 @ 30 updates\n"
                    "early stop since valid performance hasn't improved\n")
        carried_checkpoint(save / "checkpoint_last.pt", 30)
        if gain:
            carried_checkpoint(save / "checkpoint_best.pt", 30)
        return ""

    monkeypatch.setattr(converged, "run_logged", fairseq_train)
    row = study.train(key, "tune", "rnnsearch", "soft_beam_paper", 1, [])
    assert row["bleu"] == {"valid": 51.5, "test": 52.5} and row["scored_updates"] == 10 and row["best_updates"] == 10
    hyps = tmp_path / "ledger.hyps" / f"{key}.test.fr.gz"
    assert gzip.open(hyps, "rt").read() == "carried test\n"
    assert gzip.open(tmp_path / "ledger.blind" / f"{key}.set1.fr.gz", "rt").read() == "carried blind\n"

    ledger.write_text("")
    (save / "ledger_key").unlink()
    for name in converged.train_logs(str(save))[1:]:  # (the continued start taken back, with its early stop)
        (save / name).unlink()
    scoring = []
    monkeypatch.setattr(converged, "run_logged", lambda *a, **k: fairseq_train(*a, **k, gain=True))
    monkeypatch.setattr(study, "score", lambda checkpoint, out: scoring.append(checkpoint) or
                        {"updates": 30, "bleu": {"valid": 52.0, "test": 53.0}, "blind": {}, "hypotheses": {}})
    row = study.train(key, "tune", "rnnsearch", "soft_beam_paper", 1, [])
    assert scoring == [str(save / "checkpoint_best.pt")] and row["bleu"]["test"] == 53.0 and row["scored_updates"] == 30

    # Stopped (or carried) after it stopped early but before it was recorded: recorded without training again --
    # fairseq restarted would train another epoch before checking its stopping rule.
    ledger.write_text("")
    (save / "ledger_key").unlink()
    monkeypatch.setattr(converged, "run_logged", lambda *a, **k: pytest.fail(f"trained again: {a}"))
    row = study.train(key, "tune", "rnnsearch", "soft_beam_paper", 1, [])
    assert row["converged"] and row["epochs"] == 3 and row["scored_updates"] == 30 and len(scoring) == 2
    # stopped between its row and removing its carry: the carry goes when the recorded run is skipped
    leftover = tmp_path / "ledger.carried" / key
    leftover.mkdir(parents=True)
    assert study.train(key, "tune", "rnnsearch", "soft_beam_paper", 1, [])["bleu"] == row["bleu"]
    assert not leftover.exists()


def test_a_rerun_into_its_originals_folder_trains_from_scratch(tmp_path, monkeypatch):
    """A rerun trains into its original's folder: what the recorded original left there (its last checkpoint and
    its logs, early stop included, without its best checkpoint) is removed, not continued."""
    converged = load("multi30k_converged_driver", CONVERGED)
    from ledger import append_row

    study, ledger = bare_study(converged, tmp_path, {})
    original = "pretrain.rnnsearch.seed2"
    append_row(str(ledger), {"key": original, "stage": "pretrain", "seed": 2})
    save = tmp_path / "work" / "checkpoints" / original
    save.mkdir(parents=True)
    carried_checkpoint(save / "checkpoint_last.pt", 99)
    (save / converged.RECORDED_AS).write_text(original + "\n")
    (save / "train.1.log").write_text("2026-01-01 00:00:00 | INFO | valid on 'valid' subset | epoch 009 | bleu 40 | "
                                      "num_updates 99\nearly stop since valid performance hasn't improved\n")
    commands = []

    def fairseq_train(cmd, log, env=None, echo=False, header=""):
        commands.append(cmd)
        assert os.listdir(save) == []  # nothing of the original's left to resume
        with open(log, "w") as f:
            f.write(header + "2026-01-02 00:00:00 | INFO | valid on 'valid' subset | epoch 001 | bleu 30 | "
                    "num_updates 10\nSaved checkpoint checkpoint_best.pt (epoch 1 @ 10 updates\n")
        carried_checkpoint(save / "checkpoint_best.pt", 10)
        return ""

    monkeypatch.setattr(converged, "run_logged", fairseq_train)
    monkeypatch.setattr(study, "score", lambda checkpoint, out: {"updates": 10, "bleu": {"valid": 30.0, "test": 31.0},
                                                                "blind": {}, "hypotheses": {}})
    row = study.train(f"{original}.rerun", "rerun", "rnnsearch", "teacher_forcing", 2, [], save_as=original)
    assert len(commands) == 1 and not row["resumed"] and [p["updates"] for p in row["val_curve"]] == [10]
    assert converged.recorded_as(str(save)) == f"{original}.rerun"


@pytest.mark.slow
def test_converged_study_runs_resumes_and_reports_on_tiny_data(tmp_path, capsys, monkeypatch):
    """The converged study's driver end to end on a toy corpus at tiny sizes: pre-training with validation
    BLEU and early stopping, fine-tuning from its best checkpoint, the pruning comparison that picks M, every
    attention arm, the ledger (a second `run` skips what is recorded), the hypotheses kept beside it, the blind
    sets translated by every scored run (and by ``blind`` for one that lacks them), a pre-training whose workdir
    is gone trained again only when asked (--retrain-missing), and the report with paired differences computed
    from the kept hypotheses alone, reading no blind translation."""
    data, blind = toy_raw_data(tmp_path / "raw"), blind_sources(tmp_path / "blind", 2)
    common = ["--data", str(data), "--workdir", str(tmp_path / "work"), "--ledger", str(tmp_path / "ledger.jsonl"),
              "--bpe-size", "90", "--seeds", "1", "--max-epoch", "2", "--patience", "1", "--blind", str(blind)]
    rnn = TINY_RNNSEARCH

    def driver(*args):
        return script(CONVERGED, *args, timeout=900)

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
        assert perturbed[perturbed.index("--topk-attn-inference") + 1] == "hard_topk"
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
    kept, blind_out = tmp_path / "ledger.hyps", tmp_path / "ledger.blind"
    for r in rows:
        for subset in ("valid", "test"):
            assert lines_of_gzip(kept / f"{r['key']}.{subset}.fr.gz") == \
                (tmp_path / "work" / "checkpoints" / r["key"] / "best_scored" / f"{subset}.beam5.fr").read_text().splitlines()
        assert len(lines_of_gzip(blind_out / f"{r['key']}.news.fr.gz")) == 2
    # ``blind``: a scored run whose translations are missing translates them again from its checkpoint
    (blind_out / "attention.softmax.seed1.news.fr.gz").unlink()
    said = driver("blind", *common)
    assert "attention.softmax.seed1: translating the blind sets" in said
    assert len(lines_of_gzip(blind_out / "attention.softmax.seed1.news.fr.gz")) == 2
    again = driver("run", *common, "--stages", "pretrain", "finetune", "--runs", "tf", "--extra-args", rnn)
    assert "pretrain.rnnsearch.seed1: in the ledger, skipped" in again and "finetune.tf.seed1: in the ledger" in again
    # Another workdir's ledger: the checkpoints are gone, the ledger and the kept hypotheses are not (nor the
    # checkpoint kept beside the ledger, which would be used instead).
    shutil.rmtree(tmp_path / "work" / "checkpoints")
    shutil.rmtree(tmp_path / "ledger.starts")
    skipped = driver("run", *common, "--stages", "finetune", "--runs", "softmax_k_times", "--extra-args", rnn)
    assert "is in the ledger but" in skipped and "--retrain-missing" in skipped
    driver("run", *common, "--stages", "finetune", "--runs", "softmax_k_times", "--retrain-missing",
           "--finetune-epochs", "1", "--finetune-validate-updates", "2", "--candidates", "10", "--extra-args", rnn)
    with open(tmp_path / "ledger.jsonl") as f:
        keys = [json.loads(line)["key"] for line in f]
    assert keys[-2:] == ["pretrain.rnnsearch.seed1.rerun", "finetune.softmax_k_times.seed1"]
    capsys.readouterr()
    report_reading_nothing_from(blind_out, ["--pair", str(tmp_path / "ledger.jsonl"), str(data)], monkeypatch)
    table_ = capsys.readouterr().out
    assert "| rerun | of |" in table_
    assert "| pretrain.rnnsearch.seed1.rerun | pretrain.rnnsearch.seed1 | en-fr |" in table_
    assert "pretrain.rnnsearch.seed1.rerun differs from pretrain.rnnsearch.seed1 by" in table_
    for comparison in ("soft beam search (paper's setting) - continued teacher forcing", "SOFT top-k - softmax",
                       "SOFT top-k - hard top-k", "perturbed top-k (16 samples) - hard top-k",
                       "perturbed top-k (64 samples) - perturbed top-k (16 samples)"):
        for subset in ("val", "test"):
            # one seed: its difference, no pooled test
            assert re.search(rf"\| {re.escape(comparison)} \| en-fr \| {subset} \| s1 [-+]\d+\.\d\d \| - \| - \|",
                             table_), (comparison, subset)
            # and the seed's own paired tests: BLEU and chrF, bootstrap / randomisation
            assert re.search(rf"\| {re.escape(comparison)} \| en-fr \| {subset} \| 1 \| [-+]\d+\.\d\d \| "
                             r"(\d\.\d{3}|<0\.001) / (\d\.\d{3}|<0\.001) \|", table_), (comparison, subset)
    assert "Pruning on pruning.rnnsearch.seed1" in table_ and "| paper | exact |" in table_


def test_the_study_summary_claims_one_seed_as_one_seed_and_pools_several(monkeypatch):
    """The summary's claim for a comparison: one seed's own paired test, said to be one seed's; pooled p-values
    once there are several; "not measured yet" without any."""
    monkeypatch.syspath_prepend(os.path.dirname(CONVERGED))  # (report imports significance beside it)
    report = load("multi30k_converged_report", os.path.join(os.path.dirname(CONVERGED), "report.py"))
    from significance import Comparison

    def comparison(delta, p):
        tests = {"bootstrap": p, "randomisation": 2 * p}
        return Comparison({"BLEU": 30.0}, {"BLEU": 30.0 + delta}, {"BLEU": tests})

    one = report.Result([1], [comparison(-0.04, 0.374)], None)
    assert report._pooled_claim(one) == "BLEU -0.04 on seed 1 alone (p 0.374 bootstrap, 0.748 randomisation)"
    three = report.Result([1, 2, 3], [comparison(d, 0.2) for d in (0.5, 0.3, -0.1)], comparison(0.23, 0.01))
    assert report._pooled_claim(three) == ("BLEU +0.23 (pooled p 0.010 bootstrap, 0.020 randomisation; higher on "
                                           "2 of 3 seeds)")
    assert report._pooled_claim(None, "chrF") == "chrF not measured yet"


def test_the_study_says_whether_the_first_pairs_attention_finding_holds_on_the_second(monkeypatch):
    """The replication line: undecided while the second pair has fewer seeds than the first; once it has as many,
    "holds" exactly when the pooled tests of both pairs give the same outcome (a gain, a loss or no measurable
    difference: both tests below 0.05 for a gain or a loss)."""
    monkeypatch.syspath_prepend(os.path.dirname(CONVERGED))  # (report imports significance beside it)
    report = load("multi30k_converged_report", os.path.join(os.path.dirname(CONVERGED), "report.py"))
    from significance import Comparison

    def comparison(delta, p):
        return Comparison({"BLEU": 30.0}, {"BLEU": 30.0 + delta},
                          {"BLEU": {"bootstrap": p, "randomisation": p}})

    def result(deltas, pooled_delta, p):
        return report.Result(list(range(1, len(deltas) + 1)), [comparison(d, 0.2) for d in deltas],
                             comparison(pooled_delta, p) if len(deltas) > 1 else None)

    pairs = [report.Pair(name, "", "", {}, "", {}) for name in ("en-fr", "en-de")]
    gain = result([0.9, 0.6, 0.7], 0.73, 0.002)

    def line(soft_de, hard_de=None):
        found = {("soft_topk", "softmax", "en-fr", "test"): gain, ("hard_topk", "softmax", "en-fr", "test"): gain,
                 ("soft_topk", "softmax", "en-de", "test"): soft_de}
        if hard_de is not None:
            found["hard_topk", "softmax", "en-de", "test"] = hard_de
        (text,) = report.replication(found, pairs)
        assert text.startswith("- **Does the en-fr top-k attention finding hold on en-de?**")
        return text

    text = line(result([-0.04], -0.04, None))
    assert "SOFT top-k against softmax: not decided yet (1 of 3 seeds)" in text
    assert "hard top-k against softmax: not decided yet (0 of 3 seeds)" in text
    text = line(result([0.5, 0.4, 0.6], 0.5, 0.01), result([0.2, -0.3, 0.1], 0.0, 0.6))
    assert "SOFT top-k against softmax: it holds -- en-fr a gain (+0.73 BLEU), en-de a gain: BLEU +0.50" in text
    assert "hard top-k against softmax: it does not hold -- en-fr a gain (+0.73 BLEU), en-de no measurable " \
           "difference: BLEU +0.00" in text
    text = line(result([-0.5, -0.4, -0.6], -0.5, 0.01))
    assert "SOFT top-k against softmax: it does not hold -- en-fr a gain (+0.73 BLEU), en-de a loss" in text
    # a gain on one test alone is no measurable difference
    assert report._outcome(report.Result([1, 2], [], report.Comparison(
        {"BLEU": 30.0}, {"BLEU": 30.5}, {"BLEU": {"bootstrap": 0.01, "randomisation": 0.2}}))) == \
        "no measurable difference"
    assert report.replication({}, pairs[:1]) == []

    def versus(bleu_p, chrf_p, seeds=2):  # SOFT against hard top-k, both metrics +0.5
        pooled = Comparison({"BLEU": 30.0, "chrF": 50.0}, {"BLEU": 30.5, "chrF": 50.5},
                            {"BLEU": {"bootstrap": bleu_p, "randomisation": bleu_p},
                             "chrF": {"bootstrap": chrf_p, "randomisation": chrf_p}})
        return report.Result(list(range(1, seeds + 1)), [pooled] * seeds, pooled if seeds > 1 else None)

    assert report.soft_against_hard(versus(0.01, 0.01, seeds=1)) == "one seed: no pooled test yet."
    assert report.soft_against_hard(versus(0.3, 0.2)).startswith("no measurable difference between the two")
    assert report.soft_against_hard(versus(0.003, 0.2)) == \
        "SOFT top-k measurably different at k 4, epsilon 0.1: a gain on BLEU, no measurable difference on chrF."


def test_the_fairness_check_says_whether_the_top_k_lead_closes_against_a_longer_trained_softmax(monkeypatch):
    """The patience-10 line: the longer run's epochs and difference from the patience-5 run, and for each top-k arm
    its lead on the seed against both baselines, said to close (no lead left), narrow or not narrow."""
    monkeypatch.syspath_prepend(os.path.dirname(CONVERGED))  # (report imports significance beside it)
    report = load("multi30k_converged_report", os.path.join(os.path.dirname(CONVERGED), "report.py"))
    from significance import Comparison

    def result(delta, p=0.2, seed=1):
        return report.Result([seed], [Comparison({"BLEU": 30.0}, {"BLEU": 30.0 + delta},
                                                 {"BLEU": {"bootstrap": p, "randomisation": 2 * p}})], None)

    def row(method, epochs, curve, patience):
        return {"stage": "attention", "method": method, "seed": 1, "epochs": epochs,
                "extra": ["--lr-patience", "1", "--patience", str(patience)],
                "val_curve": [{"epoch": e, "updates": 10 * e, "bleu": b} for e, b in enumerate(curve, 1)]}

    # The patience each run trained with is read from its row (these are not the study's 5 and 10).
    rows = {"attention.softmax.seed1": row("softmax", 4, [20, 30, 29, 28], 2),
            "attention.softmax_patience10.seed1": row("softmax_patience10", 6, [20, 30, 29, 28, 31, 30], 4)}
    pair = report.Pair("en-de", "", "", rows, "", {})
    assert report.fairness_line(pair, {}) == "- en-de: not measured yet."
    found = {("softmax_patience10", "softmax", "en-de", "valid"): result(1.0),
             ("softmax_patience10", "softmax", "en-de", "test"): result(0.4),
             ("soft_topk", "softmax", "en-de", "test"): result(0.7),
             ("soft_topk", "softmax_patience10", "en-de", "test"): result(0.3, 0.04),
             ("hard_topk", "softmax", "en-de", "test"): result(0.3),
             ("hard_topk", "softmax_patience10", "en-de", "test"): result(-0.1)}
    line = report.fairness_line(pair, found)
    assert line.startswith("- en-de, seed 1: with patience 4 the softmax run's best epoch is 5 and it stopped at 6 "
                           "(patience 2: 2 / 4); against the patience-2 run +1.00 BLEU on val, +0.40 on test; "
                           "its val curve repeats the shorter run's up to that run's stop.")
    assert "SOFT top-k +0.30 BLEU against it (p 0.040 bootstrap, 0.080 randomisation; +0.70 against patience 2): " \
           "its lead narrows by 0.40" in line
    assert "hard top-k -0.10 BLEU against it" in line and "; +0.30 against patience 2): its lead closes." in line
    del found["hard_topk", "softmax_patience10", "en-de", "test"]
    assert "hard top-k: not measured on seed 1." in report.fairness_line(pair, found)
    rows["attention.softmax_patience10.seed1"]["val_curve"][2]["bleu"] = 29.5
    assert "; its val curve differs from the shorter run's from epoch 3 on (the two did not compute bit for bit " \
           "alike), so the difference" in report.fairness_line(pair, found)
    assert report.lead_change(0.3, 0.5) == "its lead does not narrow"
    assert report.lead_change(-0.2, -0.5) == "it had no lead to close"


def test_a_fine_tunings_start_is_the_pre_training_recorded_last_before_it(monkeypatch):
    """The 278-update fine-tunings name no start: each seed's is its last pre-training or rerun recorded before its
    first fine-tuning -- a rerun recorded after them (trained for the fine-tunings to convergence) is not theirs."""
    monkeypatch.syspath_prepend(os.path.dirname(CONVERGED))
    report = load("multi30k_converged_report", os.path.join(os.path.dirname(CONVERGED), "report.py"))
    order = [("pretrain.rnnsearch.seed1", "pretrain", 1), ("pretrain.rnnsearch.seed2", "pretrain", 2),
             ("pretrain.rnnsearch.seed3", "pretrain", 3), ("finetune.tf.seed2", "finetune", 2),
             ("pretrain.rnnsearch.seed1.rerun", "rerun", 1), ("finetune.tf.seed1", "finetune", 1),
             ("finetune.soft_beam_paper.seed2", "finetune", 2), ("pretrain.rnnsearch.seed1.rerun2", "rerun", 1),
             ("pretrain.rnnsearch.seed2.rerun", "rerun", 2)]
    rows = {key: {"key": key, "stage": stage, "method": key.split(".")[1], "seed": seed} for key, stage, seed in order}
    pair = report.Pair("en-fr", "", "", rows, "", {})
    assert report.arm_keys(pair, "finetune", "start") == {1: "pretrain.rnnsearch.seed1.rerun",
                                                          2: "pretrain.rnnsearch.seed2"}
    assert report.arm_keys(pair, "finetune", "tf") == {1: "finetune.tf.seed1", 2: "finetune.tf.seed2"}


def test_the_selection_note_counts_validations_and_compares_arms_within_the_controls_fewest(monkeypatch):
    """An arm that validates more chooses its checkpoint among more noisy scores: the page says how many each arm's
    runs made and each arm's mean best val BLEU within the fewest a control run made, and over all of them."""
    monkeypatch.syspath_prepend(os.path.dirname(CONVERGED))
    report = load("multi30k_converged_report", os.path.join(os.path.dirname(CONVERGED), "report.py"))

    def row(method, seed, curve):
        return {"stage": "tune", "method": method, "seed": seed, "lr": 0.0005, "epochs": len(curve),
                "val_curve": [{"epoch": e, "updates": 10 * e, "bleu": b} for e, b in enumerate(curve, 1)]}

    rows = {"tune.tf.lr0.0005.seed1": row("tf", 1, [50, 52, 51]),
            "tune.tf.lr0.0005.seed2": row("tf", 2, [50, 51, 51, 50]),
            # the soft arm's later validations are higher: within 3 its best is 51 and 52, over all 54 and 53
            "tune.soft_beam_paper.lr0.0005.seed1": row("soft_beam_paper", 1, [49, 51, 50, 54, 50]),
            "tune.soft_beam_paper.lr0.0005.seed2": row("soft_beam_paper", 2, [52, 50, 50, 50, 53, 50])}
    pair = report.Pair("en-fr", "", "", rows, "", {})
    note = report.selection_note([pair], "tune", ["tf", "soft_beam_paper"])
    assert "validations per run continued teacher forcing 3-4 (mean 3.5), soft beam search (paper's setting) 5-6 " \
           "(mean 5.5)" in note
    assert "within each run's first 3 (the fewest a run of continued teacher forcing made), mean over seeds: " \
           "continued teacher forcing 51.50, soft beam search (paper's setting) 51.50; over all of them: 51.50, " \
           "53.50" in note
    assert report.selection_note([report.Pair("en-fr", "", "", {}, "", {})], "tune", ["tf"]) == ""


def test_the_stopping_check_finds_runs_that_trained_past_their_early_stopping_rule(monkeypatch):
    """A restart that lost early stopping's count trains on: the page names every run whose last epoch is not
    where its rule (patience after the last strict gain of its own val curve) stops, and says whether its scored
    checkpoint is still the rule's."""
    monkeypatch.syspath_prepend(os.path.dirname(CONVERGED))
    report = load("multi30k_converged_report", os.path.join(os.path.dirname(CONVERGED), "report.py"))

    def row(curve, epochs, patience=2):
        return {"stage": "attention", "method": "softmax", "seed": 1, "epochs": epochs,
                "extra": ["--patience", str(patience)],
                "val_curve": [{"epoch": e, "updates": 10 * e, "bleu": b} for e, b in enumerate(curve, 1)]}

    # a tie is no gain: 30 at epoch 2, then 30 and 29 -> the rule stops at epoch 4
    assert report.rule_stop(row([20, 30, 30, 29], 4)) == 4
    assert report.rule_stop(row([20, 30, 30, 29], 4, patience=3)) is None
    assert report.rule_stop({**row([20, 30], 2), "extra": []}) is None
    good = {"attention.softmax.seed1": row([20, 30, 30, 29], 4)}
    pair = report.Pair("en-de", "", "", good, "", {})
    assert report.stopping_check([pair], "attention", ["softmax"]).startswith("Every run stopped at the epoch")
    pair.rows["attention.softmax.seed2"] = {**row([20, 30, 29, 28, 29, 29], 6), "seed": 2}
    pair.rows["attention.softmax.seed3"] = {**row([20, 30, 29, 28, 31, 29, 28], 7), "seed": 3}
    line = report.stopping_check([pair], "attention", ["softmax"])
    assert line.startswith("Every other run stopped at the epoch its rule gives on its own val curve. A run "
                           "continued after an interruption trains on")
    assert "en-de `attention.softmax.seed2` trained to epoch 6, where its rule stops at 4; its best epoch (2) is " \
           "before that, so the checkpoint scored is the rule's" in line
    assert "`attention.softmax.seed3` trained to epoch 7, where its rule stops at 4; its best epoch (5) is after " \
           "that: the checkpoint scored is not the rule's." in line


def test_converged_report_reports_the_fine_tunings_to_convergence_at_the_chosen_rate(tmp_path, monkeypatch):
    """The report's ``tune`` section from a ledger alone: the rate line (the control's val BLEU at each rate on its
    seed), the arms at the chosen rate only (the control's run at the other rate left out), the soft arms against
    the control with per-seed and pooled tests, the answer naming how many runs are in, and the learning-curve
    figure (one panel per arm); each seed's own tests of both fine-tuning studies, which hold the same comparison,
    side by side; an arm with one seed has no t-test, said so."""
    import random

    converged = load("multi30k_converged_driver", CONVERGED)
    from ledger import append_row

    sys.path.insert(0, os.path.dirname(CONVERGED))
    import significance  # (the report's tests, with fewer resamples: their p-values are not what is checked here)

    monkeypatch.setattr(significance, "TESTS", {"bootstrap": ("bs", 50), "randomisation": ("ar", 50)})
    data = toy_raw_data(tmp_path / "raw")
    ledger = tmp_path / "en_fr.jsonl"
    refs = {subset: (data / f"{name}.fr").read_text().splitlines()
            for subset, name in (("valid", "val"), ("test", "test_2016_flickr"))}
    rng = random.Random(0)

    def row(key, stage, method, seed, valid, **fields):
        for subset, lines in refs.items():  # hypotheses: the references with some words dropped
            hyps = [" ".join(w for w in line.split() if rng.random() > 0.2) for line in lines]
            with gzip.open(tmp_path / "en_fr.hyps" / f"{key}.{subset}.fr.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(hyps) + "\n")
        curve = [{"epoch": e, "updates": 10 * e, "bleu": valid - 1.0 / e} for e in (1, 2, 3)]
        append_row(str(ledger), {"key": key, "stage": stage, "method": method, "seed": seed, "pair": "en-fr",
                                 "bleu": {"valid": valid, "test": valid}, "val_curve": curve, "epochs": 3,
                                 "converged": True, "train_s": 60.0, **{"extra": ["--patience", "5"], **fields}})

    (tmp_path / "en_fr.hyps").mkdir()
    for seed in (1, 2):
        row(f"pretrain.rnnsearch.seed{seed}", "pretrain", "teacher_forcing", seed, 40.0)
    row("tune.tf.lr0.001.seed1", "tune", "tf", 1, 41.0, lr=1e-3, start="pretrain.rnnsearch.seed1")
    row("tune.tf.lr0.0005.seed1", "tune", "tf", 1, 42.0, lr=5e-4, start="pretrain.rnnsearch.seed1")
    page_path, plot_path = tmp_path / "page.md", tmp_path / "fig" / "bleu.png"
    plot_path.parent.mkdir()

    def section():
        converged.main(["report", "--pair", str(ledger), str(data), "--out", str(page_path), "--plot", str(plot_path)])
        page = page_path.read_text()
        return page, page[page.index("## Training through beam search, fine-tuned to convergence"):
                          page.index("## The pre-trainings")]

    # the controls alone: the arm table already holds the control at the rate it chose for the soft runs
    page, tune = section()
    assert "42.00 at 0.0005 (its start: 40.00); the soft runs, not started yet, run at 0.0005." in tune
    assert re.search(r"\| continued teacher forcing \| en-fr \| 1 \|", tune)
    assert "none has run yet" in tune
    for seed in (1, 2):
        for method in ("soft_beam_paper", "soft_beam_rho05") + (("tf",) if seed == 2 else ()):
            if (method, seed) != ("soft_beam_rho05", 2):
                row(f"tune.{method}.lr0.0005.seed{seed}", "tune", method, seed, 41.5, lr=5e-4,
                    start=f"pretrain.rnnsearch.seed{seed}", extra=["--patience", "5", "--soft-beam-candidates", "50"])
        for method in ("tf", "soft_beam_paper"):  # the 278-update study: the same comparison as the one above
            row(f"finetune.{method}.seed{seed}", "finetune", method, seed, 40.5)
    page, tune = section()
    assert "the control on seed 1 reached val BLEU 41.00 at 0.001, 42.00 at 0.0005 (its start: 40.00); every run " \
           "is at 0.0005." in tune
    assert "both with 50 candidates per sentence (the exact search" in tune
    assert "to convergence at one rate, 50 candidates per sentence)" in page
    assert re.search(r"\| continued teacher forcing \| en-fr \| 2 \|", tune)  # seeds 1 and 2 at 5e-4, not 1e-3
    for system in ("soft beam search (paper's setting)", "soft beam search, rho 0.5"):
        assert re.search(rf"\| {re.escape(system)} - continued teacher forcing \| en-fr \| val \| s1 [-+]\d", tune)
    assert "(runs in the ledger: continued teacher forcing 2 of 3, soft beam search (paper's setting) 2 of 3, " \
           "soft beam search, rho 0.5 1 of 3)" in page
    answer = next(line for line in page.splitlines() if line.startswith("- **Training through beam search, fine-tuned"))
    assert re.search(r"soft beam search \(paper's setting\) against .* t-test over seeds p \d", answer), answer
    assert "no t-test over seeds (one seed)" in answer and "t-test over seeds p -" not in answer
    per_seed = page[page.index("## Each seed's own tests"):page.index("## How these were obtained")]
    for study in ("fine-tuning, 278 updates", "fine-tuning to convergence"):
        for seed in (1, 2):
            assert re.search(rf"\| {study} \| soft beam search \(paper's setting\) - continued teacher forcing \| "
                             rf"en-fr \| test \| {seed} \|", per_seed), (study, seed)
    assert (plot_path.parent / "multi30k_beam_training_curves.png").exists()
    assert "](fig/multi30k_beam_training_curves.png)" in tune
