"""Prepare WMT14 en-fr (or any line-aligned English-X text) for fairseq: the data step of the paper's setting.

    python examples/wmt14_en_fr/prepare.py --dest data/wmt14_en_fr --download           # WMT14, ~36M pairs
    python examples/wmt14_en_fr/prepare.py --dest data/slice --train DIR/train \\
        --valid DIR/val --test DIR/test --max-lines 2000 --bpe-size 1000                # local files, offline
    python examples/wmt14_en_fr/prepare.py --dest data/slice --sources-only NAME=FILE   # English to translate

Steps, as fairseq's ``examples/translation/prepare-wmt14en2fr.sh`` does them:

1. ``--download``: fetch the WMT14 corpora (Europarl v7, Common Crawl, UN, News Commentary v9, 10^9
   French-English) into ``DEST/orig`` (skipped for archives already there), concatenate them as the
   training set; newstest2013 is the validation set, newstest2014 (``full``) the test set. Offline: put the
   archives (``os.path.basename`` of each URL in ``WMT14_URLS``) into ``DEST/orig`` yourself and run with
   ``--download``; archives already there are not fetched, only extracted. Without ``--download``:
   ``--train/--valid/--test PREFIX`` name raw files ``PREFIX.en`` / ``PREFIX.TGT`` (``--tgt``, default ``fr``);
   for ``--valid``/``--test`` these (or ``PREFIX.en.sgm`` / ``PREFIX.TGT.sgm``) may be WMT SGML files, whose
   segments are extracted.
2. Read as UTF-8 (bytes that are not are replaced by U+FFFD, as WMT's crawled corpora need), Moses punctuation
   normalisation; with subword-nmt also Moses tokenisation (sentencepiece works on raw
   text); training pairs with an empty side, more than ``--max-len`` tokens or a length ratio above
   ``--max-ratio`` are dropped (fairseq's ``clean-corpus-n.perl 1 250`` with ratio 1.5).
3. Joint BPE learned on the training text: subword-nmt with ``--bpe-size`` merges (40,000, fairseq's
   and the paper's choice) or a sentencepiece BPE model with that vocabulary size.
4. ``fairseq-preprocess --joined-dictionary`` into ``DEST/bin``.

The untouched references go to ``DEST/ref/{valid,test}.{en,TGT}``; ``evaluate.sh`` scores against them with
detokenised sacrebleu. Large inputs are streamed in chunks over ``--workers`` processes. A missing input or sides of
different lengths stop the run with a one-line error. The run builds in ``DEST/.preparing`` (room for a second
copy of the data) and replaces ``DEST/{ref,tok,bpe,bin}`` together only at its end: a run that stops leaves an
earlier preparation whole, never mixed with the new one (a stale BPE model would decode the new data wrongly). The
earlier preparation's ``DEST/sources`` goes with it: prepare the blind sets again.

``--sources-only NAME=FILE ...`` on a prepared DEST: English text with no reference (a blind test set), normalised
and encoded as the training sources were, binarized with DEST's dictionaries into ``DEST/sources/NAME/bin``
(subset ``test``, no target side), for ``translate.sh`` (``BIN=DEST/sources/NAME/bin``). The BPE is DEST's own
(``--bpe``, if given, must name it).
"""
import argparse
import functools
import gzip
import html
import itertools
import multiprocessing
import os
import re
import shutil
import sys
import tarfile
import time
import urllib.request
from typing import Iterator, List, Optional, Sequence, Tuple

from softtopk_fairseq.pipeline import run, text

SRC = "en"
# fairseq's prepare-wmt14en2fr.sh, plus dev.tgz for newstest2013.
WMT14_URLS = [
    "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
    "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
    "http://statmt.org/wmt13/training-parallel-un.tgz",
    "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
    "http://statmt.org/wmt10/training-giga-fren.tar",
    "http://statmt.org/wmt14/dev.tgz",
    "http://statmt.org/wmt14/test-full.tgz",
]
# Training corpora inside the extracted archives: PREFIX.en / PREFIX.fr (giga-fren is gzipped).
WMT14_TRAIN = [
    "training/europarl-v7.fr-en",
    "commoncrawl.fr-en",
    "un/undoc.2000.fr-en",
    "training/news-commentary-v9.fr-en",
    "giga-fren.release2.fixed",
]
WMT14_VALID = "dev/newstest2013"
WMT14_TEST_SGM = {"en": "test-full/newstest2014-fren-src.en.sgm", "fr": "test-full/newstest2014-fren-ref.fr.sgm"}
CHUNK = 10000


