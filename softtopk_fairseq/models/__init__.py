"""fairseq model architectures of softtopk-fairseq (registered on import)."""
