"""The README's Python examples, for tests that run them as a user would paste them."""
import os
import re
from typing import List

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks() -> List[str]:
    """Every fenced ```python block of README.md, in order."""
    with open(README, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)
