"""fairseq user dir: ``fairseq-train --user-dir user_dir ...`` registers softtopk-fairseq's components.

It only imports the package's registration module; all code lives in ``softtopk_fairseq``. When the
package is not installed (a plain clone used from an existing fairseq), the clone's root is put on the
import path so ``--user-dir path/to/clone/user_dir`` works without ``pip install``.
"""
import os
import sys

try:
    import softtopk_fairseq  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import softtopk_fairseq.fairseq_plugin  # noqa: E402,F401
