"""The layering of the design card: ops know nothing of fairseq (nor need triton to import)."""
import subprocess
import sys


def test_ops_import_neither_fairseq_nor_triton():
    code = ("import sys, torch\nfrom softtopk_fairseq.ops import soft_topk\n"
            "soft_topk(torch.randn(2, 6), 2, sorted=True)\n"
            "print(sorted(m for m in ('fairseq', 'triton', 'sacrebleu') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
