"""examples/wmt14_en_fr end to end on a small slice of generated en-fr text, as a user runs it: prepare.py
(local files), train.sh, finetune_soft_beam.sh, train_topk_attn.sh and evaluate.sh with tiny models; and the
WMT14 collection step on a fake download (no network in tests)."""
import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from fairseq_cli import REPO_ROOT, TINY_SIZES
from softtopk_fairseq.pipeline import text, toy_corpus

RECIPE = os.path.join(REPO_ROOT, "examples", "wmt14_en_fr")
sys.path.insert(0, RECIPE)
import prepare  # noqa: E402  (the recipe's script, imported for its helpers)

TINY_TRAIN = ["--cpu", "--max-tokens", "600", "--batch-size", "16", "--log-interval", "1",
              "--save-interval-updates", "0", "--num-workers", "0", *TINY_SIZES["rnnsearch"]]


def _run(*cmd, env_extra=None):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.run([*map(str, cmd)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, f"{cmd[:2]} failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    return proc.stdout


def _write_corpus(root, sizes=(240, 20, 12)):
    prefixes = {}
    for (split, n), seed in zip(zip(("train", "valid", "test"), sizes), (1, 2, 3)):
        prefixes[split] = str(root / split)
        toy_corpus.write_split(prefixes[split], n, seed, ("en", "fr"))
    return prefixes


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("wmt14_slice")
    raw = _write_corpus(root)
    dest = root / "data"
    out = _run(sys.executable, os.path.join(RECIPE, "prepare.py"), "--dest", dest, "--train", raw["train"],
               "--valid", raw["valid"], "--test", raw["test"], "--max-lines", 200, "--bpe-size", 100,
               "--workers", 2)
    return root, dest, raw, out


def test_prepare_builds_fairseq_data_and_keeps_the_raw_references(prepared):
    _, dest, raw, out = prepared
    assert "train: 200 sentence pairs" in out  # --max-lines, and the toy text survives cleaning
    for split in ("train", "valid", "test"):
        for lang in ("en", "fr"):
            assert (dest / "bin" / f"{split}.en-fr.{lang}.bin").exists()
    assert text.read_lines(dest / "ref" / "test.fr") == text.read_lines(raw["test"] + ".fr")
    bpe_lines = text.read_lines(dest / "bpe" / "train.fr")
    assert len(bpe_lines) == 200 and any("@@" in line for line in bpe_lines)


def test_prepare_refuses_a_missing_or_misaligned_input_in_one_line_and_keeps_the_earlier_data(prepared, tmp_path):
    """Under a worker pool a bad file once ended the pool's feeding thread and left prepare.py waiting for ever,
    after it had deleted DEST/bin; --sources-only on an unprepared DEST was a traceback. The earlier preparation
    stays whole: a run stopped after it had started writing left new ref/tok/bpe files beside the old bin/ (a
    stale BPE model then decoded the other data)."""
    _, prepared_dest, raw, _ = prepared
    dest = tmp_path / "data"  # (a copy: the module's other tests read the prepared one)
    shutil.copytree(prepared_dest, dest)

    def contents():
        return {str(path.relative_to(dest)): path.read_bytes() for name in ("ref", "tok", "bpe", "bin")
                for path in sorted((dest / name).rglob("*")) if path.is_file()}

    before = contents()
    short = tmp_path / "short"
    short.with_suffix(".en").write_text("a b\nc d\n", encoding="utf-8")
    short.with_suffix(".fr").write_text("e f\n", encoding="utf-8")
    nope = tmp_path / "nope"
    for train, said in [(nope, f"prepare.py: missing corpus file {nope}.en (or {nope}.en.gz)"),
                        (short, f"prepare.py: {short}.en and {short}.fr have different numbers of lines")]:
        proc = subprocess.run([sys.executable, os.path.join(RECIPE, "prepare.py"), "--dest", str(dest), "--train",
                               str(train), "--valid", raw["valid"], "--test", raw["test"], "--workers", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        assert proc.returncode == 1 and proc.stdout.strip().splitlines()[-1] == said, proc.stdout[-2000:]
        assert contents() == before
    with pytest.raises(SystemExit, match="has no valid.SRC-TGT.*: prepare it first"):
        prepare.prepared_languages(str(tmp_path / "unprepared"))


@pytest.mark.parametrize("script", ["train.sh", "finetune_soft_beam.sh", "train_topk_attn.sh", "evaluate.sh",
                                    "translate.sh"])
def test_each_recipe_script_without_arguments_prints_its_header_comment_and_exits_2(script):
    path = os.path.join(RECIPE, script)
    proc = subprocess.run(["bash", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    header = list(itertools.takewhile(lambda line: line.startswith("#"), lines[1:]))
    assert proc.returncode == 2 and proc.stderr.splitlines() == header
    assert any(line.startswith(f"#   bash examples/wmt14_en_fr/{script} ") for line in header)


def test_clean_pairs_drops_empty_long_and_unbalanced_pairs():
    en = ["a b", "", "a " * 300, "a", "x y z"]
    fr = ["c d", "e", "b", "a b c d", "u v w"]
    assert prepare.clean_pairs(en, fr, max_len=250, max_ratio=1.5) == (["a b", "x y z"], ["c d", "u v w"])


def test_evaluate_refuses_a_missing_checkpoint_or_a_subset_without_references_before_decoding(prepared, tmp_path):
    """A mistyped checkpoint path left an empty folder behind; SUBSET=train decoded the whole set first."""
    _, dest, _, _ = prepared
    for env, checkpoint, said in [({}, tmp_path / "typo" / "checkpoint_best.pt", "checkpoint_best.pt not found"),
                                  ({"SUBSET": "train"}, tmp_path / "checkpoint.pt", "ref/train.fr not found")]:
        (tmp_path / "checkpoint.pt").touch()
        proc = subprocess.run(["bash", os.path.join(RECIPE, "evaluate.sh"), str(dest), str(checkpoint)],
                              env=dict(os.environ, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not (tmp_path / "typo").exists()


def test_a_failed_download_says_how_to_go_on_offline(tmp_path, monkeypatch):
    import urllib.error

    def offline(url, path):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(prepare.urllib.request, "urlretrieve", offline)
    with pytest.raises(prepare.CorpusError, match=rf"could not download {re.escape(prepare.WMT14_URLS[0])} .*no "
                                                  rf"network.*; offline, put the archive into {tmp_path} yourself"):
        prepare.download(str(tmp_path))


def test_collect_wmt14_reads_the_extracted_archives(tmp_path):
    orig = tmp_path / "orig"
    for i, corpus in enumerate(prepare.WMT14_TRAIN):
        for lang in ("en", "fr"):
            path = orig / f"{corpus}.{lang}"
            path.parent.mkdir(parents=True, exist_ok=True)
            if corpus.startswith("giga"):
                import gzip

                with gzip.open(str(path) + ".gz", "wt", encoding="utf-8") as f:
                    f.write(f"{corpus} {lang} line\n")
            else:
                path.write_text(f"{corpus} {lang} line\n", encoding="utf-8")
    for lang in ("en", "fr"):
        (orig / "dev").mkdir(exist_ok=True)
        (orig / f"{prepare.WMT14_VALID}.{lang}").write_text(f"valid {lang}\n", encoding="utf-8")
        sgm = orig / prepare.WMT14_TEST_SGM[lang]
        sgm.parent.mkdir(exist_ok=True)
        sgm.write_text('<srcset>\n<doc docid="d">\n<seg id="1"> A &amp; B </seg>\n<seg id="2">l&apos;homme</seg>\n'
                       "</doc>\n</srcset>\n", encoding="utf-8")
    train, valid, test = prepare.collect_wmt14(str(orig), str(tmp_path / "raw"))
    assert text.read_lines(train + ".fr") == [f"{c} fr line" for c in prepare.WMT14_TRAIN]
    assert text.read_lines(valid + ".en") == ["valid en"]
    assert text.read_lines(test + ".fr") == ["A & B", "l'homme"]


def test_local_sgm_valid_and_test_files_are_read_as_segments(tmp_path):
    """newstest-style SGML given as --test: its segments, not its markup lines, become the sentences (both the
    PREFIX.LANG and the PREFIX.LANG.sgm spellings); plain text is used as is."""
    doc = ('<refset setid="newstest2014" srclang="any">\n<doc docid="d1" genre="news">\n<p>\n'
           '<seg id="1">Le chat &amp; le chien</seg>\n<seg id="2"> l&apos;homme </seg>\n</p>\n</doc>\n'
           '<doc docid="d2">\n<seg id="3">fin</seg>\n</doc>\n</refset>\n')
    (tmp_path / "news.en").write_text(doc.replace("refset", "srcset"), encoding="utf-8")
    (tmp_path / "news.fr.sgm").write_text(doc, encoding="utf-8")
    prefix = prepare.local_split(str(tmp_path / "news"), "test", str(tmp_path / "raw"), ("en", "fr"))
    assert prefix == str(tmp_path / "raw" / "test")
    assert text.read_lines(prefix + ".fr") == ["Le chat & le chien", "l'homme", "fin"]
    assert len(text.read_lines(prefix + ".en")) == 3
    text.write_lines(tmp_path / "plain.en", ["a", "b"])
    text.write_lines(tmp_path / "plain.fr", ["c", "d"])
    assert prepare.local_split(str(tmp_path / "plain"), "valid", str(tmp_path / "raw"), ("en", "fr")) == str(tmp_path / "plain")


def test_prepare_rejects_mixed_or_missing_sources():
    with pytest.raises(SystemExit):
        prepare.parse_args(["--dest", "x", "--train", "a"])
    with pytest.raises(SystemExit):
        prepare.parse_args(["--dest", "x", "--download", "--train", "a", "--valid", "b", "--test", "c"])


def test_prepare_refuses_bad_numbers_before_any_work(capsys):
    """They failed hours later, inside subword-nmt or sentencepiece, with their tracebacks."""
    local = ["--dest", "x", "--train", "a", "--valid", "b", "--test", "c"]
    with pytest.raises(SystemExit):
        prepare.parse_args(local + ["--bpe-size", "0", "--max-len", "0", "--max-ratio", "0.5", "--workers", "0",
                                    "--max-lines", "-1"])
    assert ("--max-lines must be >= 0, got -1; --bpe-size must be >= 1, got 0; --max-len must be >= 1, got 0; "
            "--max-ratio must be >= 1, got 0.5; --workers must be >= 1, got 0") in capsys.readouterr().err
    assert prepare.parse_args(local).bpe == "subword_nmt"


def test_blind_sources_use_dests_bpe_and_translate_beside_the_test_set(prepared, tmp_path):
    """--sources-only finds DEST's BPE (naming another is refused), and translate.sh writes a blind set's
    hypotheses under its own name: they overwrote the test set's, leaving its score beside other hypotheses."""
    root, dest, raw, _ = prepared
    with pytest.raises(SystemExit, match=f"--bpe sentencepiece: {dest} was prepared with --bpe subword_nmt"):
        prepare.prepare_sources_only(str(dest), [f"blind={raw['test']}.en"], "sentencepiece")
    _run(sys.executable, os.path.join(RECIPE, "prepare.py"), "--dest", dest, "--sources-only",
         f"blind={raw['test']}.en")
    ckpt = tmp_path / "tf"
    _run("bash", os.path.join(RECIPE, "train.sh"), dest, ckpt, *TINY_TRAIN, "--max-update", 1)
    test_hyps = _run("bash", os.path.join(RECIPE, "translate.sh"), dest, ckpt / "checkpoint_last.pt",
                     env_extra={"BEAM": "2"}).strip().splitlines()[-1]
    blind_hyps = _run("bash", os.path.join(RECIPE, "translate.sh"), dest, ckpt / "checkpoint_last.pt",
                      env_extra={"BEAM": "2", "BIN": str(dest / "sources" / "blind" / "bin")}).strip().splitlines()[-1]
    assert test_hyps == str(ckpt / "test.beam2.fr") and blind_hyps == str(ckpt / "blind.test.beam2.fr")
    assert text.read_lines(test_hyps) == text.read_lines(blind_hyps)  # (the same sources: the same translations)
    # Prepared again, DEST's blind sets go with the preparation whose BPE and dictionaries encoded them.
    again = tmp_path / "again"
    shutil.copytree(dest, again)
    _run(sys.executable, os.path.join(RECIPE, "prepare.py"), "--dest", again, "--train", raw["train"], "--valid",
         raw["valid"], "--test", raw["test"], "--max-lines", 200, "--bpe-size", 100, "--workers", 1)
    assert sorted(os.listdir(again)) == sorted(set(os.listdir(dest)) - {"sources"})


def test_recipe_trains_fine_tunes_and_evaluates(prepared):
    root, dest, _, _ = prepared
    ckpt = root / "ckpt"
    out = _run("bash", os.path.join(RECIPE, "train.sh"), dest, ckpt / "tf", *TINY_TRAIN, "--max-update", 3)
    assert "num_updates 3" in out or "num_updates=3" in out
    pretrained = ckpt / "tf" / "checkpoint_last.pt"
    finetune = ("bash", os.path.join(RECIPE, "finetune_soft_beam.sh"), dest, pretrained, ckpt / "soft_beam",
                *TINY_TRAIN, "--soft-beam-size", 2, "--soft-beam-candidates", 8,
                "--soft-beam-epsilon", 0.05)  # (the flag as documented overrides the script's)
    out = _run(*finetune, "--max-update", 2)
    assert "soft_loss" in out and f"loading pretrained model from {pretrained}" in out
    assert "soft_beam_epsilon=0.05" in out.replace("'", "").replace(": ", "=")
    out = _run(*finetune, "--max-update", 3)  # run again: it resumes from its own last checkpoint
    assert "loading pretrained model" not in out
    assert re.search(r"Loaded checkpoint \S*soft_beam/checkpoint_last\.pt \(epoch \d+ @ 2 updates\)", out), out
    assert "num_updates 3" in out or "num_updates=3" in out
    out = _run("bash", os.path.join(RECIPE, "train_topk_attn.sh"), dest, ckpt / "topk_attn", *TINY_TRAIN,
               "--max-update", 2)
    assert "rnnsearch_topk_attn" in out
    # the modes by their current names, as given (an old name would be kept in the logged arguments, resolved later)
    assert "topk_attn_mode=soft_topk" in out.replace("'", "").replace(": ", "=")
    for run in ("soft_beam", "topk_attn"):
        out = _run("bash", os.path.join(RECIPE, "evaluate.sh"), dest, ckpt / run / "checkpoint_last.pt",
                   env_extra={"BEAM": "2", "SUBSET": "valid"})
        score = json.loads(out[out.index("{"):])
        assert score["name"] == "BLEU" and 0.0 <= score["score"] <= 100.0
        hyps = text.read_lines(ckpt / run / "valid.beam2.fr")
        assert len(hyps) == 20 and "@@" not in " ".join(hyps)
        assert float((ckpt / run / "valid.beam2.bleu").read_text()) == pytest.approx(score["score"], abs=0.01)
