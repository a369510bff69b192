"""fairseq model architectures of softtopk-fairseq (registered on import)."""
from softtopk_fairseq.models import rnnsearch, topk_attention  # noqa: F401
