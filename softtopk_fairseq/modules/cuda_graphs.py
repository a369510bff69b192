r"""A small function run forward and backward as two CUDA graphs, one pair per input shape: for work a GPU
finishes in microseconds that the host needs dozens of kernel launches to issue -- the soft beam search's step
between two decoder calls, dozens of launches per step -- so that each call costs a few copies and one launch
each way.

For ``out = fn(*inputs)`` (``out`` a pytree -- tuples, NamedTuples, None -- of tensors):

* **forward**: the inputs are copied into the graph's own buffers (an ``nn.Parameter`` is read where it is:
  its storage must stay put, as optimizers update it in place; ``fn`` must reach it through its argument, not
  through a module), the forward graph -- ``fn`` without autograd -- is replayed, and its outputs are cloned out
  (the next replay overwrites them);
* **backward**: the same inputs (autograd keeps them, nothing else) are copied in again with the outputs'
  gradients, and the backward graph is replayed: ``fn`` once more *with* autograd and its backward,
  :math:`(\partial out / \partial x)^\top g` for every floating-point input ``x``. Recomputing the forward is
  what lets one pair of graphs serve every call of a shape however many are alive (a graph's buffers hold one
  call), at the price of running ``fn`` twice on the device -- where the time is not.

So ``fn`` must be capturable and deterministic: no host reads (no ``.item()``, ``bool(tensor)``, data-dependent
shapes, nor operations that make them inside, like ``nn.Embedding``'s CUDA backward past ~3,000 indices), no
random numbers, no tensor made from host data, the same result for the same inputs -- and its Python-level
choices (configuration, which branch) fixed by the cache key the caller gives. A capture costs a synchronisation,
two untimed runs and two captures; a failed one raises (it is not retried eagerly: it can leave the CUDA random
generator in capture mode). The graphs of a key and input shapes are kept (least recently used first out past
``capacity``), each holding its buffers and ``fn``'s workspace on the device. Without CUDA -- or with
``emulate=True`` -- the same copies, runs and clones happen eagerly (what the CPU tests check the autograd
plumbing with).
"""
from collections import OrderedDict
from typing import Any, Callable, Hashable, List, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

from softtopk_fairseq import defaults

WARMUP_RUNS = 2  # untimed runs of each direction before capturing (lazy inits, kernel compiles)
_CAPTURE_STREAMS = {}  # device index -> the stream every capture on it warms up and captures on


class _GraphPair:
    """The forward and backward graphs of one ``fn`` at one set of input shapes (see the module's docstring)."""

    def __init__(self, fn: Callable, inputs: Sequence[Tensor], graphed: bool):
        self.fn = fn
        self.in_place = [isinstance(x, nn.Parameter) for x in inputs]
        self.static_in = [x if p else x.detach().clone() for x, p in zip(inputs, self.in_place)]
        self.grad_wrt = [i for i, (x, p) in enumerate(zip(inputs, self.in_place))
                         if x.is_floating_point() and (x.requires_grad or not p)]  # (a frozen parameter: none)
        with torch.enable_grad():  # the outputs' structure, and which of them carry gradients
            leaves, self.spec = tree_flatten(fn(*self._leaves()))
        self.tensors = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        self.template = [None if isinstance(x, Tensor) else x for x in leaves]
        outs = [leaves[i] for i in self.tensors]
        self.differentiable = [j for j, o in enumerate(outs) if o.requires_grad]
        if not self.differentiable:
            self.grad_wrt = []
        self.grad_out = [torch.zeros_like(outs[j]) for j in self.differentiable]
        self.graphed = graphed
        if graphed:
            try:
                self._capture()
            except RuntimeError as error:  # (torch.AcceleratorError is one)
                raise RuntimeError(f"GraphCache: capturing {getattr(fn, '__qualname__', fn)} as a CUDA graph failed "
                                   f"({error}); it must not read back to the host or synchronise (module "
                                   "docstring) -- run it without the graphs") from error

    def _leaves(self) -> List[Tensor]:
        """The static inputs as new autograd leaves (the floating-point ones requiring grad; a parameter's alias its
        storage): a parameter's own leaf belongs to the stream it was first used on, which the backward's capture
        would have to make wait on the capturing stream (CUDA refuses: cudaErrorStreamCaptureImplicit)."""
        return [x.detach().requires_grad_(i in self.grad_wrt) for i, x in enumerate(self.static_in)]

    def _run_forward(self) -> List[Tensor]:
        with torch.no_grad():
            leaves = tree_flatten(self.fn(*self.static_in))[0]
        return [leaves[i] for i in self.tensors]

    def _run_backward(self) -> List[Tensor]:
        inputs = self._leaves()
        if not self.grad_wrt:
            return []
        with torch.enable_grad():
            leaves = tree_flatten(self.fn(*inputs))[0]
            outs = [leaves[self.tensors[j]] for j in self.differentiable]
            return list(torch.autograd.grad(outs, [inputs[i] for i in self.grad_wrt], self.grad_out,
                                            allow_unused=True, materialize_grads=True))

    def _capture(self):
        # Warm-up and capture on one stream, the same for every capture on the device: what a thread makes lazily
        # per stream (cuBLAS workspaces, the autograd engine's thread's too) is then made before capturing.
        device = torch.cuda.current_device()
        if device not in _CAPTURE_STREAMS:
            _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
        stream = _CAPTURE_STREAMS[device]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self._run_forward()
                self._run_backward()
        torch.cuda.current_stream().wait_stream(stream)
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, stream=stream):
            self.static_out = self._run_forward()
        with torch.cuda.graph(self.backward_graph, stream=stream):
            self.static_grad_in = self._run_backward()

    def _copy_in(self, inputs: Sequence[Tensor]):
        for static, x, in_place in zip(self.static_in, inputs, self.in_place):
            if not in_place:
                static.copy_(x)

    def forward(self, inputs: Sequence[Tensor]) -> List[Tensor]:
        self._copy_in(inputs)
        if self.graphed:
            self.forward_graph.replay()
            return [o.clone() for o in self.static_out]
        return [o.clone() for o in self._run_forward()]

    def backward(self, inputs: Sequence[Tensor], grads: Sequence[Tensor]) -> List[Tensor]:
        self._copy_in(inputs)
        for static, g in zip(self.grad_out, grads):
            static.copy_(g)
        if self.graphed:
            self.backward_graph.replay()
            return [g.clone() for g in self.static_grad_in]
        return self._run_backward()

    def unflatten(self, outs: Sequence[Tensor]) -> Any:
        leaves = list(self.template)
        for i, o in zip(self.tensors, outs):
            leaves[i] = o
        return tree_unflatten(leaves, self.spec)


