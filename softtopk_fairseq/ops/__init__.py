"""Operator core: SOFT top-k and sorted SOFT top-k (torch only; no fairseq import)."""
from softtopk_fairseq.ops.arguments import BadScoresError, bad_score_rows
from softtopk_fairseq.ops.soft_topk import SoftTopK, SolverInfo, divide_by_temperature, effective_epsilon, soft_topk
from softtopk_fairseq.ops.backends import use_backend
from softtopk_fairseq.ops.perturbed_topk import perturbed_topk
from softtopk_fairseq.ops.softmax_k_times import softmax_k_times

__all__ = ["soft_topk", "SoftTopK", "SolverInfo", "effective_epsilon", "divide_by_temperature", "softmax_k_times",
           "perturbed_topk", "use_backend", "BadScoresError", "bad_score_rows"]
