r"""``--arch rnnsearch``: the RNNsearch encoder-decoder of Bahdanau, Cho & Bengio (2014), the model of the
paper's beam-search experiment (App. I.2). fairseq's ``lstm`` uses Luong-style attention; this is the
original:

* encoder: bidirectional GRU over the source embeddings, annotations :math:`h_j = [\vec h_j; \overleftarrow h_j]`;
* decoder state :math:`s_0 = \tanh(W_s \overleftarrow h_1)`; at step ``i`` the context
  :math:`c_i` attends over :math:`h` with the additive score :math:`v^\top\tanh(W s_{i-1} + U h_j)`;
* output :math:`p(y_i) \propto \exp(W_o t_i)`, :math:`t_i = \max\text{-out}_2(U_o s_{i-1} + V_o E y_{i-1} + C_o c_i)`;
* update :math:`s_i = \mathrm{GRU}(s_{i-1}, [E y_{i-1}; c_i])`.

Incremental decoding caches :math:`s`, whose reorder is an ``index_select`` (so the soft beam search mixes it),
and :math:`U h_j` for the annotations it projects. ``rnnsearch`` is a small default; ``rnnsearch_wmt14_en_fr``
has the paper's sizes (embeddings 620, GRU 1000, alignment 1000, maxout 500).
"""
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from fairseq.dataclass import FairseqDataclass
from fairseq.models import (FairseqEncoder, FairseqEncoderDecoderModel, FairseqIncrementalDecoder,
                            register_model, register_model_architecture)
from torch import Tensor, nn

from softtopk_fairseq.models.flags import add_flags, fill_defaults
from softtopk_fairseq.modules.additive_attention import AdditiveAttention

DEFAULT_MAX_POSITIONS = 1024


class RNNSearchEncoder(FairseqEncoder):
    r"""Bidirectional GRU over the source embeddings: the annotations :math:`h_j = [\vec h_j; \overleftarrow h_j]`
    (``annotations``, B x S x 2H, right-padded), the padding mask and :math:`\overleftarrow h_1`
    (``backward_first``, the decoder's initial state's input), and ``source_order`` (B x S): the annotation of
    ``src_tokens``' position ``j`` (left-padded by default) is ``annotations[b, source_order[b, j]]``."""

    def __init__(self, dictionary, embed_dim, hidden_size, dropout):
        super().__init__(dictionary)
        self.padding_idx = dictionary.pad()
        self.embed_tokens = nn.Embedding(len(dictionary), embed_dim, padding_idx=self.padding_idx)
        self.rnn = nn.GRU(embed_dim, hidden_size, batch_first=True, bidirectional=True)
        self.dropout = dropout
        self.output_dim = 2 * hidden_size

    def forward(self, src_tokens: Tensor, src_lengths: Tensor, **unused):
        # fairseq left-pads sources by default; packing wants right padding: row b rolled left by its padding.
        padding = src_tokens.eq(self.padding_idx)
        positions = torch.arange(src_tokens.size(1), device=src_tokens.device).expand_as(src_tokens)
        shift = padding.sum(1, keepdim=True) if bool(padding[:, 0].any()) else torch.zeros_like(positions[:, :1])
        tokens = src_tokens.gather(1, (positions + shift) % src_tokens.size(1))
        x = F.dropout(self.embed_tokens(tokens), self.dropout, self.training)
        packed = nn.utils.rnn.pack_padded_sequence(x, src_lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, h_n = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=tokens.size(1))
        return {
            "annotations": [F.dropout(out, self.dropout, self.training)],  # (B, S, 2H)
            "padding_mask": [tokens.eq(self.padding_idx)],                  # (B, S)
            "backward_first": [h_n[1]],                                     # (B, H): <-h_1
            "source_order": [(positions - shift) % src_tokens.size(1)],     # (B, S)
        }

    def reorder_encoder_out(self, encoder_out, new_order):
        return {key: [v.index_select(0, new_order) for v in values] for key, values in encoder_out.items()}

    def max_positions(self):
        return DEFAULT_MAX_POSITIONS


