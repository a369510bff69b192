"""fairseq learning-rate schedulers (registered on import)."""
from softtopk_fairseq.lr_schedulers import resumable_plateau  # noqa: F401