def download(orig: str) -> None:
    """Fetch and extract every WMT14 archive into ``orig``; archives already there are not fetched again."""
    os.makedirs(orig, exist_ok=True)
    for url in WMT14_URLS:
        archive = os.path.join(orig, os.path.basename(url))
        if not os.path.exists(archive):
            print(f"downloading {url}", flush=True)
            partial = archive + ".part"
            try:
                urllib.request.urlretrieve(url, partial)
            except OSError as e:  # (urllib's URLError included)
                raise CorpusError(f"could not download {url} ({e}); offline, put the archive into {orig} yourself "
                                  "and run with --download again") from None
            os.replace(partial, archive)
        marker = archive + ".extracted"
        if not os.path.exists(marker):
            print(f"extracting {archive}", flush=True)
            with tarfile.open(archive) as tar:
                tar.extractall(orig, filter="data")
            open(marker, "w").close()


class CorpusError(Exception):
    """A bad input file, named. An ordinary exception, not SystemExit: raised while a worker pool reads the
    input, a SystemExit would end the pool's feeding thread silently and leave the run waiting for ever; main
    turns it into the one-line exit."""


def _corpus_path(path: str) -> str:
    """``path``, or ``path.gz`` when only that exists; CorpusError when neither does."""
    for candidate in (path, path + ".gz"):
        if os.path.exists(candidate):
            return candidate
    raise CorpusError(f"missing corpus file {path} (or {path}.gz)")


def _open_text(path: str):
    found = _corpus_path(path)
    if found.endswith(".gz") and found != path:
        return gzip.open(found, "rt", encoding="utf-8", errors="replace")
    return open(found, encoding="utf-8", errors="replace")


def read_sgm(path: str) -> List[str]:
    """The segments of a WMT ``.sgm`` file, in order, with XML entities decoded."""
    with open(path, encoding="utf-8") as f:
        return [html.unescape(m.group(1)).strip() for m in re.finditer(r"<seg[^>]*>(.*?)</seg>", f.read())]


