"""The documentation as a product: every relative link and anchor resolves, every code block marked
``<!-- runnable -->`` runs (the blocks of one page in order, in one namespace), the documented flags of the
criterion and of the top-k attention architectures are exactly the registered ones with their defaults, every figure
that a summary (the README's findings, the results index) quotes is on the results page it summarises, the README
stays short, and no page speaks of the work's history."""
import os
import re
import unicodedata
from decimal import ROUND_HALF_UP, Decimal

import pytest
from readme_examples import fairseq_commands

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(REPO, name) for name in ("README.md", "CHANGELOG.md")]
               + [os.path.join(root, name) for top in ("docs", "examples") for root, _, names in
                  os.walk(os.path.join(REPO, top)) for name in names if name.endswith(".md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```", re.S | re.M)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\w*_)", "", heading.strip().lower())
    text = "".join(ch for ch in unicodedata.normalize("NFKD", text) if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def _anchors(path):
    text = re.sub(r"^```.*?^```", "", _read(path), flags=re.S | re.M)  # headings outside code blocks
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def _rel(path):
    return os.path.relpath(path, REPO)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_and_anchor_resolves(page):
    text = re.sub(r"^```.*?^```", "", _read(page), flags=re.S | re.M)
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(resolved), f"{_rel(page)}: link to {target}: no such file"
        if anchor:
            assert resolved.endswith(".md") and anchor in _anchors(resolved), \
                f"{_rel(page)}: link to {target}: no heading with that anchor"


@pytest.mark.parametrize("page", [p for p in PAGES if RUNNABLE.search(_read(p))], ids=_rel)
def test_runnable_blocks_run(page):
    namespace = {"__name__": "__docs__"}
    for block in RUNNABLE.findall(_read(page)):
        exec(compile(block, _rel(page), "exec"), namespace)


def _documented_flags(page):
    """``{flag: default cell}`` of a page's flags table (rows starting with a backticked --flag)."""
    return {m.group(1): m.group(2).strip() for m in
            re.finditer(r"^\| `(--[a-z0-9-]+)` \| ([^|]*) \|", _read(os.path.join(REPO, "docs", page)), flags=re.M)}


def _shown(default) -> str:
    if default is False:
        return "off"
    return str(default)


def _check_table(page, fields):
    documented = _documented_flags(page)
    registered = {"--" + f.name.replace("_", "-"): f.default for f in fields}
    assert set(documented) == set(registered), (sorted(set(documented) - set(registered)),
                                                sorted(set(registered) - set(documented)))
    for flag, default in registered.items():
        cell = documented[flag].replace("`", "")
        if default is None:
            assert "'s" in cell, (flag, cell)  # "soft_topk's": someone else's default
        else:
            assert cell == _shown(default), (flag, cell, default)


def test_the_criterions_documented_flags_are_its_registered_ones():
    from dataclasses import fields

    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterionConfig

    from softtopk_fairseq.criterions.soft_beam_search import FLAG_ALIASES, SoftBeamSearchConfig

    inherited = {f.name for f in fields(LabelSmoothedCrossEntropyCriterionConfig)}
    own = [f for f in fields(SoftBeamSearchConfig) if f.name not in inherited and f.name not in FLAG_ALIASES]
    _check_table("soft_beam_search.md", own)
    page = _read(os.path.join(REPO, "docs", "soft_beam_search.md"))
    for alias in FLAG_ALIASES:  # the old names are documented as such, outside the table
        assert "--" + alias.replace("_", "-") in page, alias


def test_the_attention_archs_documented_flags_are_their_registered_ones():
    from dataclasses import fields

    from softtopk_fairseq.models.topk_attention import TransformerTopkAttentionConfig

    _check_table("topk_attention.md", [f for f in fields(TransformerTopkAttentionConfig) if not f.name.startswith("_")])


NUMBER = r"\d[\d,]*(?:\.\d+)?"
# 0.73, -0.42, 5,116, 2.3-2.5x: a signed figure or a range, a ratio's x and a sentence's full stop not part of it
FIGURE = re.compile(rf"(?<![\w.])(-?)\+?({NUMBER})(?:-({NUMBER}))?(?=x?(?:[^\w.]|\.(?!\d)|$))")
RESULTS_PAGE = re.compile(r"\]\(((?:docs/results/|examples/)?[\w/]+\.md)[#)]")


def _figures(text: str) -> set:
    """Each figure of ``text`` as (sign, first number, the range's second number or "")."""
    return set(FIGURE.findall(text))


def _rounds_to(precise: str, quoted: str) -> bool:
    """``precise`` (a page's number) shown at ``quoted``'s decimals is ``quoted`` (0.405 quoted as 0.41)."""
    if not precise or not quoted:
        return precise == quoted
    places = Decimal(quoted.replace(",", "")).as_tuple().exponent
    if len(precise.partition(".")[2]) < -places:
        return False
    return Decimal(precise.replace(",", "")).quantize(Decimal(1).scaleb(places), ROUND_HALF_UP) == \
        Decimal(quoted.replace(",", ""))


def _unquoted(quoted_in: str, pages) -> list:
    """The figures of ``quoted_in`` found on none of ``pages``, as written there or rounded from a more precise one
    (with the same sign)."""
    on_pages = _figures("".join(_read(os.path.join(REPO, page)) for page in pages))
    return [f"{sign}{first}" + (f"-{second}" if second else "") for sign, first, second in sorted(_figures(quoted_in))
            if (sign, first, second) not in on_pages and not any(
                sign == page_sign and _rounds_to(page_first, first) and _rounds_to(page_second, second)
                for page_sign, page_first, page_second in on_pages)]


def _summary_rows(page: str, default_pages=()):
    """``(answer cell, the results pages it summarises)`` for each row of a page's question-and-answer tables: the
    pages the row links, or else ``default_pages``."""
    for line in _read(os.path.join(REPO, page)).splitlines():
        cells = line.split("|")
        question = cells[1].strip() if len(cells) >= 4 and line.startswith("| ") else "-"
        if set(question) <= {"-"} or question == "question":
            continue  # not a row, the rule or the header
        linked = [os.path.normpath(os.path.join(os.path.dirname(page), link)) for link in RESULTS_PAGE.findall(line)]
        answer = re.sub(r"\[[^\]]*\]\([^)]*\)", "", "|".join(cells[2:]))  # the answer without its links' text
        yield answer, linked or list(default_pages)


@pytest.mark.parametrize("summary, default_pages", [("README.md", ["docs/results/multi30k_converged.md"]),
                                                    ("docs/results/README.md", [])])
def test_every_figure_a_summary_quotes_is_on_the_page_it_summarises(summary, default_pages):
    """A figure re-measured on its results page and left stale in a summary is caught here (the README's findings
    rows without a link of their own summarise the converged study, linked above the table)."""
    rows = list(_summary_rows(summary, default_pages))
    assert len(rows) >= 5, f"{summary}: its summary table was not found"
    stale = [(pages, figure) for answer, pages in rows for figure in _unquoted(answer, pages)]
    assert all(pages for _, pages in rows), f"{summary}: a row summarises no page"
    assert not stale, f"{summary}: figures on none of the pages they summarise: {stale}"


def test_the_readme_is_at_most_8_kb():
    assert os.path.getsize(os.path.join(REPO, "README.md")) <= 8 * 1024


HISTORY = re.compile(r"\bsessions?\b|\bissue #?\d+|\b\d+(st|nd|rd|th) session\b|\bre-timed\b|\blent since\b|"
                     r"\b(GPU|device) lease\b|\bno longer existed\b", re.I)


def test_no_page_speaks_of_the_works_history():
    """The product speaks of the product: no work sessions or issue numbers in docs, code, scripts or tests (the
    CHANGELOG names versions, not sessions; pytest's scope="session" is not history)."""
    found = []
    for top in ("README.md", "docs", "softtopk_fairseq", "benchmarks", "experiments", "scripts", "examples", "tests",
                "user_dir"):
        base = os.path.join(REPO, top)
        files = [base] if os.path.isfile(base) else [os.path.join(r, n) for r, _, ns in os.walk(base) for n in ns]
        for path in files:
            if not path.endswith((".md", ".py", ".sh", ".c")) or path == os.path.abspath(__file__):
                continue
            for number, line in enumerate(_read(path).splitlines(), 1):
                if HISTORY.search(line.replace('scope="session"', "")):
                    found.append(f"{_rel(path)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found[:20])


def test_the_docs_fairseq_commands_parse_and_fine_tune_into_a_save_dir_of_their_own():
    """Each documented fairseq command is one fairseq's parser takes, with the plugin's flags and choices; and a
    fine-tuning names its own ``--save-dir``: fairseq 0.12 ignores ``--finetune-from-model`` when the save dir
    (default ``checkpoints/``, where the pre-training saved) holds a ``checkpoint_last.pt``, and would continue the
    pre-training instead, already past the fine-tuning's ``--max-epoch``."""
    from fairseq import options

    parsers = {"train": options.get_training_parser, "generate": options.get_generation_parser,
               "interactive": lambda: options.get_interactive_generation_parser()}
    commands = fairseq_commands()
    assert {program for _, program, _ in commands} >= {"train", "generate"}, commands
    for page, program, arguments in commands:
        if program == "train" and "--arch" not in arguments:  # an excerpt ("..."): its flags, on fairseq's default
            arguments = arguments + ["--arch", "transformer"]
        try:
            options.parse_args_and_arch(parsers[program](), arguments)
        except SystemExit:
            pytest.fail(f"{page}: fairseq-{program} {' '.join(arguments)}: fairseq's parser refuses it")
        if "--finetune-from-model" in arguments:
            start = os.path.normpath(os.path.dirname(arguments[arguments.index("--finetune-from-model") + 1]) or ".")
            save = arguments[arguments.index("--save-dir") + 1] if "--save-dir" in arguments else "checkpoints"
            assert os.path.normpath(save) not in (start, "checkpoints"), \
                f"{page}: a fine-tuning without a --save-dir of its own: {arguments}"
