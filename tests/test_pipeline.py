"""The demo pipeline's pieces on a tiny slice: both BPE back-ends, toy data and files given by path, and the
safety of re-running it (inputs checked first, workdirs never wiped, interrupted runs resumed)."""
import dataclasses
import os
import shutil

import pytest

from file_tree import snapshot
from softtopk_fairseq.pipeline import run, text, toy_corpus, workdir


@pytest.mark.parametrize("method", text.BPE_METHODS)
def test_joint_bpe_round_trip(tmp_path, method):
    lines = [pair[1] for pair in toy_corpus.generate(300, seed=5)]
    path = tmp_path / "train.fr"
    text.write_lines(path, text.moses_tokenize(lines, "fr") if method == "subword_nmt" else lines)
    bpe = text.JointBPE(method, str(tmp_path / "model"))
    bpe.learn([str(path)], 60)
    encoded = bpe.encode(lines[:20])
    # Subwords were actually split, and removing the markers as fairseq does gives the text back.
    assert sum(len(e.split()) for e in encoded) > sum(len(line.split()) for line in lines[:20])
    if method == "subword_nmt":
        decoded = text.moses_detokenize([(e + " ").replace("@@ ", "").strip() for e in encoded], "fr")
        assert decoded == text.moses_detokenize(text.moses_tokenize(lines[:20], "fr"), "fr")
    else:
        decoded = [e.replace(" ", "").replace("\u2581", " ").strip() for e in encoded]
        assert decoded == lines[:20]


def _tiny_config(tmp_path, **kw):
    args = ["--workdir", str(tmp_path / "work"), "--toy-sizes", "120", "10", "8", "--bpe-size", "80",
            "--size", "tiny", "--max-update", "2", "--max-tokens", "500", "--warmup", "1", "--beams", "1",
            "--finetune-updates", "0"]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    return run.parse_args(args)


def test_every_option_is_a_flag_with_its_config_default_shown_by_help(capsys):
    """One flag per Config field, its default the field's (written once) and shown by --help; lists take
    several values; a bad choice is refused by the parser."""
    defaults = run.parse_args(["--workdir", "w"])
    for f in dataclasses.fields(run.Config):
        if f.name != "workdir":
            want = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert getattr(defaults, f.name) == want and type(getattr(defaults, f.name)) is type(want), f.name
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(run.Config):
        assert f"--{f.name.replace('_', '-')} " in shown, f.name
    for flag_and_default in ("--toy-sizes TRAIN VALID TEST sentence pairs per split of the generated toy corpus "
                             "(default: 20000 500 500)", "(default: 0.001)", "(default: paper)",
                             "beam sizes to evaluate (default: 1 5)"):
        assert flag_and_default in shown
    given = run.parse_args(["--workdir", "w", "--beams", "3", "7", "--lr", "0.5", "--soft-beam-scaling", "none"])
    assert (given.beams, given.lr, given.soft_beam_scaling) == ([3, 7], 0.5, "none")
    with pytest.raises(SystemExit):
        run.parse_args(["--soft-beam-scaling", "nats"])
    # the flags' names of version 0.1: the same option, with a warning
    with pytest.warns(FutureWarning, match="--soft-topk-epsilon is the old name of --soft-beam-epsilon"):
        old = run.parse_args(["--soft-topk-epsilon", "0.3", "--soft-topk-scaling", "none"])
    assert (old.soft_beam_epsilon, old.soft_beam_scaling) == (0.3, "none")


# (subword-nmt with the transformer is the default configuration, which the tests below run end to end too)
@pytest.mark.parametrize("bpe,arch", [pytest.param("subword_nmt", "transformer", marks=pytest.mark.slow),
                                      ("sentencepiece", "lstm")])
def test_pipeline_end_to_end_on_toy_data(tmp_path, bpe, arch, capsys):
    rows = run.run_pipeline(_tiny_config(tmp_path, bpe=bpe, arch=arch, beams=[1, 2]))
    out = capsys.readouterr().out
    # fairseq-generate's per-sentence lines stay in its log, out of the terminal
    assert "\nH-0\t" not in out and "H-0\t" in (tmp_path / "work" / "logs" / "tf" / "generate.beam1.log").read_text()
    assert [r["run"] for r in rows] == ["teacher forcing"]
    assert set(rows[0]["bleu"]) == {1, 2}
    assert all(0.0 <= b <= 100.0 for b in rows[0]["bleu"].values())
    results = (tmp_path / "work" / "results.md").read_text()
    assert "| teacher forcing |" in results and "BLEU beam 2" in results
    hyps = text.read_lines(tmp_path / "work" / "logs" / "tf" / "test.beam2.fr")
    assert len(hyps) == 8


