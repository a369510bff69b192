"""The README's operator example does what its comments say (test_docs.py runs every runnable block; this checks
the README's results; the docs' workdir example: test_pipeline_trained.py)."""
import torch

from readme_examples import python_blocks


def test_the_operator_example_does_what_its_comments_say():
    blocks = [b for b in python_blocks() if "soft_topk(" in b]
    assert len(blocks) == 1
    names = {}
    exec(compile(blocks[0], "README.md", "exec"), names)
    a, A, scores = names["a"], names["A"], names["scores"]
    assert float(a.min()) >= 0 and float(a.max()) <= 1
    torch.testing.assert_close(a.sum(-1), torch.full((8,), 5.0))  # each row sums to 5
    assert A.shape == (8, 100, 5)
    torch.testing.assert_close(A.sum(-2), torch.ones(8, 5))      # every rank column sums to 1
    assert scores.grad is not None and bool(torch.isfinite(scores.grad).all())
