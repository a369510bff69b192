"""Host-side tensor operations and host-device synchronisations of one soft_topk call (forward + backward).

    .venv/bin/python benchmarks/count_host_ops.py [--rows 6] [--n 40] [--k 3]

On a GPU every tensor operation outside the fused kernels is at least one kernel launch, and every
``bool(tensor)`` / ``.item()`` a synchronisation: a soft beam-search update makes ~16 calls per batch, so these
counts -- not the kernels -- bound it there (docs/results.md, "On a GPU"). They are counted here on CPU
tensors with a ``TorchDispatchMode``, for the Triton backend under ``TRITON_INTERPRET=1`` (set by this script);
operations issued inside the kernel launchers (their outputs' allocation, the interpreter's own work) are left
out -- add the launches themselves, 2 or 3 per call. On CUDA tensors the host code is the same.
"""
import argparse
import os
import traceback
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from softtopk_fairseq.ops import soft_topk  # noqa: E402

SYNCS = ("aten._local_scalar_dense.default", "aten.is_nonzero.default")
KERNEL_MODULES = ("triton_kernels.py", "cpu_kernels.py")


class HostOps(TorchDispatchMode):
    """Counts tensor operations by kind; those issued inside a kernel launcher are skipped (the interpreter's)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack() if "softtopk_fairseq" in f.filename]
        if not (frames and frames[-1].filename.endswith(KERNEL_MODULES)):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count(backend, scaling, sorted, rows, n, k):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=gen).requires_grad_()
    w = torch.randn(rows, n, generator=gen)

    def call():
        out = soft_topk(x, k, scaling=scaling, sorted=sorted, backend=backend)
        (out.sum(-1) * w if sorted else out * w).sum().backward()

    call()  # compiles / warms up
    with HostOps() as mode:
        call()
    syncs = sum(mode.ops[name] for name in SYNCS)
    return sum(mode.ops.values()), syncs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()
    print(f"one soft_topk call, forward + backward, {args.rows}x{args.n}, k={args.k}")
    print("| backend | scaling | operator | host tensor ops | synchronisations |\n|---|---|---|---|---|")
    try:
        import triton  # noqa: F401
        names = ("torch", "triton", "cpu")
    except ImportError:
        names = ("torch", "cpu")
    for backend in names:
        for scaling in ("none", "paper"):
            for sorted in (False, True):
                ops, syncs = count(backend, scaling, sorted, args.rows, args.n, args.k)
                print(f"| {backend} | {scaling} | {'sorted' if sorted else 'unsorted'} | {ops} | {syncs} |", flush=True)


if __name__ == "__main__":
    main()
