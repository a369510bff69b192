"""Host-side tensor operations and host-device synchronisations of one soft_topk call (forward + backward),
or of one soft beam-search update (``--soft-beam``: the criterion's loss and its backward, by where in our code
each operation is issued).

    .venv/bin/python scripts/gpu/count_host_ops.py [--rows 6] [--n 40] [--k 3]
    .venv/bin/python scripts/gpu/count_host_ops.py --soft-beam [--backend triton] [--top 20] [--rho 0.8] [--tgt-len 8]
    .venv/bin/python scripts/gpu/count_host_ops.py --topk-attention [--backend triton]

On a GPU every tensor operation outside the fused kernels is at least one kernel launch, and every
``bool(tensor)`` / ``.item()`` a synchronisation: a soft beam-search update makes ~16 calls per batch, so these
counts -- not the kernels -- bound it there. They are counted here on CPU
tensors with a ``TorchDispatchMode``, for the Triton backend under ``TRITON_INTERPRET=1`` (set by this script);
operations issued inside the kernel launchers (their outputs' allocation, the interpreter's own work) are left
out -- add the launches themselves, 2 or 3 per call. On CUDA tensors the host code is the same.
"""
import argparse
import os
import sys
import traceback
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from training_step import (ATTENTION_VARIANTS, build_model_and_sample, soft_beam_criterion,  # noqa: E402
                           teacher_forcing_criterion)

from softtopk_fairseq.ops import soft_topk  # noqa: E402

# ``Tensor.tolist`` reads a CUDA tensor back through one copy (a synchronisation); on a CPU tensor it issues no
# operation the dispatch mode would see, so HostOps counts its calls itself.
SYNCS = ("aten._local_scalar_dense.default", "aten.is_nonzero.default", "Tensor.tolist", "copy to the host")
KERNEL_MODULES = ("triton_kernels.py", "cpu_kernels.py")


def is_view(func) -> bool:
    """Whether ``func`` only makes a new view of a tensor (no kernel on a GPU; left out of the operation counts,
    which the per-call table also prints with them): its schema says its output aliases its input, or it is
    ``_unsafe_view`` (a view its schema does not mark). Not a match of names against substrings ("select",
    "slice", "expand", ...), which would also leave out ``index_select``, ``select_backward``, ``slice_backward``,
    ``masked_select`` -- operations that launch kernels."""
    return getattr(func, "is_view", False) or func is torch.ops.aten._unsafe_view.default


