"""The JSON-lines ledgers of the Multi30k studies (``multi30k_short/driver.py``, ``multi30k_converged/driver.py``;
a library, not a script): one row per finished run, appended the moment it finishes, so that a study stopped at
any point loses at most the run in flight; and the ``mean ± std`` their reports print."""
import json
import os
import statistics
from typing import Dict, List


def rows_by_key(path: str) -> Dict[str, dict]:
    """The ledger's rows by their ``key``; a key recorded again (e.g. later scored on test too) takes its last
    row. An absent ledger has none."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {r["key"]: r for r in map(json.loads, filter(str.strip, f))}


def append_row(path: str, row: dict) -> None:
    """Appends ``row`` (a finished run) to the ledger at ``path`` and echoes it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
    print(json.dumps(row), flush=True)


def mean_std(values: List[float]) -> str:
    """``mean ± sample std`` to two decimals (the value alone for one, ``-`` for none)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"