class _Replay(torch.autograd.Function):
    """One call through a :class:`_GraphPair`: its forward graph, and its backward graph as the backward."""

    @staticmethod
    def forward(ctx, pair: _GraphPair, *inputs: Tensor):
        ctx.pair = pair
        ctx.save_for_backward(*inputs)
        outs = pair.forward(inputs)
        ctx.mark_non_differentiable(*(o for j, o in enumerate(outs) if j not in pair.differentiable))
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        pair = ctx.pair
        grad_in = [None] * len(pair.static_in)
        computed = pair.backward(ctx.saved_tensors, [grads[j] for j in pair.differentiable])
        for i, g in zip(pair.grad_wrt, computed):
            if ctx.needs_input_grad[1 + i]:
                grad_in[i] = g
        return (None, *grad_in)


class GraphCache:
    """``cache(key, fn, *inputs)`` is ``fn(*inputs)``, forward and backward, through the CUDA graphs of ``key``
    and the inputs' shapes, dtypes and devices (and parameters' addresses), captured on the first such call --
    ``fn`` must then be what every later call under that key would pass (module docstring). ``capacity``: pairs
    of graphs kept, least recently used dropped first. ``emulate``: run eagerly through the same plumbing even on
    CUDA (tests)."""

    def __init__(self, capacity: int = defaults.CUDA_GRAPH_SIZES_KEPT, emulate: bool = False):
        if capacity < 1:
            raise ValueError(f"GraphCache: capacity must be >= 1, got {capacity}")
        self.capacity, self.emulate = capacity, emulate
        self.pairs: "OrderedDict[Hashable, _GraphPair]" = OrderedDict()
        self.captures = 0  # pairs made so far (what a log or a test can watch for recaptures)

    def __call__(self, key: Hashable, fn: Callable, *inputs: Tensor) -> Any:
        full_key = (key, tuple((x.shape, x.dtype, x.device, x.data_ptr() if isinstance(x, nn.Parameter) else None)
                               for x in inputs))
        pair = self.pairs.get(full_key)
        if pair is None:
            graphed = not self.emulate and all(x.is_cuda for x in inputs)
            pair = self.pairs[full_key] = _GraphPair(fn, inputs, graphed)
            self.captures += 1
            if len(self.pairs) > self.capacity:
                self.pairs.popitem(last=False)
        else:
            self.pairs.move_to_end(full_key)
        return pair.unflatten(_Replay.apply(pair, *inputs))
