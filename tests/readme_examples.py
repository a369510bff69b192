"""The examples of the README and the docs -- Python blocks, fairseq commands -- for tests that run or parse them as a
user would paste them."""
import os
import re
import shlex
from typing import List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(["README.md", *(os.path.relpath(os.path.join(root, name), REPO) for top in ("docs", "examples")
                               for root, _, names in os.walk(os.path.join(REPO, top)) for name in names
                               if name.endswith(".md"))])


def python_blocks(page: str = "README.md") -> List[str]:
    """Every fenced ```python block of ``page`` (a path from the repository's root), in order."""
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.S | re.M)
FAIRSEQ_COMMAND = re.compile(r"\bfairseq-(train|generate|interactive)\s+([^\n|<>;&]*)")  # up to a pipe or redirect


def fairseq_commands(pages: List[str] = None) -> List[Tuple[str, str, List[str]]]:
    """``(page, program, arguments)`` of every ``fairseq-train``/``-generate``/``-interactive`` command in a shell
    block of ``pages`` (paths from the repository's root; default: the README and every page under docs/ and
    examples/), lines continued with a backslash joined, comments dropped; the plugin's user dir for any way of
    writing it, another shell variable as a placeholder (its name in lower case); ``...``, "and the rest", dropped."""
    user_dir = os.path.join(REPO, "user_dir")
    found = []
    for page in pages or PAGES:
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = f.read()
        for block in SHELL_BLOCK.findall(text):
            block = re.sub(r"--user-dir\s+(\"\$\(python -c '[^']*'\)\"|\$USER_DIR)", f"--user-dir {user_dir}",
                           re.sub(r"(^|\s)#.*", "", block).replace("\\\n", " "))  # comments dropped
            for program, arguments in FAIRSEQ_COMMAND.findall(block):
                arguments = re.sub(r"\$\{?(\w+)\}?", lambda m: m.group(1).lower(), arguments)
                found.append((page, program, [a for a in shlex.split(arguments) if a != "..."]))
    return found
