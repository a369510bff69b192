"""Everything fairseq must see, imported in one place.

``user_dir/__init__.py`` imports this module; so can any script that builds fairseq objects in Python.
Importing it registers this package's criterions, architectures and learning-rate schedulers with fairseq and makes torch >= 2.6
able to load fairseq checkpoints.
"""
from softtopk_fairseq.checkpoint_compat import allow_fairseq_checkpoints

allow_fairseq_checkpoints()

# Registration side effects: each subpackage registers its fairseq components on import.
from softtopk_fairseq import criterions, lr_schedulers, models  # noqa: E402,F401
