"""softtopk-fairseq: differentiable (SOFT) top-k with optimal transport, as a fairseq plugin.

Layers, each importing only the ones before it:

* ``softtopk_fairseq.ops``        -- the operators (torch only, no fairseq).
* ``softtopk_fairseq.modules``    -- ``nn.Module`` building blocks that use ``ops``.
* ``softtopk_fairseq.criterions``, ``softtopk_fairseq.models`` -- fairseq registrations.
* ``softtopk_fairseq.fairseq_plugin`` -- imports everything fairseq must see; the user dirs import it
  (:func:`user_dir`, inside the package; ``user_dir/`` in a clone).
* ``softtopk_fairseq.pipeline``   -- the offline demo pipeline (drives the fairseq command lines).
"""
__version__ = "1.0.0"


def user_dir() -> str:
    """The fairseq ``--user-dir`` that ships inside this package (works installed, not only in a clone)."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "fairseq_user_dir", "softtopk_fairseq_user_dir")