def _assert_fine_tuned(rows, work):
    """The three fine-tunings of a finished run: their rows, logs, hypotheses and results."""
    assert [r["run"].split(" (")[0].split(",")[0] for r in rows] == [
        "teacher forcing", "+ 2 teacher forcing", "+ 2 soft beam search", "+ 2 teacher forcing"]
    assert [r["arch"] for r in rows] == ["transformer"] * 3 + ["transformer_topk_attn"]
    assert [r["updates"] for r in rows] == [2, 4, 4, 4]
    logs = work / "logs"
    log = (logs / "train.ft_soft_beam.log").read_text()
    assert "soft_loss" in log and "num_updates 2" in log and "loaded checkpoint" in log.lower()
    log = (logs / "train.ft_topk_attn.log").read_text()
    assert "TopkMultiheadAttention" in log and "loaded checkpoint" in log.lower()
    for key in ("ft_tf", "ft_soft_beam", "ft_topk_attn"):
        assert len(text.read_lines(logs / key / "test.beam1.fr")) == 8
    results = (work / "results.md").read_text()
    assert "+ 2 soft beam search" in results and "SOFT top-k attention" in results


@pytest.mark.slow  # (the interrupted run of the next test finishes the same fine-tunings, checked the same way)
def test_pipeline_fine_tunes_with_soft_beam_search_and_topk_attention(tmp_path):
    cfg = _tiny_config(tmp_path, finetune_updates=2, soft_beam_size=2, soft_beam_candidates=10, topk_attn_k=2)
    _assert_fine_tuned(run.run_pipeline(cfg), tmp_path / "work")


