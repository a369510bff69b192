"""Every default of softtopk-fairseq, written once: the operator, the soft beam search (its Python function and the
``soft_beam_search`` criterion's flags), the top-k attention (its function and the architectures' flags) and the
demo pipeline read them from here (tests/test_defaults.py checks that they do). Plain values, no imports: every
layer may read this module.
"""

# ---------------------------------------------------------------------------------------- the operators ----
# The smoothing scale of every relaxation: the entropic temperature of SOFT top-k and of softmax-k-times, the
# standard deviation of the perturbed top-k's noise.
EPSILON = 0.1
# soft_topk's cost normalisation in Python: "none" (epsilon in the units of the scores). The soft beam search
# uses SEARCH_SCALING instead.
OPERATOR_SCALING = "none"
# The OT solver: stop when every anchor's mass is within TOL (relative) of its target, or after MAX_ITER steps.
TOL_FLOAT32 = 1e-6  # (also for float16 / bfloat16 scores, computed in float32)
TOL_FLOAT64 = 1e-12
MAX_ITER = {"newton": 50, "sinkhorn": 200}
SOLVER_METHOD = "newton"
# Gaussian draws per call of the perturbed top-k (its gradient's variance falls as 1 / samples).
PERTURBED_SAMPLES = 16

# ----------------------------------------------------------------------------------- the soft beam search ----
BEAM = 5
SEARCH_RELAXATION = "soft_topk"
# The authors' normalisation of the OT cost (temperature = epsilon * max cost / 2 per sentence): with the
# temperature in nats ("none") and epsilon 0.1, fine-tuning diverged (docs/results/temperature.md).
SEARCH_SCALING = "paper"
TEACHER_FORCING_RATIO = 0.8  # rho in L = rho * L_tf + (1 - rho) * L_SOFT
CANDIDATES = 0  # candidates kept per sentence before the relaxed top-k: 0 = all k * V (exact)
BOOKKEEPING = "argmax"
# --soft-beam-cuda-graphs: the batch sizes whose captured graphs are kept (least recently used dropped first; a
# dropped size is captured again when it returns). Each keeps a few times sentences x beam x vocabulary floats.
CUDA_GRAPH_SIZES_KEPT = 64

# ------------------------------------------------------------------------------------- top-k attention ----
TOPK_ATTN_K = 4
TOPK_ATTN_MODE = "soft_topk"
TOPK_ATTN_INFERENCE = "same"  # in eval mode: the training mode's weights
