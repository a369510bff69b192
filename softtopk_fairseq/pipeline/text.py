"""Text processing for the pipeline: Moses (de)tokenisation and joint BPE (subword-nmt or sentencepiece).

Two BPE back-ends, chosen with ``--bpe``:

* ``subword_nmt``: Moses-tokenise, learn joint BPE merges on source + target training text, split words
  with ``@@`` continuation markers; fairseq removes them with ``--remove-bpe`` (``"@@ "``).
* ``sentencepiece``: a joint BPE model learned on raw text (no pre-tokenisation); fairseq removes the
  pieces with ``--remove-bpe sentencepiece``.
"""
import os
from typing import Iterable, List, Sequence

BPE_METHODS = ("subword_nmt", "sentencepiece")
# What fairseq-generate's --remove-bpe takes for each back-end.
REMOVE_BPE = {"subword_nmt": "@@ ", "sentencepiece": "sentencepiece"}


def read_lines(path: str, max_lines: int = 0) -> List[str]:
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:max_lines] if max_lines > 0 else lines


def write_lines(path: str, lines: Iterable[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def moses_normalize(lines: Sequence[str], lang: str) -> List[str]:
    """Moses punctuation normalisation (quotes, dashes, spaces), as fairseq's WMT recipes do before tokenising."""
    from sacremoses import MosesPunctNormalizer

    norm = MosesPunctNormalizer(lang=lang)
    return [norm.normalize(line) for line in lines]


def moses_tokenize(lines: Sequence[str], lang: str) -> List[str]:
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, return_str=True, escape=False) for line in lines]


def moses_detokenize(lines: Sequence[str], lang: str) -> List[str]:
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


class JointBPE:
    """A joint source+target BPE model: ``learn`` on training text, then ``encode`` lines."""

    def __init__(self, method: str, model_dir: str):
        if method not in BPE_METHODS:
            raise ValueError(f"unknown BPE method {method!r}; choose from {BPE_METHODS}")
        self.method = method
        self.model_dir = model_dir
        self._codec = None

    @property
    def pretokenize(self) -> bool:
        """subword-nmt works on Moses-tokenised words; sentencepiece on raw text."""
        return self.method == "subword_nmt"

    @property
    def model_path(self) -> str:
        name = "bpe.codes" if self.method == "subword_nmt" else "spm.model"
        return os.path.join(self.model_dir, name)

    def learn(self, train_files: Sequence[str], size: int) -> None:
        """Learn ``size`` merges (subword-nmt) or a ``size``-piece vocabulary (sentencepiece)."""
        os.makedirs(self.model_dir, exist_ok=True)
        if self.method == "subword_nmt":
            from subword_nmt.learn_bpe import learn_bpe

            joint = os.path.join(self.model_dir, "joint.txt")
            with open(joint, "w", encoding="utf-8") as out:
                for path in train_files:
                    with open(path, encoding="utf-8") as f:
                        out.write(f.read())
            with open(joint, encoding="utf-8") as inp, open(self.model_path, "w", encoding="utf-8") as out:
                learn_bpe(inp, out, size, min_frequency=2)
            os.remove(joint)
        else:
            import sentencepiece as spm

            spm.SentencePieceTrainer.train(
                input=",".join(train_files),
                model_prefix=self.model_path[: -len(".model")],
                vocab_size=size,
                model_type="bpe",
                character_coverage=1.0,
                # fairseq's dictionary adds <s> <pad> </s> <unk> itself.
                bos_id=-1, eos_id=-1, unk_id=0,
                # WMT-sized input: learn on a 10M-sentence sample instead of loading every line.
                input_sentence_size=10_000_000, shuffle_input_sentence=True,
                minloglevel=2,
            )
        self._codec = None

    def encode(self, lines: Sequence[str]) -> List[str]:
        if self._codec is None:
            if self.method == "subword_nmt":
                from subword_nmt.apply_bpe import BPE

                with open(self.model_path, encoding="utf-8") as f:
                    self._codec = BPE(f)
            else:
                import sentencepiece as spm

                self._codec = spm.SentencePieceProcessor(model_file=self.model_path)
        if self.method == "subword_nmt":
            return [self._codec.process_line(line) for line in lines]
        return [" ".join(self._codec.encode(line, out_type=str)) for line in lines]
