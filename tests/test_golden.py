"""Behaviour unchanged: every case of ``golden/cases.py`` -- the operator on every backend, one soft beam-search
update per architecture and relaxation, the top-k attention in every mode -- recomputed with the code as it is
and compared with ``golden/golden.pt``, recorded with the code before its internals were consolidated
(``golden/record.py``). Bit for bit, except where :data:`ULPS` says why not."""
import os

import pytest
import torch

from golden.cases import CASES, computed

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "golden.pt")

# Cases allowed to differ in the last bits (relative, in units of the dtype's epsilon), and why.
ULPS = {}


@pytest.fixture(scope="module")
def golden():
    return torch.load(GOLDEN)


def _allowed_ulps(name: str) -> int:
    return max((ulps for prefix, ulps in ULPS.items() if name.startswith(prefix)), default=0)


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_match_the_recorded_ones(case, golden):
    got = computed(CASES[case])
    missing = sorted(set(n for n in golden if n.startswith(_case_prefixes(case))) - set(got))
    assert not missing, f"cases no longer computed: {missing[:5]}"
    assert set(got) <= set(golden), f"cases not recorded: {sorted(set(got) - set(golden))[:5]}"
    for name, value in got.items():
        expected = golden[name]
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        ulps = _allowed_ulps(name)
        if ulps == 0:
            assert torch.equal(value, expected) or (
                torch.equal(torch.isnan(value), torch.isnan(expected))
                and torch.equal(torch.nan_to_num(value), torch.nan_to_num(expected))), name
        else:
            eps = torch.finfo(value.dtype).eps
            torch.testing.assert_close(value, expected, rtol=ulps * eps, atol=ulps * eps * expected.abs().max(),
                                       equal_nan=True, msg=name)


def _case_prefixes(case: str) -> tuple:
    """The name prefixes a case's results carry (``soft_topk.``, ``criterion.``, ...)."""
    return {"soft_topk": ("soft_topk.",), "unchecked": ("unchecked.",),
            "relaxation_ops": ("softmax_k_times.", "effective_epsilon.", "perturbed_topk.", "divide_by_temperature."),
            "criterion": ("criterion.",), "attention": ("attention_weights.", "attention_layer.")}[case]
