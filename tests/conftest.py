import os

import pytest

# Triton kernels run in the interpreter on CPU tensors; this must be set before triton is imported.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --outcomes PATH: each test's outcome written as it ends (outcomes.py; scripts/gpu_check.sh uses it)
pytest_plugins = ["outcomes"]


@pytest.fixture(autouse=True)
def _global_state_restored():
    """What a test changes in process-wide state is put back after it: torch's thread count (a benchmark helper
    sets it) and the relaxations registered (a GPU diagnostic registers its own), so that no test sees another's."""
    import torch

    from softtopk_fairseq.modules import relaxations

    threads, registered = torch.get_num_threads(), dict(relaxations._REGISTRY)
    yield
    torch.set_num_threads(threads)
    relaxations._REGISTRY.clear()
    relaxations._REGISTRY.update(registered)


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def toy_data_bin(tmp_path_factory):
    """A preprocessed tiny en->fr corpus (word level): 200 train, 20 valid, 12 test pairs."""
    from fairseq_cli import fairseq
    from softtopk_fairseq.pipeline import toy_corpus

    root = tmp_path_factory.mktemp("toy_data")
    for split, n, seed in (("train", 200, 1), ("valid", 20, 2), ("test", 12, 3)):
        toy_corpus.write_split(str(root / split), n, seed)
    fairseq("preprocess", "--source-lang", "en", "--target-lang", "fr", "--trainpref", root / "train",
            "--validpref", root / "valid", "--testpref", root / "test", "--destdir", root / "bin",
            "--joined-dictionary", "--workers", "1")
    assert (root / "bin" / "dict.en.txt").exists() and (root / "bin" / "train.en-fr.en.bin").exists()
    return root / "bin"
