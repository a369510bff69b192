"""fairseq user dir of the installed package: ``--user-dir $(python -c "import softtopk_fairseq;
print(softtopk_fairseq.user_dir())")`` registers softtopk-fairseq's components. It only imports the
registration module (the clone's top-level ``user_dir/`` does the same)."""
import softtopk_fairseq.fairseq_plugin  # noqa: F401
