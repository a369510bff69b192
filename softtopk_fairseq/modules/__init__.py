"""``nn.Module`` building blocks built on ``softtopk_fairseq.ops`` (no fairseq registration here)."""