def is_sgm(path: str) -> bool:
    """Whether ``path`` is a WMT SGML file (``<srcset>``/``<refset>``/``<tstset>`` with ``<seg>`` elements)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip().lower()
    return head.startswith("<") and "<seg" in head


def local_split(prefix: str, split: str, out: str, langs: Tuple[str, str]) -> str:
    """The prefix of plain, line-aligned text for a local ``--valid``/``--test`` PREFIX: PREFIX.LANG as is, or,
    when it (or PREFIX.LANG.sgm) is a WMT SGML file, its segments extracted into ``out/SPLIT.LANG`` (read as
    text, the markup lines would be binarized as sentences)."""
    paths, sgm = {}, {}
    for lang in langs:
        plain, tagged = f"{prefix}.{lang}", f"{prefix}.{lang}.sgm"
        paths[lang] = plain if os.path.exists(plain) else tagged if os.path.exists(tagged) else plain
        sgm[lang] = os.path.exists(paths[lang]) and is_sgm(paths[lang])
    if not any(sgm.values()):
        return prefix
    os.makedirs(out, exist_ok=True)
    lines = {lang: read_sgm(paths[lang]) if sgm[lang] else text.read_lines(paths[lang]) for lang in langs}
    src, tgt = langs
    if len(lines[src]) != len(lines[tgt]):
        raise CorpusError(f"{prefix}: {len(lines[src])} segments in .{src} but {len(lines[tgt])} in .{tgt}")
    for lang in langs:
        text.write_lines(os.path.join(out, f"{split}.{lang}"), lines[lang])
    print(f"{split}: read {', '.join(paths[lang] for lang in langs if sgm[lang])} as WMT SGML "
          f"({len(lines[src])} segments)", flush=True)
    return os.path.join(out, split)


def collect_wmt14(orig: str, out: str) -> Tuple[str, str, str]:
    """Concatenate the extracted WMT14 corpora into ``out/{train,valid,test}.{en,fr}``; return the prefixes."""
    os.makedirs(out, exist_ok=True)
    for lang in (SRC, "fr"):
        with open(os.path.join(out, f"train.{lang}"), "w", encoding="utf-8") as dst:
            for corpus in WMT14_TRAIN:
                with _open_text(os.path.join(orig, f"{corpus}.{lang}")) as src:
                    shutil.copyfileobj(src, dst)
        shutil.copyfile(os.path.join(orig, f"{WMT14_VALID}.{lang}"), os.path.join(out, f"valid.{lang}"))
        text.write_lines(os.path.join(out, f"test.{lang}"), read_sgm(os.path.join(orig, WMT14_TEST_SGM[lang])))
    return tuple(os.path.join(out, split) for split in ("train", "valid", "test"))


def read_pairs(prefix: str, langs: Tuple[str, str], max_lines: int = 0) -> Iterator[Tuple[List[str], List[str]]]:
    """Chunks of aligned (source lines, target lines) of ``prefix.SRC`` / ``prefix.TGT``; raise if they differ in
    length."""
    src, tgt = langs
    with _open_text(f"{prefix}.{src}") as f_src, _open_text(f"{prefix}.{tgt}") as f_tgt:
        pairs = itertools.zip_longest(f_src, f_tgt)
        if max_lines > 0:
            pairs = itertools.islice(pairs, max_lines)
        while True:
            chunk = list(itertools.islice(pairs, CHUNK))
            if not chunk:
                return
            if any(a is None or b is None for a, b in chunk):
                raise CorpusError(f"{prefix}.{src} and {prefix}.{tgt} have different numbers of lines")
            yield [a.rstrip("\n") for a, _ in chunk], [b.rstrip("\n") for _, b in chunk]


def clean_pairs(src: Sequence[str], tgt: Sequence[str], max_len: int, max_ratio: float):
    """Drop pairs with an empty side, a side longer than ``max_len`` tokens or a length ratio > ``max_ratio``."""
    keep_src, keep_tgt = [], []
    for a, b in zip(src, tgt):
        la, lb = len(a.split()), len(b.split())
        if 0 < la <= max_len and 0 < lb <= max_len and max(la, lb) <= max_ratio * min(la, lb):
            keep_src.append(a)
            keep_tgt.append(b)
    return keep_src, keep_tgt


def _normalize(lines: Sequence[str], lang: str, tokenize: bool) -> List[str]:
    """Moses punctuation normalisation, and Moses tokenisation for subword-nmt: every side of every split, and the
    source-only sets, go through this one function."""
    lines = text.moses_normalize(lines, lang)
    return text.moses_tokenize(lines, lang) if tokenize else lines


def _process_chunk(chunk, langs: Tuple[str, str], tokenize: bool, clean: Optional[Tuple[int, float]]):
    out = [_normalize(lines, lang, tokenize) for lines, lang in zip(chunk, langs)]
    return clean_pairs(*out, *clean) if clean else tuple(out)


_WORKER_BPE = {}  # model path -> JointBPE with its codec loaded, one per worker process


def _encode_chunk(chunk, bpe: text.JointBPE):
    # Each pool task receives a fresh pickled copy without a codec; keep the first one per worker so the
    # BPE model is read once per process, not once per chunk.
    bpe = _WORKER_BPE.setdefault(bpe.model_path, bpe)
    return tuple(bpe.encode(lines) for lines in chunk)


def _map_pairs(pool, func, chunks, out_prefix: str, langs: Tuple[str, str]) -> int:
    """Apply ``func`` to chunks of pairs (in ``pool`` when there is one); write ``out_prefix.{SRC,TGT}``."""
    results = pool.imap(func, chunks) if pool else map(func, chunks)
    n = 0
    src, tgt = langs
    with open(f"{out_prefix}.{src}", "w", encoding="utf-8") as f_src, \
            open(f"{out_prefix}.{tgt}", "w", encoding="utf-8") as f_tgt:
        for a, b in results:
            f_src.writelines(line + "\n" for line in a)
            f_tgt.writelines(line + "\n" for line in b)
            n += len(a)
    return n


def prepared_languages(dest: str) -> Tuple[str, str]:
    """(source, target) of a prepared DEST, read from fairseq-preprocess's file names (``valid.SRC-TGT.SRC.idx``)."""
    for name in sorted(os.listdir(os.path.join(dest, "bin"))) if os.path.isdir(os.path.join(dest, "bin")) else []:
        m = re.match(r"^valid\.([^.-]+)-([^.-]+)\.[^.]+\.idx$", name)
        if m:
            return m.group(1), m.group(2)
    raise SystemExit(f"{dest}/bin has no valid.SRC-TGT.*.idx: prepare it first")