class HostOps(TorchDispatchMode):
    """Counts tensor operations by kind (``ops``) and by the innermost function of ours that issued them
    (``sources``: "file.py:function", "autograd engine" for the backward of PyTorch's own operations), and
    the autograd engine's by kind (``engine_ops``, views left out); those issued inside a kernel launcher are
    skipped (the interpreter's)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.sources = Counter()
        self.engine_ops = Counter()
        self._tolist = None

    def __enter__(self):
        self._tolist = tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.ops["Tensor.tolist"] += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack() if "softtopk_fairseq" in f.filename]
        if not (frames and frames[-1].filename.endswith(KERNEL_MODULES)):
            # a copy to the host (``.to("cpu", copy=True)``: a synchronisation on a GPU, a copy on CPU tensors)
            to_host = func is torch.ops.aten._to_copy.default and str((kwargs or {}).get("device")) == "cpu"
            self.ops["copy to the host" if to_host else str(func)] += 1
            if not is_view(func):
                where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].name}" if frames else "autograd engine"
                self.sources[where] += 1
                if not frames:
                    self.engine_ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count(backend, scaling, sorted, rows, n, k):
    """One soft_topk call, forward + backward, after a warm-up call: its host operations with views left out,
    with them, and its synchronisations."""
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
    return sum(mode.sources.values()), sum(mode.ops.values()), syncs


def count_update(backend, update):
    """The ``HostOps`` of one call of ``update()`` (after one warm-up call) under ``use_backend(backend)``, and
    its synchronisations."""
    from softtopk_fairseq.ops import use_backend

    with use_backend(backend):
        update()  # compiles / warms up
        with HostOps() as mode:
            update()
    return mode, sum(mode.ops[name] for name in SYNCS)


def count_soft_beam(backend, top, rho, teacher_forcing_pass, src_len=6, tgt_len=8):
    """One soft beam-search update of the demo LSTM (beam 5, eps 0.1 paper scaling, M 50; ``rho``, 0.8 by
    default; ``--teacher-forcing-pass``, ``search`` by default: what ``auto`` runs on a GPU) on a small batch (8
    sentences, source length 6, target length 8 by default: 7 soft_topk calls; the training-step benchmarks'
    lengths are 14 / 16): the criterion's loss and its backward -- and, for scale, one teacher-forcing update
    (label_smoothed_cross_entropy) of the same batch."""
    cfg = dict(arch="lstm", bsz=8, src_len=src_len, tgt_len=tgt_len, vocab=200, threads=1, device="cpu")
    model, task, sample, _ = build_model_and_sample(cfg)
    criterion = soft_beam_criterion(task, teacher_forcing_ratio=rho, soft_beam_size=5, soft_beam_candidates=50,
                                    soft_beam_scaling="paper", teacher_forcing_pass=teacher_forcing_pass)
    mode, syncs = count_update(backend, lambda: criterion(model, sample)[0].backward())
    teacher_forcing = teacher_forcing_criterion(task)
    tf_mode, tf_syncs = count_update(backend, lambda: teacher_forcing(model, sample)[0].backward())
    ops, tf_ops = sum(mode.sources.values()), sum(tf_mode.sources.values())
    print(f"one soft beam-search update (LSTM, 8 sentences, lengths {src_len} / {tgt_len}, rho {rho:g}, beam 5, "
          f"M 50, paper scaling, teacher forcing {teacher_forcing_pass}), backend {backend}: {ops} tensor operations "
          f"(views left out), {syncs} synchronisations; "
          f"teacher forcing on the same batch: {tf_ops} operations, {tf_syncs} synchronisations "
          f"({ops / tf_ops:.2f}x the operations)\n\n| issued in | operations |\n|---|---|")
    for where, n in mode.sources.most_common(top):
        print(f"| {where} | {n} |")
    print("\n| autograd engine: operator | operations |\n|---|---|")
    for op, n in mode.engine_ops.most_common(top):
        print(f"| {op} | {n} |")


def count_topk_attention(backend):
    """One training step (label-smoothed loss and its backward) of the demo transformer and of
    ``transformer_topk_attn`` with SOFT top-k (k 4, the unsorted operator) in all three attentions (2+2 layers:
    6 soft_topk calls), on a small batch (8 sentences, lengths 6 / 8)."""
    cfg = dict(arch="transformer", bsz=8, src_len=6, tgt_len=8, vocab=200, threads=1, device="cpu")
    print(f"one training step (8 sentences, lengths 6 / 8, k 4), backend {backend}\n\n"
          "| model | tensor operations (views left out) | synchronisations |\n|---|---|---|")
    for name in ("transformer (softmax)", "transformer_topk_attn soft_topk, all three"):
        variant = ATTENTION_VARIANTS[name]
        extra = dict(variant, topk_attn_k=4, topk_attn_epsilon=0.1) if "topk" in name else variant
        model, task, sample, _ = build_model_and_sample(cfg, extra)
        criterion = teacher_forcing_criterion(task)
        mode, syncs = count_update(backend, lambda: criterion(model, sample)[0].backward())
        print(f"| {name} | {sum(mode.sources.values())} | {syncs} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--soft-beam", action="store_true", help="count one soft beam-search update instead")
    parser.add_argument("--topk-attention", action="store_true",
                        help="count one training step of transformer_topk_attn (and of the transformer) instead")
    parser.add_argument("--backend", default="triton", choices=["torch", "triton", "cpu"],
                        help="--soft-beam, --topk-attention: the soft_topk backend")
    parser.add_argument("--top", type=int, default=20, help="--soft-beam: rows of the table")
    parser.add_argument("--rho", type=float, default=0.8, help="--soft-beam: the teacher-forcing ratio")
    parser.add_argument("--teacher-forcing-pass", default="search", choices=["search", "separate"],
                        help="--soft-beam: the criterion's --teacher-forcing-pass (auto runs search on a GPU)")
    parser.add_argument("--src-len", type=int, default=6, help="--soft-beam: the source length")
    parser.add_argument("--tgt-len", type=int, default=8, help="--soft-beam: the target length (T - 1 decoding steps "
                        "with a soft top-k)")
    args = parser.parse_args()
    if args.soft_beam:
        count_soft_beam(args.backend, args.top, args.rho, args.teacher_forcing_pass, args.src_len, args.tgt_len)
        return
    if args.topk_attention:
        count_topk_attention(args.backend)
        return
    print(f"one soft_topk call, forward + backward, {args.rows}x{args.n}, k={args.k}")
    # Both columns here -- views left out, and counted -- so that either figure can be compared.
    print("| backend | scaling | operator | host tensor ops (views left out) | with views | synchronisations |\n"
          "|---|---|---|---|---|---|")
    try:
        import triton  # noqa: F401
        names = ("torch", "triton", "cpu")
    except ImportError:
        names = ("torch", "cpu")
    for backend in names:
        for scaling in ("none", "paper"):
            for sorted in (False, True):
                ops, with_views, syncs = count(backend, scaling, sorted, args.rows, args.n, args.k)
                print(f"| {backend} | {scaling} | {'sorted' if sorted else 'unsorted'} | {ops} | {with_views} | "
                      f"{syncs} |", flush=True)


if __name__ == "__main__":
    main()
