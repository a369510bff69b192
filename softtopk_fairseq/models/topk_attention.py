"""Top-k attention in fairseq's own attention layers, and the ``transformer_topk_attn``, ``lstm_topk_attn`` and
``rnnsearch_topk_attn`` (+ ``_wmt14_en_fr``) architectures (paper App. I.3). The weights come from
:func:`softtopk_fairseq.modules.topk_attention.topk_attention_weights`; here they are only wired in.

Stock layers are built by fairseq as usual and then given the top-k class (``layer.__class__ = ...``): the
parameters, state-dict keys, projections, masking and incremental caching stay fairseq's, and checkpoints of
the stock and top-k models load into each other. What changes is the step from masked scores to weights.

Flags (all architectures):

* ``--topk-attn-k K`` keys per query, ``--topk-attn-epsilon`` SOFT top-k temperature (attention-logit units;
  the noise's standard deviation in ``perturbed`` mode), ``--topk-attn-samples`` perturbations per call;
* ``--topk-attn-mode {soft_topk,hard_topk,softmax,perturbed}`` the weights used in training: SOFT top-k, hard
  top-k (Explicit Sparse Transformer), plain softmax, or the perturbed top-k
  (:mod:`~softtopk_fairseq.modules.relaxations`) -- one model definition for every row of a comparison;
* ``--topk-attn-inference {same,soft_topk,hard_topk,softmax,perturbed}`` the weights in eval mode
  (``fairseq-generate``; override a checkpoint's with ``--model-overrides "{'topk_attn_inference': 'hard_topk'}"``);
* transformer only: ``--topk-attn-layers`` which attentions use it, a comma list of ``encoder-decoder``
  (default), ``decoder-self``, ``encoder-self``.

Checkpoints of earlier versions, whose saved arguments name the modes ``soft`` and ``hard``, load unchanged:
:func:`upgrade_args` renames them when the model is built (with a one-time ``FutureWarning``), as it does the
same spellings on a command line.
"""
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import register_model
from fairseq.models.lstm import AttentionLayer, LSTMModel
from fairseq.models.lstm import base_architecture as lstm_base_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer import base_architecture as transformer_base_architecture
from fairseq.models.transformer import (transformer_iwslt_de_en, transformer_vaswani_wmt_en_de_big,
                                        transformer_wmt_en_de)
from fairseq.modules import MultiheadAttention
from torch import Tensor

from softtopk_fairseq import defaults
from softtopk_fairseq.models.flags import add_flags, register_architectures
from softtopk_fairseq.models.rnnsearch import RNNSearchModel
from softtopk_fairseq.models.rnnsearch import base_architecture as rnnsearch_base_architecture
from softtopk_fairseq.models.rnnsearch import rnnsearch_wmt14_en_fr
from softtopk_fairseq.modules import relaxations
from softtopk_fairseq.modules.topk_attention import INFERENCE_SAME, USE, TopkAttentionMixin, check_topk_options

ATTENTION_KINDS = ("encoder-decoder", "decoder-self", "encoder-self")


