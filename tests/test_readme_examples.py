"""The README's Python examples run as written (the one that needs a trained workdir: test_pipeline_trained.py)."""
import torch

from readme_examples import python_blocks


def test_the_operator_example_runs_and_does_what_its_comments_say():
    blocks = [b for b in python_blocks() if "soft_topk(" in b]
    assert len(blocks) == 1
    names = {}
    exec(compile(blocks[0], "README.md", "exec"), names)
    a, A, info, k = names["a"], names["A"], names["info"], names["k"]
    torch.testing.assert_close(a.sum(-1), torch.full((8,), float(k)))  # sums to k (over the kept entries)
    assert float(a.masked_select(~names["keep"]).abs().max()) == 0       # masked entries excluded
    assert A.shape == (8, 100, k) and bool(info.converged.all())
    assert names["scores"].grad is not None and bool(torch.isfinite(names["scores"].grad).all())
    # check_errors=False: on finite scores, the checked call's result
    torch.testing.assert_close(names["b"], names["soft_topk"](names["scores"], k))
