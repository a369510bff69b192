"""Operator core: SOFT top-k and sorted SOFT top-k (torch only; no fairseq import)."""
from softtopk_fairseq.ops.soft_topk import SoftTopK, SolverInfo, soft_topk

__all__ = ["soft_topk", "SoftTopK", "SolverInfo"]
