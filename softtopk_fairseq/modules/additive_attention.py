r"""Additive (Bahdanau) attention: :math:`e_j = v^\top \tanh(W s + U h_j)`, :math:`\alpha = \mathrm{softmax}(e)`
over the unmasked source positions, context :math:`c = \sum_j \alpha_j h_j`. ``configure_topk`` switches the
weights to SOFT top-k or hard top-k attention (:mod:`softtopk_fairseq.modules.topk_attention`)."""
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from softtopk_fairseq.modules.topk_attention import TopkAttentionMixin


class AdditiveAttention(TopkAttentionMixin, nn.Module):
    def __init__(self, query_dim: int, key_dim: int, attention_dim: int):
        super().__init__()
        self.configure_topk(1, 0.1, "softmax", "same")  # plain softmax attention unless configured
        self.query_proj = nn.Linear(query_dim, attention_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, attention_dim)
        self.score = nn.Linear(attention_dim, 1, bias=False)

    def project_keys(self, keys: Tensor) -> Tensor:
        """``U h_j`` for all positions, (B, S, A): computed once per source, reused at every step."""
        return self.key_proj(keys)

    def forward(self, query: Tensor, keys: Tensor, projected_keys: Tensor,
                key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """query (B, Q), keys (B, S, K), projected_keys (B, S, A), key_padding_mask (B, S) True = pad.
        Returns the context (B, K) and the weights (B, S)."""
        scores = self.score(torch.tanh(self.query_proj(query).unsqueeze(1) + projected_keys)).squeeze(2)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask, -torch.inf)
        weights = self.topk_weights(scores, dim=-1)
        return torch.bmm(weights.unsqueeze(1), keys).squeeze(1), weights