def prepared_bpe(dest: str, asked: Optional[str]) -> text.JointBPE:
    """The BPE model DEST was prepared with (``--bpe``, when given, must be it)."""
    found = [m for m in text.BPE_METHODS if os.path.exists(text.JointBPE(m, os.path.join(dest, "bpe")).model_path)]
    if len(found) != 1:
        raise SystemExit(f"{dest}/bpe holds {'no BPE model' if not found else 'models of ' + ' and '.join(found)}: "
                         "prepare DEST again")
    if asked is not None and asked != found[0]:
        raise SystemExit(f"--bpe {asked}: {dest} was prepared with --bpe {found[0]}")
    return text.JointBPE(found[0], os.path.join(dest, "bpe"))


def prepare_sources_only(dest: str, named: List[str], bpe_method: Optional[str]) -> None:
    """``--sources-only NAME=FILE``: source text without references, normalised and encoded as the training
    sources were, binarized with DEST's dictionaries into ``DEST/sources/NAME/bin`` (subset ``test``)."""
    src, tgt = prepared_languages(dest)
    bpe = prepared_bpe(dest, bpe_method)
    for item in named:
        name, sep, path = item.partition("=")
        if not sep or not name or not os.path.isfile(path):
            raise SystemExit(f"--sources-only takes NAME=FILE with an existing FILE, got {item!r}")
        out = os.path.join(dest, "sources", name)
        shutil.rmtree(out, ignore_errors=True)  # fairseq-preprocess refuses to overwrite
        os.makedirs(out)
        lines = text.read_lines(path)
        text.write_lines(os.path.join(out, f"test.{src}"), bpe.encode(_normalize(lines, src, bpe.pretokenize)))
        run.run_logged(run.fairseq_cmd("preprocess") + [
            "--source-lang", src, "--target-lang", tgt, "--only-source", "--testpref", os.path.join(out, "test"),
            "--srcdict", os.path.join(dest, "bin", f"dict.{src}.txt"), "--destdir", os.path.join(out, "bin")],
            os.path.join(out, "preprocess.log"), echo=False)
        # fairseq's translation task loads both dictionaries from the data folder
        shutil.copyfile(os.path.join(dest, "bin", f"dict.{tgt}.txt"), os.path.join(out, "bin", f"dict.{tgt}.txt"))
        print(f"{name}: {len(lines)} source sentences in {out}/bin", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", required=True, help="output directory (orig/, ref/, tok/, bpe/, bin/)")
    p.add_argument("--download", action="store_true", help="fetch WMT14 en-fr into DEST/orig (needs internet)")
    p.add_argument("--tgt", default="fr", help="target language: the suffix of the local raw files (default fr)")
    p.add_argument("--train", help="prefix of local raw training text (PREFIX.en, PREFIX.TGT)")
    p.add_argument("--valid", help="prefix of local raw validation text")
    p.add_argument("--test", help="prefix of local raw test text")
    p.add_argument("--max-lines", type=int, default=0, help="use only the first N training pairs (0: all)")
    p.add_argument("--bpe", choices=text.BPE_METHODS,
                   help=f"default {text.BPE_METHODS[0]}; with --sources-only, DEST's (found there)")
    p.add_argument("--bpe-size", type=int, default=40000,
                   help="merges (subword-nmt) or vocabulary size (sentencepiece); default 40000")
    p.add_argument("--max-len", type=int, default=250, help="longest training sentence kept, in tokens")
    p.add_argument("--max-ratio", type=float, default=1.5, help="largest length ratio of a kept training pair")
    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    p.add_argument("--sources-only", nargs="+", metavar="NAME=FILE",
                   help="on a prepared DEST: source text without references, into DEST/sources/NAME/bin")
    args = p.parse_args(argv)
    local = [args.train, args.valid, args.test]
    if args.sources_only:
        if args.download or any(local):
            p.error("--sources-only works on a prepared --dest: give it alone")
        return args
    least = {"--max-lines": (args.max_lines, 0), "--bpe-size": (args.bpe_size, 1), "--max-len": (args.max_len, 1),
             "--max-ratio": (args.max_ratio, 1), "--workers": (args.workers, 1)}  # (checked before hours of work)
    problems = [f"{flag} must be >= {low}, got {value}" for flag, (value, low) in least.items() if not value >= low]
    if problems:
        p.error("; ".join(problems))
    args.bpe = args.bpe or text.BPE_METHODS[0]
    if args.download == any(local) or (not args.download and not all(local)):
        p.error("give either --download or all of --train, --valid and --test")
    if args.download and args.tgt != "fr":
        p.error(f"--download fetches WMT14 en-fr: --tgt {args.tgt} needs local files")
    if args.tgt == SRC:
        p.error(f"--tgt must differ from the source language {SRC!r}")
    return args


def check_local_inputs(args, langs: Tuple[str, str]) -> None:
    """Every local input there before anything is written: ``--train`` PREFIX.LANG (or .gz), ``--valid`` and
    ``--test`` PREFIX.LANG (or .sgm: their plain text is also copied as the references)."""
    for lang in langs:
        _corpus_path(f"{args.train}.{lang}")
        for flag, prefix in (("--valid", args.valid), ("--test", args.test)):
            if not any(os.path.exists(f"{prefix}.{lang}{ext}") for ext in ("", ".sgm")):
                raise CorpusError(f"{flag}: missing {prefix}.{lang} (or {prefix}.{lang}.sgm)")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.sources_only:
        return prepare_sources_only(args.dest, args.sources_only, args.bpe)
    try:
        prepare(args)
    except CorpusError as e:
        raise SystemExit(f"prepare.py: {e}") from None


def prepare(args) -> None:
    start = time.time()
    langs = (SRC, args.tgt)
    if not args.download:
        check_local_inputs(args, langs)
    built = ("ref", "tok", "bpe", "bin")
    staging = os.path.join(args.dest, ".preparing")
    shutil.rmtree(staging, ignore_errors=True)  # (a stopped run's)
    dirs = {"orig": os.path.join(args.dest, "orig"), **{name: os.path.join(staging, name) for name in built}}
    for name in ("ref", "tok", "bpe"):
        os.makedirs(dirs[name])
    if args.download:
        download(dirs["orig"])
        prefixes = dict(zip(("train", "valid", "test"), collect_wmt14(dirs["orig"], os.path.join(dirs["orig"], "raw"))))
    else:
        extracted = os.path.join(dirs["orig"], "raw")
        prefixes = {"train": args.train, "valid": local_split(args.valid, "valid", extracted, langs),
                    "test": local_split(args.test, "test", extracted, langs)}
    bpe = text.JointBPE(args.bpe, dirs["bpe"])
    pool = multiprocessing.Pool(args.workers) if args.workers > 1 else None
    try:
        for split, prefix in prefixes.items():
            clean = (args.max_len, args.max_ratio) if split == "train" else None
            func = functools.partial(_process_chunk, langs=langs, tokenize=bpe.pretokenize, clean=clean)
            n = _map_pairs(pool, func, read_pairs(prefix, langs, args.max_lines if split == "train" else 0),
                           os.path.join(dirs["tok"], split), langs)
            print(f"{split}: {n} sentence pairs", flush=True)
        for split in ("valid", "test"):
            for lang in langs:
                shutil.copyfile(f"{prefixes[split]}.{lang}", os.path.join(dirs["ref"], f"{split}.{lang}"))
        bpe.learn([os.path.join(dirs["tok"], f"train.{lang}") for lang in langs], args.bpe_size)
        print(f"BPE ({args.bpe}, size {args.bpe_size}): {bpe.model_path}", flush=True)
        for split in prefixes:
            _map_pairs(pool, functools.partial(_encode_chunk, bpe=bpe),
                       read_pairs(os.path.join(dirs["tok"], split), langs), os.path.join(dirs["bpe"], split), langs)
    finally:
        if pool:
            pool.close()
            pool.join()
    run.binarize(dirs["bpe"], dirs["bin"], *langs, os.path.join(args.dest, "preprocess.log"),
                 workers=args.workers)
    # Only now, and by renames (instant): a run stopped before leaves an earlier preparation whole, one stopped
    # between the two loops leaves none -- never parts of two. The blind sets of --sources-only go with the old
    # preparation: they were encoded with its BPE and dictionaries.
    old = os.path.join(staging, "old")
    os.makedirs(old)
    for name in (*built, "sources"):
        if os.path.lexists(os.path.join(args.dest, name)):
            os.replace(os.path.join(args.dest, name), os.path.join(old, name))
    for name in built:
        os.replace(dirs[name], os.path.join(args.dest, name))
    shutil.rmtree(staging)
    dirs = {name: os.path.join(args.dest, name) for name in built}
    print(f"done in {time.time() - start:.0f} s: fairseq data in {dirs['bin']}, references in {dirs['ref']}")


if __name__ == "__main__":
    sys.exit(main())
