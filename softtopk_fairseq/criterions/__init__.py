"""fairseq criterions of softtopk-fairseq (registered on import)."""
