"""softtopk-fairseq: differentiable (SOFT) top-k with optimal transport, as a fairseq plugin.

Layers, each importing only the ones before it:

* ``softtopk_fairseq.ops``        -- the operators (torch only, no fairseq).
* ``softtopk_fairseq.modules``    -- ``nn.Module`` building blocks that use ``ops``.
* ``softtopk_fairseq.criterions``, ``softtopk_fairseq.models`` -- fairseq registrations.
* ``softtopk_fairseq.fairseq_plugin`` -- imports everything fairseq must see; ``user_dir/`` imports it.
* ``softtopk_fairseq.pipeline``   -- the offline demo pipeline (drives the fairseq command lines).
"""
__version__ = "0.1.0"
