"""The layering of the design card: ops know nothing of fairseq, and load their Triton kernels only when
they are used (torch itself may import the triton package; our kernels module must not load on CPU)."""
import subprocess
import sys


def test_ops_import_neither_fairseq_nor_our_triton_kernels_on_cpu():
    code = ("import sys, torch\nfrom softtopk_fairseq.ops import soft_topk\n"
            "soft_topk(torch.randn(2, 6), 2, sorted=True)\n"
            "print(sorted(m for m in ('fairseq', 'sacrebleu', 'softtopk_fairseq.ops.triton_kernels')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_modules_use_ops_but_not_fairseq():
    code = ("import sys, torch\n"
            "from softtopk_fairseq.modules import additive_attention, soft_beam_search, soft_reorder\n"
            "print('fairseq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
