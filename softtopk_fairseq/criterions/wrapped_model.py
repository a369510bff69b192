"""Running passes of a fairseq model the way its wrappers expect, for a criterion that calls more than the model's
``forward``: inside torch DistributedDataParallel's ``forward`` (so that DDP reduces the gradients of a pass it
did not see start), with fairseq's LayerDrop drawn once for all of a batch's passes, and whether the model's
``forward`` is one of fairseq's "encoder, then decoder" forwards (so that a criterion may run those two halves
itself)."""
import contextlib
from typing import List

import torch
from fairseq.models import FairseqEncoderDecoderModel
from fairseq.models.lstm import LSTMModel
from fairseq.models.transformer import TransformerModelBase
from fairseq.modules import LayerDropModuleList


def _wrappers(model):
    """``model`` and the modules it wraps (``.module``), outermost first."""
    seen = model
    while isinstance(seen, torch.nn.Module):
        yield seen
        seen = getattr(seen, "module", None)


def refuse_fully_sharded(model) -> None:
    """Raise for a fully sharded model (fairseq's ``--ddp-backend fully_sharded``, fairscale's or torch's
    wrapper): its parameters exist whole only inside the wrapper's ``forward``, and the search calls the encoder and
    the decoder step by step."""
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in _wrappers(model)):
        raise NotImplementedError(
            "soft_beam_search: --ddp-backend fully_sharded is not supported: the search calls the encoder and the "
            "decoder step by step, outside the sharded model's forward; use --ddp-backend pytorch_ddp or legacy_ddp")


def ddp_wrapper(model):
    """The torch DistributedDataParallel wrapping ``model`` (fairseq: ``ModuleProxyWrapper(DDP(model))``), or
    None."""
    for seen in _wrappers(model):
        if isinstance(seen, torch.nn.parallel.DistributedDataParallel):
            return seen
    return None


# fairseq's own forwards that are "the encoder, then the decoder on its output": for models using one of them,
# `sum` mode computes both losses from one encoder pass. Other models keep their own forward for L_tf.
ENCODER_THEN_DECODER = (FairseqEncoderDecoderModel.forward, TransformerModelBase.forward, LSTMModel.forward)


def encoder_then_decoder(model) -> bool:
    """Whether ``model`` (inside any DDP / fairseq wrappers) runs one of the :data:`ENCODER_THEN_DECODER`
    forwards."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return type(model).forward in ENCODER_THEN_DECODER


def run_inside_ddp_forward(model, fn):
    """``fn(inner_model)``, run through the DistributedDataParallel wrapper's ``forward`` when there is one,
    so that DDP prepares its gradient reduction for this iteration (it only does in an iteration where its
    own forward ran); ``fn(model)`` otherwise. The inner module's ``forward`` is replaced for that one call."""
    ddp = ddp_wrapper(model)
    if ddp is None:
        return fn(model)
    inner = ddp.module
    inner.forward = lambda **_: fn(inner)  # an instance attribute: DDP's self.module(...) calls it
    try:
        # One argument, unused: DDP built with device_ids (as fairseq builds it on a GPU) moves its inputs to the
        # device and reads the first of them -- an IndexError for a call with none.
        return ddp(inside_ddp_forward=True)
    finally:
        del inner.forward


class _LayerDropDrawn(LayerDropModuleList):
    """A :class:`LayerDropModuleList` whose layers were drawn once (:func:`layer_drop_drawn_once`)."""

    drawn: List[torch.nn.Module]

    def __iter__(self):
        return iter(self.drawn)


@contextlib.contextmanager
def layer_drop_drawn_once(model):
    """fairseq's LayerDrop (``--encoder-layerdrop`` / ``--decoder-layerdrop``) draws which layers run each time
    a layer list is iterated: once per teacher-forcing pass, but once per *decoding step* in the beam search --
    where a layer skipped at some steps would miss those positions in its cached keys and values, and the beams
    would run a different network at every step. Inside this context every list of ``model`` in training keeps
    one draw, so the whole criterion call (both losses) runs one sub-network, as a teacher-forcing pass does."""
    lists = [m for m in model.modules() if type(m) is LayerDropModuleList and m.training and m.p > 0]
    for layers in lists:
        drawn = list(LayerDropModuleList.__iter__(layers))
        layers.__class__, layers.drawn = _LayerDropDrawn, drawn
    try:
        yield
    finally:
        for layers in lists:
            layers.__class__ = LayerDropModuleList
            del layers.drawn
