"""Operator core: SOFT top-k and sorted SOFT top-k (torch only; no fairseq import)."""
from softtopk_fairseq.ops.soft_topk import SoftTopK, SolverInfo, effective_epsilon, soft_topk
from softtopk_fairseq.ops.softmax_k_times import softmax_k_times

__all__ = ["soft_topk", "SoftTopK", "SolverInfo", "effective_epsilon", "softmax_k_times"]
