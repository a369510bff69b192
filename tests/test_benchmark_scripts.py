"""The training-step benchmark scripts run end to end (tiny sizes; their figures come from real runs)."""
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("script,args,rows", [
    ("bench_soft_beam.py", ["--archs", "lstm", "--candidates", "20", "--beam", "2"], 4),
    ("bench_topk_attention.py", [], 5),
])
def test_benchmark_script_prints_its_table(script, args, rows):
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), *args, "--bsz", "4", "--src-len", "5",
                          "--tgt-len", "4", "--vocab", "60", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == rows + 1, out.stdout  # header + one row per configuration
