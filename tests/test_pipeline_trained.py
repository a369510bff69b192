"""Using a finished pipeline workdir: `translate` and `score`, and the hub interface behind them,
apply the workdir's own tokeniser, BPE, dictionaries and detokeniser."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from softtopk_fairseq.pipeline import run, text, toy_corpus, trained


def _finished_workdir(root, bpe, arch):
    cfg = run.parse_args(["--workdir", str(root / "work"), "--toy-sizes", "150", "10", "12", "--bpe-size", "80",
                          "--size", "tiny", "--max-update", "3", "--max-tokens", "500", "--warmup", "1",
                          "--beams", "2", "--finetune-updates", "0", "--bpe", bpe, "--arch", arch])
    run.run_pipeline(cfg)
    return cfg.workdir


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Finished workdirs, one per (BPE, arch), built once for the module."""
    cache = {}

    def get(bpe, arch):
        if (bpe, arch) not in cache:
            cache[bpe, arch] = _finished_workdir(tmp_path_factory.mktemp(bpe), bpe, arch)
        return cache[bpe, arch]
    return get


@pytest.fixture(params=[("subword_nmt", "transformer"), ("sentencepiece", "lstm")],
                ids=["subword_nmt", "sentencepiece"])
def workdir(request, finished):
    return finished(*request.param)


@pytest.fixture
def subword_workdir(finished):
    return finished("subword_nmt", "transformer")


def _write_pairs(prefix, pairs):
    pairs = list(pairs)
    text.write_lines(f"{prefix}.en", [p[0] for p in pairs])
    text.write_lines(f"{prefix}.fr", [p[1] for p in pairs])


def test_the_hub_interface_tokenises_and_detokenises_as_the_pipeline(workdir):
    """Model-independent: the hub's encoding of the raw test source is exactly the binarized test set the
    pipeline made, and its decoding of the binarized references is the pipeline's detokenised text."""
    from fairseq.data import data_utils

    hub = trained.from_workdir(workdir, "tf")
    raw = os.path.join(workdir, "raw", "test")
    for lang, dictionary in (("en", hub.src_dict), ("fr", hub.tgt_dict)):
        binarized = data_utils.load_indexed_dataset(os.path.join(workdir, "bin", f"test.en-fr.{lang}"), dictionary)
        lines = text.read_lines(f"{raw}.{lang}")
        assert len(binarized) == len(lines) == 12
        if lang == "en":  # the hub encodes source text (with the source language's Moses rules)
            for i, line in enumerate(lines):
                assert torch.equal(hub.encode(line), binarized[i]), line
        else:
            expected = text.moses_detokenize(text.moses_tokenize(lines, "fr"), "fr") \
                if hub.tokenizer is not None else lines
            assert [hub.decode(binarized[i]) for i in range(len(lines))] == expected


def test_the_docs_hub_example_runs_on_a_finished_workdir(subword_workdir):
    """docs/pipeline.md's "From Python" example as written, with this test's workdir for work/demo and its
    teacher-forcing checkpoint (it has no fine-tuned ones)."""
    from readme_examples import python_blocks

    blocks = [b for b in python_blocks("docs/pipeline.md") if "from_workdir(" in b]
    assert len(blocks) == 1 and '"work/demo", checkpoint="ft_soft_beam"' in blocks[0]
    code = blocks[0].replace('"work/demo", checkpoint="ft_soft_beam"', f'{subword_workdir!r}, checkpoint="tf"')
    *setup, last = code.strip().splitlines()  # the translation, kept
    names = {}
    exec(compile("\n".join([*setup, f"result = {last}"]), "docs/pipeline.md", "exec"), names)
    assert isinstance(names["result"], str) and names["result"].strip()


def test_translation_reproduces_fairseq_generate_on_the_pipelines_test_set(workdir):
    hub = trained.from_workdir(workdir, "tf")
    hyps = trained.translate_lines(hub, text.read_lines(os.path.join(workdir, "raw", "test.en")), beam=2)
    assert hyps == text.read_lines(os.path.join(workdir, "logs", "tf", "test.beam2.fr"))
    assert isinstance(hub.translate("a man rides a horse .", beam=2, **trained.MAX_LEN), str)


