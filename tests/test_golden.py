"""Behaviour unchanged: every case of ``golden/cases.py`` -- the operator on every backend, one soft beam-search
update per architecture and relaxation, the top-k attention in every mode -- recomputed with the code as it is
and compared with ``golden/golden.pt`` (``golden/record.py``). Bit for bit in the environment the values were
recorded in (``golden/recorded_on.json``: the CPU, its vector extensions, the library and compiler versions);
anywhere else each case within :data:`TOLERANCE`, since other CPUs round differently (torch's and MKL's vector
kernels, the C kernels' ``-march=native``)."""
import hashlib
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from golden.cases import BACKENDS, CASES, backends_here, computed

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
GOLDEN = os.path.join(HERE, "golden.pt")
RECORDED_ON = "recorded_on.json"

# Off the recording environment: each case's largest allowed difference, relative to the largest magnitude of the
# tensor's group (group_scales): about 20x the largest difference tests/golden/spread.py measured on the recording
# machine under other CPUs' code paths (lower ATen and MKL vector levels, the C kernels for x86-64 and x86-64-v3),
# at most 4.3e-7 in every case (docs/architecture.md, "The golden values", has the table). Iteration counts within
# one step: a row whose error lands at the solver's tolerance takes one more under torch 2.4.1 (the lowest-versions
# check).
TOLERANCE = {"soft_topk": 1e-5, "unchecked": 1e-5, "relaxation_ops": 1e-5, "criterion": 1e-5, "attention": 1e-5}
# Settings under which this machine takes other x86-64 CPUs' code paths (tests/golden/spread.py has more).
OTHER_CPU = {"SOFTTOPK_CPU_ARCH": "x86-64", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def environment() -> dict:
    """What decides the bits the cases compute: the CPU (its model and feature flags), torch's vector level, the
    library versions and the C compiler."""
    import numpy

    from softtopk_fairseq.ops.cpu_kernels import _cpu_features  # (the line the C kernels' cache is keyed by)

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    flags = _cpu_features().split(":", 1)[-1].strip()
    try:
        cc = subprocess.run([os.environ.get("CC", "cc"), "--version"], capture_output=True, text=True).stdout
    except OSError:
        cc = ""
    return {"cpu": cpu, "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "numpy": numpy.__version__, "cc": cc.splitlines()[0] if cc else "",
            "softtopk_cpu_arch": os.environ.get("SOFTTOPK_CPU_ARCH", "native"),
            "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "")}


def group_scales(values: dict) -> dict:
    """name -> the largest finite magnitude of the name's group: the gradients of one model's parameters
    (``PREFIX.grad.PARAMETER``) share their update's scale -- a parameter whose exact gradient is zero (a key
    projection's bias under softmax) holds rounding noise, measured against the others' --; any other tensor is its
    own group."""
    def group(name):
        return name.split(".grad.")[0] + ".grad" if ".grad." in name else name

    scale = {}
    for name, value in values.items():
        finite = value[torch.isfinite(value)].double().abs()
        top = finite.max().item() if finite.numel() else 0.0
        scale[group(name)] = max(scale.get(group(name), 0.0), top)
    return {name: scale[group(name)] for name in values}


@pytest.fixture(scope="module")
def golden():
    return torch.load(GOLDEN)


@pytest.fixture(scope="module")
def recorded_here():
    with open(os.path.join(HERE, RECORDED_ON), encoding="utf-8") as f:
        return json.load(f) == environment()


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_match_the_recorded_ones(case, golden, recorded_here):
    got = computed(CASES[case])
    skipped = tuple(f".{b}." for b in BACKENDS if b not in backends_here())  # (an unusable triton's entries)
    missing = sorted(set(n for n in golden if n.startswith(_case_prefixes(case)) and not any(b in n for b in skipped))
                     - set(got))
    assert not missing, f"cases no longer computed: {missing[:5]}"
    assert set(got) <= set(golden), f"cases not recorded: {sorted(set(got) - set(golden))[:5]}"
    scales = group_scales({name: golden[name] for name in got})
    for name, value in got.items():
        expected = golden[name]
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        assert torch.equal(torch.isnan(value), torch.isnan(expected)), name
        if recorded_here:
            assert torch.equal(torch.nan_to_num(value), torch.nan_to_num(expected)), name
        elif name.endswith(".iterations"):  # a row whose error lands at the tolerance may take one step more or less
            assert (value - expected).abs().max() <= 1, name
        else:
            torch.testing.assert_close(value, expected, rtol=0, atol=TOLERANCE[case] * scales[name], equal_nan=True,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_the_cases_hold_where_another_cpu_rounds_otherwise(tmp_path):
    """Every case compared off the recording environment (its tolerances) on this machine made to take other CPUs'
    code paths (OTHER_CPU: the C kernels built for baseline x86-64, MKL's and torch's AVX2 kernels) -- what a
    fresh clone meets on another CPU -- passes."""
    env = dict(os.environ, **OTHER_CPU, SOFTTOPK_CACHE_DIR=str(tmp_path / "kernels"), TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", __file__, "-k",
                          "match_the_recorded"], capture_output=True, text=True, cwd=os.path.dirname(HERE), env=env,
                         timeout=1200)
    assert run.returncode == 0 and f"{len(CASES)} passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


def _case_prefixes(case: str) -> tuple:
    """The name prefixes a case's results carry (``soft_topk.``, ``criterion.``, ...)."""
    return {"soft_topk": ("soft_topk.",), "unchecked": ("unchecked.",),
            "relaxation_ops": ("softmax_k_times.", "effective_epsilon.", "perturbed_topk.", "divide_by_temperature."),
            "criterion": ("criterion.",), "attention": ("attention_weights.", "attention_layer.")}[case]
