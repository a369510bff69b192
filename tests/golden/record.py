"""Record the golden outputs of ``cases.py`` into ``golden.pt`` (run from the repository root, before a change
whose behaviour must stay the same):

    TRITON_INTERPRET=1 PYTHONPATH=tests .venv/bin/python tests/golden/record.py [OUT.pt]

The file is committed with ``recorded_on.json`` beside it (the machine and versions it was recorded with);
``tests/test_golden.py`` recomputes every case with the code as it is and compares: bit for bit in that
environment, within each case's measured tolerance in any other.
"""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for tiny_models

from golden.cases import CASES, computed  # noqa: E402
from test_golden import RECORDED_ON, environment  # noqa: E402

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("record.py: set TRITON_INTERPRET=1 (the Triton kernels run on CPU tensors)")
    found = {}
    for name, case in CASES.items():
        results = computed(case)
        print(f"{name}: {len(results)} tensors", flush=True)
        found.update(results)
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "golden.pt")
    torch.save({name: value.detach().clone() for name, value in found.items()}, out)
    with open(os.path.join(os.path.dirname(out), RECORDED_ON), "w", encoding="utf-8") as f:
        json.dump(environment(), f, indent=1, sort_keys=True)
        f.write("\n")