def test_translate_command_keeps_every_line_in_order_and_empty_lines_empty(subword_workdir):
    source = text.read_lines(os.path.join(subword_workdir, "raw", "test.en"))[:4]
    lines = [source[0], "", source[1], "   ", source[2], source[3]]
    out = subprocess.run([sys.executable, "-m", "softtopk_fairseq.pipeline", "translate", "--workdir",
                          subword_workdir, "--beam", "2"], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = out.stdout.split("\n")
    assert got[-1] == "" and len(got) - 1 == len(lines)  # one line out per line in, nothing else on stdout
    got = got[:-1]
    assert got[1] == "" and got[3] == "" and all(got[i] for i in (0, 2, 4, 5))
    hub = trained.from_workdir(subword_workdir, "tf")
    assert [got[i] for i in (0, 2, 4, 5)] == trained.translate_lines(hub, source, beam=2)
    assert "translated 6 lines" in out.stderr


def test_translate_command_errors_are_one_line_and_nonzero(subword_workdir, tmp_path):
    def translate(args, data=b"a man .\n"):
        return subprocess.run([sys.executable, "-m", "softtopk_fairseq.pipeline", "translate", *args], input=data,
                              capture_output=True, timeout=300)

    out = translate(["--workdir", subword_workdir, "--checkpoint", "ft_soft_beam"])
    assert out.returncode != 0 and b"no finished checkpoint 'ft_soft_beam'; this workdir has: tf" in out.stderr
    out = translate(["--workdir", str(tmp_path)])
    assert out.returncode != 0 and b"no run.json" in out.stderr
    out = translate(["--workdir", subword_workdir], data=b"a man .\n\xe9t\xe9\n")
    assert out.returncode != 0 and b"standard input, line 2: not UTF-8" in out.stderr and out.stdout == b""
    out = translate(["--workdir", subword_workdir, "--beam", "0"])
    assert out.returncode == 2 and out.stderr.splitlines()[-1].endswith(b"error: --beam must be >= 1, got 0")

    class Unread:  # standard input from a terminal: read only once the workdir and checkpoint are known good
        def __iter__(self):
            pytest.fail("the input was read before the workdir and checkpoint were checked")

    for workdir, checkpoint, said in [(str(tmp_path), "tf", "no run.json"),
                                      (subword_workdir, "ft_tf", "no finished checkpoint 'ft_tf'")]:
        with pytest.raises(SystemExit, match=said):
            trained.translate(workdir, checkpoint, 2, Unread(), sys.stdout)


def test_score_adds_further_test_sets_to_the_results(subword_workdir, tmp_path, capsys):
    extra = [tmp_path / "extra1", tmp_path / "extra2"]
    _write_pairs(extra[0], toy_corpus.generate(7, seed=11))
    _write_pairs(extra[1], toy_corpus.generate(5, seed=12))
    before = open(os.path.join(subword_workdir, "results.md"), encoding="utf-8").read()
    rows = trained.score(subword_workdir, [str(p) for p in extra], None, beam=2)
    assert [(r["checkpoint"], os.path.basename(r["test"]), r["sentences"]) for r in rows] == [
        ("tf", "extra1", 7), ("tf", "extra2", 5)]
    assert all(0.0 <= r["bleu"] <= 100.0 and r["signature"].startswith("nrefs:1|") for r in rows)
    out = capsys.readouterr().out
    assert "tf on " in out and "sacrebleu nrefs:1|" in out
    results = open(os.path.join(subword_workdir, "results.md"), encoding="utf-8").read()
    assert results.startswith(before.rstrip("\n")) and trained.SCORES_HEADING in results
    assert f"| {extra[1]} | tf | 2 | 5 | {rows[1]['bleu']:.2f} |" in results
    # The BLEU is sacrebleu's on the detokenised translations of the same hub interface.
    import sacrebleu

    hub = trained.from_workdir(subword_workdir, "tf")
    hyps = trained.translate_lines(hub, text.read_lines(f"{extra[0]}.en"), beam=2)
    assert round(sacrebleu.corpus_bleu(hyps, [text.read_lines(f"{extra[0]}.fr")]).score, 2) == rows[0]["bleu"]
    # Re-running the finished pipeline (all stages complete) rewrites its table and keeps the scored rows.
    cfg = run.parse_args(["--workdir", subword_workdir, "--toy-sizes", "150", "10", "12", "--bpe-size", "80",
                          "--size", "tiny", "--max-update", "3", "--max-tokens", "500", "--warmup", "1",
                          "--beams", "2", "--finetune-updates", "0"])
    run.run_pipeline(cfg)
    results = open(os.path.join(subword_workdir, "results.md"), encoding="utf-8").read()
    assert results.count(trained.SCORES_HEADING) == 1 and f"| {extra[1]} | tf |" in results
    with open(os.path.join(subword_workdir, trained.SCORES_FILE), encoding="utf-8") as f:
        assert [json.loads(line)["sentences"] for line in f] == [7, 5]
    # Scored again: recorded again, shown once (it was a duplicate row); the signature's "|" stay in its cell.
    trained.score(subword_workdir, [str(extra[1])], None, beam=2)
    results = open(os.path.join(subword_workdir, "results.md"), encoding="utf-8").read()
    table = [line for line in results.splitlines() if line.startswith(f"| {tmp_path}")]
    assert len(table) == 2 and all(len(re.split(r"(?<!\\)\|", line)) == 8 for line in table), table


def test_score_checks_every_input_before_loading_a_model(subword_workdir, tmp_path):
    bad = tmp_path / "bad"
    text.write_lines(f"{bad}.en", ["a man .", "a dog ."])
    text.write_lines(f"{bad}.fr", ["un homme ."])
    with pytest.raises(SystemExit, match=r"bad: 2 lines in \.en but 1 in \.fr"):
        trained.score(subword_workdir, [str(bad)], None, beam=2)
    with pytest.raises(SystemExit, match=r"missing\.en: missing file \(give --test PREFIX"):
        trained.score(subword_workdir, [str(tmp_path / "missing")], None, beam=2)
    with pytest.raises(SystemExit, match="no finished checkpoint 'ft_tf'"):
        trained.score(subword_workdir, [str(bad)], ["ft_tf"], beam=2)
    assert not os.path.exists(os.path.join(subword_workdir, trained.SCORES_FILE)) or all(
        "bad" not in line for line in open(os.path.join(subword_workdir, trained.SCORES_FILE)))
