"""The demo pipeline's pieces on a tiny slice: both BPE back-ends, toy data and files given by path."""
import os

import pytest

from softtopk_fairseq.pipeline import run, text, toy_corpus


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
            "--size", "tiny", "--max-update", "2", "--max-tokens", "500", "--warmup", "1", "--beams", "1", "2",
            "--finetune-updates", "0"]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    return run.parse_args(args)


@pytest.mark.parametrize("bpe,arch", [("subword_nmt", "transformer"), ("sentencepiece", "lstm")])
def test_pipeline_end_to_end_on_toy_data(tmp_path, bpe, arch):
    rows = run.run_pipeline(_tiny_config(tmp_path, bpe=bpe, arch=arch))
    assert [r["run"] for r in rows] == ["teacher forcing"]
    assert set(rows[0]["bleu"]) == {1, 2}
    assert all(0.0 <= b <= 100.0 for b in rows[0]["bleu"].values())
    results = (tmp_path / "work" / "results.md").read_text()
    assert "| teacher forcing |" in results and "BLEU beam 2" in results
    hyps = text.read_lines(tmp_path / "work" / "logs" / "tf" / "test.beam2.fr")
    assert len(hyps) == 8


def test_pipeline_fine_tunes_with_soft_beam_search_and_topk_attention(tmp_path):
    cfg = _tiny_config(tmp_path, finetune_updates=2, soft_beam_size=2, soft_beam_candidates=10, topk_attn_k=2)
    rows = run.run_pipeline(cfg)
    assert [r["run"].split(" (")[0].split(",")[0] for r in rows] == [
        "teacher forcing", "+ 2 teacher forcing", "+ 2 soft beam search", "+ 2 teacher forcing"]
    assert [r["arch"] for r in rows] == ["transformer"] * 3 + ["transformer_topk_attn"]
    assert [r["updates"] for r in rows] == [2, 4, 4, 4]
    logs = tmp_path / "work" / "logs"
    log = (logs / "train.ft_soft_beam.log").read_text()
    assert "soft_loss" in log and "num_updates 2" in log and "loaded checkpoint" in log.lower()
    log = (logs / "train.ft_topk_attn.log").read_text()
    assert "TopkMultiheadAttention" in log and "loaded checkpoint" in log.lower()
    for key in ("ft_tf", "ft_soft_beam", "ft_topk_attn"):
        assert len(text.read_lines(logs / key / "test.beam1.fr")) == 8
    results = (tmp_path / "work" / "results.md").read_text()
    assert "+ 2 soft beam search" in results and "SOFT top-k attention" in results


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
    run.run_pipeline(cfg)
    rows = run.run_pipeline(cfg)  # a second run in the same workdir starts afresh
    assert len(text.read_lines(tmp_path / "work" / "raw" / "train.en")) == 60
    assert len(text.read_lines(tmp_path / "work" / "logs" / "tf" / "test.beam1.fr")) == 6
    assert rows[0]["updates"] == 2


def test_pipeline_rejects_incomplete_file_arguments(tmp_path):
    with pytest.raises(SystemExit, match="--train, --valid and --test"):
        run.prepare_raw(_tiny_config(tmp_path, train=tmp_path / "x"), str(tmp_path / "raw"))