class RNNSearchDecoder(FairseqIncrementalDecoder):
    r"""GRU decoder with additive attention and a max-out readout (the module docstring's equations); the
    incremental state is :math:`s` (and the projected keys of one encoder output, which no reorder touches), so a
    beam reorder -- hard or the soft beam search's mixing -- is one ``index_select`` on it."""

    def __init__(self, dictionary, embed_dim, hidden_size, context_dim, attention_dim, maxout_dim, dropout):
        super().__init__(dictionary)
        self.embed_tokens = nn.Embedding(len(dictionary), embed_dim, padding_idx=dictionary.pad())
        self.init_state = nn.Linear(context_dim // 2, hidden_size)
        self.attention = AdditiveAttention(hidden_size, context_dim, attention_dim)
        self.cell = nn.GRUCell(embed_dim + context_dim, hidden_size)
        self.readout_state = nn.Linear(hidden_size, 2 * maxout_dim)
        self.readout_input = nn.Linear(embed_dim, 2 * maxout_dim, bias=False)
        self.readout_context = nn.Linear(context_dim, 2 * maxout_dim, bias=False)
        self.output_projection = nn.Linear(maxout_dim, len(dictionary))
        self.dropout = dropout

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **unused):
        features, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        return self.output_layer(features), extra

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **unused):
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
        annotations = encoder_out["annotations"][0]
        padding_mask = encoder_out["padding_mask"][0]
        embedded = F.dropout(self.embed_tokens(prev_output_tokens), self.dropout, self.training)
        projected_keys = self._projected_keys(annotations, incremental_state)
        cached = self.get_incremental_state(incremental_state, "cached_state") if incremental_state is not None else None
        if cached is not None:
            state = cached["state"]
        else:
            state = torch.tanh(self.init_state(encoder_out["backward_first"][0]))
        readouts, weights = [], []
        for i in range(embedded.size(1)):
            y_prev = embedded[:, i]
            context, alpha = self.attention(state, annotations, projected_keys, padding_mask)
            pre = self.readout_state(state) + self.readout_input(y_prev) + self.readout_context(context)
            readouts.append(pre.view(pre.size(0), -1, 2).amax(-1))  # max-out over pairs
            weights.append(alpha)
            state = self.cell(torch.cat([y_prev, context], dim=-1), state)
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "cached_state", {"state": state})
        features = F.dropout(torch.stack(readouts, 1), self.dropout, self.training)
        # The weights over src_tokens' own positions, as fairseq's generator reads them (--print-alignment,
        # --replace-unk): the annotations are right-padded, a left-padded source's tokens are not.
        weights = torch.stack(weights, 1)
        order = encoder_out["source_order"][0].unsqueeze(1).expand_as(weights)
        return features, {"attn": [weights.gather(2, order)]}

    def _projected_keys(self, annotations: Tensor, incremental_state) -> Tensor:
        """``U h_j`` (B, S, A) for ``annotations``. In incremental decoding it is kept in the incremental state with
        the annotations it projects and projected again only for others: the soft beam search passes one encoder
        output to every step, which would otherwise repeat the same product (and its backward) at each of them;
        fairseq's generator reorders the encoder output at every step, so it projects at every step."""
        if incremental_state is None:
            return self.attention.project_keys(annotations)
        cached = self.get_incremental_state(incremental_state, "projected_keys")
        if cached is not None and cached["annotations"] is annotations:
            return cached["projected"]
        projected = self.attention.project_keys(annotations)
        self.set_incremental_state(incremental_state, "projected_keys",
                                   {"annotations": annotations, "projected": projected})
        return projected

    def output_layer(self, features):
        return self.output_projection(features)

    def reorder_incremental_state(self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]], new_order: Tensor):
        cached = self.get_incremental_state(incremental_state, "cached_state")
        if cached is None:
            return
        self.set_incremental_state(incremental_state, "cached_state",
                                   {"state": cached["state"].index_select(0, new_order)})

    def max_positions(self):
        return DEFAULT_MAX_POSITIONS


@dataclass
class RNNSearchConfig(FairseqDataclass):
    """The flags of the ``rnnsearch`` architectures, each help and ``rnnsearch``'s default written once, here."""

    encoder_embed_dim: int = field(default=256, metadata={"help": "source embedding size"})
    encoder_hidden_size: int = field(default=256, metadata={"help": "GRU size of each direction"})
    decoder_embed_dim: int = field(default=256, metadata={"help": "target embedding size"})
    decoder_hidden_size: int = field(default=512, metadata={"help": "decoder GRU size"})
    attention_dim: int = field(default=256, metadata={"help": "alignment model size"})
    maxout_dim: int = field(default=256, metadata={"help": "max-out readout size"})
    dropout: float = field(default=0.2, metadata={"help": "dropout probability"})


@register_model("rnnsearch")
class RNNSearchModel(FairseqEncoderDecoderModel):
    @staticmethod
    def add_args(parser):
        add_flags(parser, RNNSearchConfig())

    @classmethod
    def build_model(cls, args, task):
        base_architecture(args)
        encoder = RNNSearchEncoder(task.source_dictionary, args.encoder_embed_dim, args.encoder_hidden_size,
                                   args.dropout)
        decoder = RNNSearchDecoder(task.target_dictionary, args.decoder_embed_dim, args.decoder_hidden_size,
                                   encoder.output_dim, args.attention_dim, args.maxout_dim, args.dropout)
        return cls(encoder, decoder)


@register_model_architecture("rnnsearch", "rnnsearch")
def base_architecture(args):
    fill_defaults(args, RNNSearchConfig())


# Bahdanau et al. (2014)'s sizes, as in the paper's WMT14 en-fr experiment.
WMT14_EN_FR = RNNSearchConfig(encoder_embed_dim=620, encoder_hidden_size=1000, decoder_embed_dim=620,
                              decoder_hidden_size=1000, attention_dim=1000, maxout_dim=500, dropout=0.0)


@register_model_architecture("rnnsearch", "rnnsearch_wmt14_en_fr")
def rnnsearch_wmt14_en_fr(args):
    """Bahdanau et al. (2014) RNNsearch sizes, as in the paper's WMT14 en-fr experiment (:data:`WMT14_EN_FR`)."""
    fill_defaults(args, WMT14_EN_FR)