def test_pipeline_on_files_given_by_path(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    # Real-text-like files: punctuation and casing, as in Multi30k.
    for split, n, seed in (("train", 100, 1), ("val", 10, 2), ("test_2016", 6, 3)):
        pairs = [(e.capitalize().replace(" .", "."), f.capitalize().replace(" .", "."))
                 for e, f in toy_corpus.generate(n, seed)]
        text.write_lines(data / f"{split}.en", [p[0] for p in pairs])
        text.write_lines(data / f"{split}.fr", [p[1] for p in pairs])
    cfg = _tiny_config(tmp_path, train=data / "train", valid=data / "val", test=data / "test_2016",
                       max_lines=60)
    first = run.run_pipeline(cfg)
    rows = run.run_pipeline(cfg)  # the same command again: everything is complete, nothing is redone
    assert rows == first
    assert len(text.read_lines(tmp_path / "work" / "raw" / "train.en")) == 60
    assert len(text.read_lines(tmp_path / "work" / "logs" / "tf" / "test.beam1.fr")) == 6
    assert rows[0]["updates"] == 2


def test_pipeline_rejects_incomplete_file_arguments(tmp_path):
    with pytest.raises(SystemExit, match="--train, --valid and --test"):
        run.run_pipeline(_tiny_config(tmp_path, train=tmp_path / "x"))
    assert not (tmp_path / "work").exists()


def _write_pairs(prefix, n, seed, langs=("en", "fr")):
    pairs = list(toy_corpus.generate(n, seed))
    text.write_lines(f"{prefix}.{langs[0]}", [p[0] for p in pairs])
    text.write_lines(f"{prefix}.{langs[1]}", [p[1] for p in pairs])


def test_a_finished_workdir_survives_bad_commands_and_an_interrupted_run_resumes(tmp_path, monkeypatch, capsys):
    """A typo'd path or a different run pointed at a finished workdir changes nothing in it (byte for
    byte); a run interrupted during the fine-tuning resumes with the same command -- completed stages are
    skipped, an interrupted training continues from its own checkpoint_last.pt."""
    cfg = _tiny_config(tmp_path, finetune_updates=2, soft_beam_size=2, soft_beam_candidates=10, topk_attn_k=2)
    real = run.run_logged

    def killed_at_soft_beam(cmd, log_path, env=None):
        if log_path.endswith("train.ft_soft_beam.log"):
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C when this training started
        return real(cmd, log_path, env)

    monkeypatch.setattr(run, "run_logged", killed_at_soft_beam)
    with pytest.raises(KeyboardInterrupt):
        run.run_pipeline(cfg)
    monkeypatch.setattr(run, "run_logged", real)
    work = tmp_path / "work"
    assert not (work / "results.md").exists()
    # A kill after the soft beam fine-tuning's first update leaves its own checkpoint at update 1: make that
    # checkpoint for real (the same fine-tuning command, stopped at 1 update).
    one = dataclasses.replace(cfg, finetune_updates=1)
    real([*run.fairseq_cmd("train"), *run.finetune_args(one, str(work / "bin"),
                                                          str(work / "checkpoints" / "tf" / "checkpoint_last.pt"),
                                                          str(work / "checkpoints" / "ft_soft_beam"),
                                                          run.finetune_runs(one)["soft_beam"][1])],
         str(tmp_path / "partial.log"), run.subprocess_env(cfg))
    capsys.readouterr()
    rows = run.run_pipeline(cfg)
    out = capsys.readouterr().out
    assert "resuming: completed stages are skipped" in out
    for name in ("raw", "bpe", "bin", "train.tf", "train.ft_tf"):
        assert f"already complete ({name}): skipped" in out
    assert "resuming from" in out and "ft_soft_beam" in out
    log = (work / "logs" / "train.ft_soft_beam.log").read_text()
    assert "ft_soft_beam/checkpoint_last.pt (epoch 1 @ 1 updates)" in log  # continued, not restarted
    assert "checkpoints/tf/checkpoint_last.pt" not in log and "num_updates 2" in log
    _assert_fine_tuned(rows, work)  # the resumed run finishes every fine-tuning as an uninterrupted one

    finished = snapshot(work)
    with pytest.raises(SystemExit, match="missing file"):
        run.run_pipeline(_tiny_config(tmp_path, train=tmp_path / "typo", valid=tmp_path / "v", test=tmp_path / "t"))
    with pytest.raises(SystemExit, match="holds a different run.*max_update"):
        run.run_pipeline(_tiny_config(tmp_path, finetune_updates=2, soft_beam_size=2, soft_beam_candidates=10,
                                      topk_attn_k=2, max_update=3))
    assert snapshot(work) == finished


def test_every_option_that_defines_the_run_names_the_first_stage_it_changes():
    """A corrected option is taken while its stage is incomplete: each option that defines the run must say which
    stage that is (a forgotten one would refuse every correction of it, as an option of the whole run)."""
    defining = {f.name for f in dataclasses.fields(run.Config)} - set(workdir.NOT_PART_OF_THE_RUN)
    assert set(run.FIRST_STAGE_CHANGED) == defining
    assert set(run.FIRST_STAGE_CHANGED.values()) <= set(run.STAGES)


def test_an_option_that_failed_at_its_stage_is_corrected_in_place(tmp_path, monkeypatch, capsys):
    """A sentencepiece --bpe-size the corpus cannot fill fails at the BPE stage, after the raw text: the corrected
    command goes on in the same workdir (it was refused as a different run). A training interrupted, then
    started again with another of its options, starts over rather than continue the old options' checkpoint;
    once a stage completes, its options are the run's."""
    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="Vocabulary size too high"):
        run.run_pipeline(_tiny_config(tmp_path, bpe="sentencepiece", bpe_size=5000))
    assert workdir.Stages(str(work)).names() == ["raw"]
    real = run.run_logged

    def killed_at_training(cmd, log_path, env=None):
        if log_path.endswith("train.tf.log"):
            raise KeyboardInterrupt
        return real(cmd, log_path, env)

    monkeypatch.setattr(run, "run_logged", killed_at_training)
    with pytest.raises(KeyboardInterrupt):
        run.run_pipeline(_tiny_config(tmp_path, bpe="sentencepiece"))
    monkeypatch.setattr(run, "run_logged", real)
    capsys.readouterr()
    assert workdir.Stages(str(work)).names() == ["bin", "bpe", "raw"]
    (work / "checkpoints" / "tf").mkdir(parents=True)
    (work / "checkpoints" / "tf" / "checkpoint_last.pt").write_bytes(b"the old options' training")
    rows = run.run_pipeline(_tiny_config(tmp_path, bpe="sentencepiece", max_tokens=400))
    out = capsys.readouterr().out
    assert "options of stages not completed yet changed (max_tokens)" in out
    assert "already complete (bin): skipped" in out and "resuming from" not in out
    assert [row["run"] for row in rows] == ["teacher forcing"]
    finished = snapshot(work)
    with pytest.raises(SystemExit, match=r"it differs in: bpe_size, which its completed stage bpe was made with"):
        run.run_pipeline(_tiny_config(tmp_path, bpe="sentencepiece", bpe_size=60, max_tokens=400))
    with pytest.raises(SystemExit, match=r"it differs in: max_tokens, which its completed stage train.tf was made"):
        run.run_pipeline(_tiny_config(tmp_path, bpe="sentencepiece"))
    assert snapshot(work) == finished


