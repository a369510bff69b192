"""The Python examples of the README and the docs, for tests that run them as a user would paste them."""
import os
import re
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(page: str = "README.md") -> List[str]:
    """Every fenced ```python block of ``page`` (a path from the repository's root), in order."""
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)