class TopkMultiheadAttention(TopkAttentionMixin, MultiheadAttention):
    """fairseq's ``MultiheadAttention`` with top-k weights; everything up to the masked scores is fairseq's
    (``before_softmax=True``), the rest mirrors its tail."""

    @classmethod
    def convert(cls, layer: MultiheadAttention, k, epsilon, mode, inference,
                samples=defaults.PERTURBED_SAMPLES) -> "TopkMultiheadAttention":
        check_topk_options(k, epsilon, mode, inference, samples)  # (before the layer changes)
        layer.__class__ = cls
        # PyTorch's fused attention would skip the scores; fairseq bypasses it when this flag is set.
        layer.skip_embed_dim_check = True
        return layer.configure_topk(k, epsilon, mode, inference, samples)

    def additive_mask(self, query: Tensor, attn_mask: Optional[Tensor]) -> Optional[Tensor]:
        """``attn_mask`` as the additive float mask of shape (tgt_len, src_len) that fairseq's own path (the one
        this layer takes) adds to the scores: a bool or uint8 mask -- ``True`` = blocked, as in
        ``torch.nn.MultiheadAttention``, which fairseq's fused path hands it to -- becomes ``-inf`` there and 0
        elsewhere (added as is, ``True`` would raise a score by 1). Refuses, naming the fix, a query whose width is
        not the layer's (the check fairseq makes, which the flag bypassing the fused path also skips) and a mask
        of another shape (a per-head 3-D one included: fairseq's path broadcasts only 2-D masks)."""
        if query.size(-1) != self.embed_dim:
            raise ValueError(f"TopkMultiheadAttention: the query's last dimension is {query.size(-1)}, the layer's "
                             f"embed_dim is {self.embed_dim}; pass queries of shape (tgt_len, batch, "
                             f"{self.embed_dim})")
        if attn_mask is None:
            return None
        if attn_mask.dim() != 2 or attn_mask.size(0) != query.size(0):
            raise ValueError(f"TopkMultiheadAttention: attn_mask has shape {tuple(attn_mask.shape)}; it must be "
                             f"(tgt_len, src_len) with tgt_len = {query.size(0)}, one mask shared by the batch and "
                             "the heads (mask padded keys with key_padding_mask)")
        if attn_mask.dtype in (torch.bool, torch.uint8):
            blocked = attn_mask.bool()
            return torch.zeros(blocked.shape, dtype=query.dtype, device=query.device).masked_fill(blocked, -torch.inf)
        return attn_mask

    def forward(self, query, key: Optional[Tensor], value: Optional[Tensor], key_padding_mask=None,
                incremental_state=None, need_weights: bool = True, static_kv: bool = False, attn_mask=None,
                before_softmax: bool = False, need_head_weights: bool = False):
        attn_mask = self.additive_mask(query, attn_mask)  # (and the query's width checked)
        scores, v = super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                    incremental_state=incremental_state, need_weights=need_weights,
                                    static_kv=static_kv, attn_mask=attn_mask, before_softmax=True)
        if before_softmax:
            return scores, v
        if need_head_weights:
            need_weights = True
        tgt_len, bsz = query.size(0), query.size(1)
        src_len = scores.size(-1)
        weights_float = self.topk_weights(scores.float() if scores.dtype == torch.float16 else scores, dim=-1)
        probs = self.dropout_module(weights_float.type_as(scores))
        kv_bsz = v.size(0) // self.num_heads
        if self.encoder_decoder_attention and bsz != kv_bsz:  # fairseq's beam-shared encoder keys
            attn = torch.einsum("bxhts,bhsd->bxhtd",
                                probs.view((kv_bsz, -1, self.num_heads) + probs.size()[1:]),
                                v.view((kv_bsz, self.num_heads) + v.size()[1:]))
            attn = attn.reshape((-1,) + attn.size()[-2:])
        else:
            attn = torch.bmm(probs, v)
        attn = self.out_proj(attn.transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim))
        out_weights: Optional[Tensor] = None
        if need_weights:
            out_weights = weights_float.view(bsz, self.num_heads, tgt_len, src_len).transpose(1, 0)
            if not need_head_weights:
                out_weights = out_weights.mean(dim=0)
        return attn, out_weights


class TopkAttentionLayer(TopkAttentionMixin, AttentionLayer):
    """fairseq's LSTM ``AttentionLayer`` (dot-product scores over source positions) with top-k weights."""

    @classmethod
    def convert(cls, layer: AttentionLayer, k, epsilon, mode, inference,
                samples=defaults.PERTURBED_SAMPLES) -> "TopkAttentionLayer":
        check_topk_options(k, epsilon, mode, inference, samples)  # (before the layer changes)
        layer.__class__ = cls
        return layer.configure_topk(k, epsilon, mode, inference, samples)

    def forward(self, input, source_hids, encoder_padding_mask):
        # input: bsz x input_embed_dim; source_hids: srclen x bsz x source_embed_dim
        x = self.input_proj(input)
        scores = (source_hids * x.unsqueeze(0)).sum(dim=2)
        if encoder_padding_mask is not None:
            scores = scores.float().masked_fill(encoder_padding_mask, float("-inf"))
        weights = self.topk_weights(scores, dim=0).type_as(source_hids)  # srclen x bsz
        x = (weights.unsqueeze(2) * source_hids).sum(dim=0)
        return torch.tanh(self.output_proj(torch.cat((x, input), dim=1))), weights


@dataclass
class TopkAttentionConfig(FairseqDataclass):
    """The top-k attention flags of every ``*_topk_attn`` architecture: help and default written once, here
    (``add_args`` generates the flags from it; the architecture functions fill what a run or an older
    checkpoint's arguments lack)."""

    topk_attn_k: int = field(default=defaults.TOPK_ATTN_K, metadata={"help": "keys each query attends to"})
    topk_attn_epsilon: float = field(
        default=defaults.EPSILON, metadata={"help": "SOFT top-k temperature, in attention-logit units (the noise's "
                                                    "standard deviation with --topk-attn-mode perturbed)"})
    topk_attn_samples: int = field(
        default=defaults.PERTURBED_SAMPLES, metadata={"help": "Gaussian perturbations per call with "
                                                              "--topk-attn-mode perturbed"})
    topk_attn_mode: ChoiceEnum(relaxations.accepted_names(USE)) = field(
        default=defaults.TOPK_ATTN_MODE, metadata={"help": "attention weights in training (old names: soft, hard)"})
    topk_attn_inference: ChoiceEnum((INFERENCE_SAME,) + relaxations.accepted_names(USE)) = field(
        default=defaults.TOPK_ATTN_INFERENCE, metadata={"help": "attention weights in eval mode / fairseq-generate "
                                                                "('same' = as in training)"})