def test_a_directory_of_unknown_files_is_refused_not_wiped(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("precious")
    with pytest.raises(SystemExit, match="holds no run.json"):
        run.run_pipeline(_tiny_config(tmp_path))
    assert os.listdir(work) == ["thesis.tex"] and (work / "thesis.tex").read_text() == "precious"


def test_bad_options_are_refused_all_at_once_before_the_workdir_is_touched(tmp_path):
    """A bad option found after the training (a beam size of 0 at the scoring stage, a soft beam-search flag
    when the fine-tuning starts) would cost the training: every option is checked first, one line each, the
    soft beam-search and top-k attention ones by the criterion's and the layers' own rules."""
    cfg = _tiny_config(tmp_path, beams=[5, 0], max_update=0, lr=float("nan"), src="en", tgt="en",
                       soft_beam_candidates=2, teacher_forcing_ratio=1.5, topk_attn_epsilon=0.0)
    with pytest.raises(SystemExit) as refused:
        run.run_pipeline(cfg)
    assert str(refused.value).splitlines() == [
        "option error:",
        "  --src and --tgt must be two different languages, got 'en' and 'en'",
        "  --max-update must be >= 1, got 0",
        "  --lr must be a finite number > 0, got nan",
        "  --beams must be one or more distinct beam sizes >= 1, got [5, 0]",
        "  --teacher-forcing-ratio must be in [0, 1], got 1.5",
        "  --soft-beam-candidates must be 0 (all) or >= --soft-beam-size (5), got 2",
        "  --topk-attn-epsilon must be a finite number > 0, got 0.0"]
    assert not (tmp_path / "work").exists()
    assert run.option_problems(_tiny_config(tmp_path)) == []  # the defaults pass


def test_the_toy_corpus_takes_no_other_languages_and_no_line_limit(tmp_path):
    """Without --train the corpus is generated English and French: --src de --tgt en only renamed its files (a
    run labelled de->en that trained en->fr), and --max-lines was ignored."""
    assert run.option_problems(_tiny_config(tmp_path, src="de", tgt="en", max_lines=100)) == [
        "--src de --tgt en: the generated toy corpus is en->fr; give --train, --valid and --test for other languages",
        "--max-lines 100 limits --train files; the generated toy corpus's sizes are --toy-sizes"]


def test_a_workdir_that_cannot_be_a_directory_and_repeated_beams_are_option_errors(tmp_path):
    """--workdir naming a file (or a path below one) once ended in a FileExistsError traceback from makedirs;
    --beams 5 5 started a training whose table would hold one beam twice. Both are option errors now, before
    anything is written."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    for where, match in ((notes, "is a file, not a directory"), (notes / "work", "is a file, so no directory")):
        with pytest.raises(SystemExit, match=f"option error:\n  --workdir {where}.*{match}"):
            run.run_pipeline(_tiny_config(tmp_path, workdir=str(where)))
    assert notes.read_text() == "precious" and os.listdir(tmp_path) == ["notes.txt"]
    with pytest.raises(SystemExit, match=r"--beams must be one or more distinct beam sizes >= 1, got \[5, 5\]"):
        run.run_pipeline(_tiny_config(tmp_path, beams=[5, 5]))
    assert os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("problem, match", [
    ("unequal", r"3 lines in .en but 2 in .fr"),
    ("empty", r"train.fr: empty file"),
    ("latin1", r"train.fr: not UTF-8 text"),
    ("missing", r"val.fr: missing file"),
])
def test_bad_input_files_are_one_line_errors_before_anything_is_written(tmp_path, problem, match):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val", "test"):
        _write_pairs(data / split, 3, 1)
    if problem == "unequal":
        text.write_lines(data / "train.fr", ["un", "deux"])
    elif problem == "empty":
        (data / "train.fr").write_text("")
    elif problem == "latin1":
        (data / "train.fr").write_bytes("caf\xe9\n".encode("latin-1") * 3)
    else:
        os.unlink(data / "val.fr")
    with pytest.raises(SystemExit, match=match) as refused:
        run.run_pipeline(_tiny_config(tmp_path, train=data / "train", valid=data / "val", test=data / "test"))
    assert len(str(refused.value).splitlines()) == 2  # "input error:" and this one problem, nothing else wrong
    assert not (tmp_path / "work").exists()


def test_held_out_pairs_that_are_training_pairs_are_counted_and_a_test_set_that_is_the_training_data_warned(
        tmp_path, capsys):
    """`--test` naming the training data ran without a word (its BLEU measured recall); now a warning, and a
    note with the count when only some held-out pairs are training pairs (Multi30k: 2 of val, 1 of test)."""
    data = tmp_path / "data"
    data.mkdir()
    _write_pairs(data / "train", 6, 1)
    text.write_lines(data / "val.en", text.read_lines(data / "train.en")[:2] + ["a new line"])
    text.write_lines(data / "val.fr", text.read_lines(data / "train.fr")[:2] + ["une ligne"])
    _write_pairs(data / "test", 3, 99)
    splits = {"train": str(data / "train"), "valid": str(data / "val"), "test": str(data / "test")}
    workdir.check_inputs(splits, ("en", "fr"))
    assert capsys.readouterr().out == f"note: 2 of 3 --valid pairs ({data / 'val'}) are also --train pairs\n"
    workdir.check_inputs({**splits, "test": str(data / "train")}, ("en", "fr"))
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (f"warning: every --test pair ({data / 'train'}) is also a --train pair: its BLEU will "
                      "measure recall of the training data, not translation")
    workdir.check_inputs({**splits, "test": str(data / "train")}, ("en", "fr"), max_lines=3)  # train: 3 pairs
    assert capsys.readouterr().out.splitlines()[1] == (
        f"note: 3 of 6 --test pairs ({data / 'train'}) are also --train pairs")


def test_pipeline_runs_from_an_installed_package_in_any_directory(tmp_path):
    """`pip install .` (here: the wheel, into a target directory), then the pipeline from another directory:
    the user dir fairseq gets and the C kernels' source come from the installed package, not the clone."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(repo, source, ignore=shutil.ignore_patterns(".venv", ".git", "work", "build", "*.egg-info",
                                                                 "__pycache__", ".gpu", ".hypothesis"))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)], check=True,
                   capture_output=True)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), *map(str, wheels.glob("*.whl"))],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), SOFTTOPK_CACHE_DIR=str(tmp_path / "cache"))
    probe = subprocess.run([sys.executable, "-c", "import softtopk_fairseq as s; print(s.__file__); print(s.user_dir())"],
                           cwd=elsewhere, env=env, capture_output=True, text=True)
    module, user_dir = probe.stdout.split()
    assert module.startswith(str(site)) and user_dir.startswith(str(site)) and os.path.isdir(user_dir)
    assert (site / "softtopk_fairseq" / "ops" / "soft_topk_cpu.c").is_file()
    out = subprocess.run([sys.executable, "-m", "softtopk_fairseq.pipeline", "--toy-sizes", "120", "10", "8",
                          "--bpe-size", "80", "--size", "tiny", "--max-update", "2", "--max-tokens", "500",
                          "--warmup", "1", "--beams", "1", "--finetune-updates", "0"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (elsewhere / "work" / "demo" / "results.md").is_file()  # the default workdir, in the current directory
    assert f"--user-dir {user_dir}" in out.stdout
    # Using the trained model from there too: translate and score with the installed package.
    work = str(elsewhere / "work" / "demo")
    out = subprocess.run([sys.executable, "-m", "softtopk_fairseq.pipeline", "translate", "--workdir", work,
                          "--beam", "1"], input="a man rides a horse .\n\nthe dog runs .\n", cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.split("\n")) == 4 and out.stdout.split("\n")[1] == ""
    out = subprocess.run([sys.executable, "-m", "softtopk_fairseq.pipeline", "score", "--workdir", work, "--test",
                          os.path.join(work, "raw", "test"), "--beam", "1"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tf on " in out.stdout and "sacrebleu nrefs:1|" in out.stdout


def test_run_logged_writes_each_line_to_the_log_while_the_command_runs(tmp_path):
    """`tail -f` on a long fairseq-train log must show progress: before, the log (and a Python child's pipe)
    held output back in 8 KiB blocks until the run ended."""
    import sys
    import threading
    import time

    log = tmp_path / "run.log"
    cmd = [sys.executable, "-c", "import time; print('first line'); time.sleep(4); print('second')"]
    worker = threading.Thread(target=run.run_logged, args=(cmd, str(log)), kwargs={"echo": False})
    worker.start()
    deadline = time.time() + 3
    while time.time() < deadline and "first line" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.1)
    seen = log.read_text()
    worker.join()
    assert "first line" in seen and "second" not in seen  # read while the command was still running
    assert log.read_text() == "first line\nsecond\n"
