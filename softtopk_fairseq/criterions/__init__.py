"""fairseq criterions of softtopk-fairseq (registered on import)."""
from softtopk_fairseq.criterions import soft_beam_search  # noqa: F401