@dataclass
class TransformerTopkAttentionConfig(TopkAttentionConfig):
    topk_attn_layers: str = field(
        default="encoder-decoder", metadata={"help": f"comma list of attentions using top-k: "
                                                     f"{', '.join(ATTENTION_KINDS)}"})


def upgrade_args(args) -> None:
    """Saved or given arguments of an earlier version, in this one's terms: the modes' old names (``soft``,
    ``hard``) renamed to the registry's (:data:`~softtopk_fairseq.modules.relaxations.ALIASES`), with a one-time
    ``FutureWarning``. In place; what is current is left as it is."""
    for flag in ("topk_attn_mode", "topk_attn_inference"):
        value = str(getattr(args, flag))
        if value in relaxations.ALIASES:
            setattr(args, flag, relaxations.resolve(value, USE, "--" + flag.replace("_", "-")))


def topk_options(args):
    """The layers' options from the (upgraded) arguments."""
    upgrade_args(args)
    return dict(k=args.topk_attn_k, epsilon=args.topk_attn_epsilon, mode=str(args.topk_attn_mode),
                inference=str(args.topk_attn_inference), samples=args.topk_attn_samples)


@register_model("transformer_topk_attn")
class TransformerTopkAttnModel(TransformerModel):
    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_flags(parser, TransformerTopkAttentionConfig())

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        kinds = [kind.strip() for kind in args.topk_attn_layers.split(",") if kind.strip()]
        unknown = sorted(set(kinds) - set(ATTENTION_KINDS))
        if unknown or not kinds:
            raise ValueError(f"--topk-attn-layers: unknown or empty {unknown or kinds}; choose from {ATTENTION_KINDS}")
        options = topk_options(args)
        if "encoder-decoder" in kinds and len(model.decoder.layers) and all(
                layer.encoder_attn is None for layer in model.decoder.layers):
            raise ValueError("--topk-attn-layers encoder-decoder: the decoder has no encoder-decoder attention "
                             "(--no-cross-attention); name decoder-self or encoder-self instead")
        for layer in model.decoder.layers:
            if "encoder-decoder" in kinds and layer.encoder_attn is not None:
                TopkMultiheadAttention.convert(layer.encoder_attn, **options)
            if "decoder-self" in kinds:
                TopkMultiheadAttention.convert(layer.self_attn, **options)
        if "encoder-self" in kinds:
            for layer in model.encoder.layers:
                TopkMultiheadAttention.convert(layer.self_attn, **options)
        return model


register_architectures("transformer_topk_attn", TransformerTopkAttentionConfig(), {
    "transformer_topk_attn": transformer_base_architecture,
    "transformer_topk_attn_iwslt_de_en": transformer_iwslt_de_en,
    "transformer_topk_attn_wmt_en_de": transformer_wmt_en_de,
    "transformer_topk_attn_vaswani_wmt_en_de_big": transformer_vaswani_wmt_en_de_big,
})


@register_model("lstm_topk_attn")
class LSTMTopkAttnModel(LSTMModel):
    @staticmethod
    def add_args(parser):
        LSTMModel.add_args(parser)
        add_flags(parser, TopkAttentionConfig())

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        if model.decoder.attention is None:
            raise ValueError("lstm_topk_attn needs --decoder-attention True")
        TopkAttentionLayer.convert(model.decoder.attention, **topk_options(args))
        return model


register_architectures("lstm_topk_attn", TopkAttentionConfig(), {"lstm_topk_attn": lstm_base_architecture})


@register_model("rnnsearch_topk_attn")
class RNNSearchTopkAttnModel(RNNSearchModel):
    @staticmethod
    def add_args(parser):
        RNNSearchModel.add_args(parser)
        add_flags(parser, TopkAttentionConfig())

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        model.decoder.attention.configure_topk(**topk_options(args))
        return model


register_architectures("rnnsearch_topk_attn", TopkAttentionConfig(), {
    "rnnsearch_topk_attn": rnnsearch_base_architecture,
    "rnnsearch_topk_attn_wmt14_en_fr": rnnsearch_wmt14_en_fr,
})
