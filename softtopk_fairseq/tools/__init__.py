"""Command-line tools that work on fairseq checkpoints (``python -m softtopk_fairseq.tools.<name>``)."""
