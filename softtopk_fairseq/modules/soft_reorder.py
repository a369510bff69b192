r"""Soft versions of the two hard operations a beam search applies to a decoder, without touching decoder code.

* **State**: fairseq decoders reorder their cached state with a hard index, ``x.index_select(dim, new_order)``
  inside their own ``reorder_incremental_state``. :class:`SoftOrder` is that index (a ``LongTensor``: the
  hard argmax order) carrying a soft mixing matrix; ``index_select`` on a floating-point tensor with it as
  the index returns the mixture instead (the paper's eq. (10)),

  .. math:: \tilde h^{\ell}_b = \textstyle\sum_i W_{b\ell i}\, h^{i}_b ,

  along whichever dimension the decoder itself selects. Integer and bool state (e.g. padding masks) and
  every other use of the index get the hard order. So LSTM hidden/cell/input-feed state, transformer cached
  keys/values and any other decoder written the fairseq way are mixed by their own reorder code.
* **Input**: :class:`SoftTokenInput` is a forward hook on the decoder's ``embed_tokens``: the decoder is
  fed the hard argmax prefix (so positions and padding work as usual), and the hook replaces the embedding
  of the newest token by the soft one (eq. (9)). Everything after the embedding lookup -- scaling,
  positions, dropout -- is the decoder's own code.
"""
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map


def _plain(x):
    return x.as_subclass(Tensor) if isinstance(x, SoftOrder) else x


def mix_beams(source: Tensor, dim: int, mixing: Tensor) -> Tensor:
    """``out[b*k + l] = sum_i mixing[b, l, i] * source[b*k + i]`` along ``dim`` (``source.size(dim) = bsz*k``)."""
    bsz, k_new, k_old = mixing.shape
    x = source.movedim(dim, 0)
    rest = x.shape[1:]
    mixed = torch.bmm(mixing.to(x.dtype), x.reshape(bsz, k_old, -1))
    return mixed.reshape(bsz * k_new, *rest).movedim(0, dim)


class SoftOrder(Tensor):
    """A beam order for ``reorder_incremental_state``: the hard order ``b*k + parent[b, l]`` (what any use
    of it as a ``LongTensor`` sees), plus ``mixing`` (``bsz x k x k``, rows summing to 1) that
    ``index_select`` applies to floating-point tensors instead of the hard selection."""

    mixing: Tensor

    @staticmethod
    def __new__(cls, hard_order: Tensor, mixing: Tensor):
        if hard_order.dtype != torch.long or hard_order.dim() != 1:
            raise TypeError("SoftOrder: hard_order must be a 1-D LongTensor")
        if mixing.dim() != 3 or mixing.shape[0] * mixing.shape[1] != hard_order.numel():
            raise ValueError(f"SoftOrder: mixing of shape {tuple(mixing.shape)} does not match an order of "
                             f"{hard_order.numel()} beams")
        obj = Tensor._make_subclass(cls, hard_order)
        obj.mixing = mixing
        return obj

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.index_select, Tensor.index_select):
            named = dict(zip(("input", "dim", "index"), args), **kwargs)
            source, dim, index = named.get("input"), named.get("dim"), named.get("index")
            if (isinstance(index, SoftOrder) and source.is_floating_point()
                    and source.size(dim) == index.mixing.shape[0] * index.mixing.shape[2]):
                return mix_beams(source, dim, index.mixing)
        if func is Tensor.__getitem__ and isinstance(args[1], SoftOrder) and args[0].is_floating_point():
            return mix_beams(args[0], 0, args[1].mixing)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))


class SoftTokenInput:
    """Context manager installing a forward hook on ``embedding`` (a decoder's ``embed_tokens``).

    While installed, setting :attr:`pending` to a ``(groups, s, dim)`` tensor makes the next lookup of an
    ``(N, 1)`` token tensor (``N = groups * g``, ``g >= s``) return it in the first ``s`` rows of every group of
    ``g`` rows, and the looked-up embeddings in the others (``s = g``: all of them, e.g. ``pending`` of shape
    ``(N, 1, dim)``); other lookups are untouched. The soft beam search's groups are its sentences, whose every
    row it feeds (``s = g``): its beams soft tokens, a teacher-forced row its gold token embedded ahead (so that
    the lookup's output, and its backward, go unused).
    """

    def __init__(self, embedding: nn.Module):
        self.embedding = embedding
        self.pending: Optional[Tensor] = None
        self._handle = None

    def _hook(self, module, inputs, output):
        if self.pending is None:
            return None
        soft, self.pending = self.pending, None
        groups, s, dim = soft.shape
        n = output.shape[0]
        if output.shape != (n, 1, dim) or n % groups or n // groups < s:
            raise RuntimeError(f"soft token input of shape {tuple(soft.shape)} does not match the decoder's "
                               f"embedding output {tuple(output.shape)}; the decoder must embed only the "
                               "newest token in incremental mode")
        soft = soft.to(output.dtype)
        if n // groups == s:
            return soft.reshape(output.shape)
        looked_up = output.view(groups, n // groups, dim)[:, s:]
        return torch.cat([soft, looked_up], 1).view(output.shape)

    def __enter__(self):
        self._handle = self.embedding.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        self.pending = None
        return False
