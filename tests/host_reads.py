"""A dispatch mode that counts the operations reading a tensor's value back to the host: each one a
synchronisation on a GPU (on CPU tensors the same operations are issued, so they can be counted here)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """``count``: the reads; ``from_host``: the tensors made from host data (``torch.tensor``: a copy to the device,
    which a CUDA graph cannot hold either); ``operations``: every operation that is not a view (each a kernel on a
    GPU)."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)

    def __init__(self):
        super().__init__()
        self.count = self.from_host = self.operations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a read: a value read back, or a copy to the host (``.to("cpu", copy=True)``, issued on CPU tensors too)
        self.count += func in self.READS or (func is torch.ops.aten._to_copy.default
                                             and str((kwargs or {}).get("device")) == "cpu")
        self.from_host += func is torch.ops.aten.lift_fresh.default
        self.operations += not getattr(func, "is_view", False)
        return func(*args, **(kwargs or {}))
