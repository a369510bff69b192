"""scripts/setup_env.sh picks the torch build: CPU without an NVIDIA GPU, CUDA (with the triton that PyPI's
CUDA torch requires) when asked or when nvidia-smi lists a GPU; checked through its plan mode, which
installs nothing."""
import os
import subprocess

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "setup_env.sh")


def _plan(tmp_path, **env):
    full = dict(os.environ, SOFTTOPK_SETUP_PLAN="1", SOFTTOPK_VENV=str(tmp_path / "venv"), **env)
    return subprocess.run(["bash", SCRIPT], env=full, capture_output=True, text=True)


def _pins(out):
    return {line.split("==")[0]: line.split("==")[1] for line in out.splitlines() if "==" in line}


def test_cpu_and_cuda_builds_pin_their_own_triton(tmp_path):
    cpu, cuda = _plan(tmp_path, SOFTTOPK_TORCH="cpu"), _plan(tmp_path, SOFTTOPK_TORCH="cuda")
    assert cpu.returncode == 0 and cuda.returncode == 0, cpu.stderr + cuda.stderr
    assert "torch build: cpu" in cpu.stdout and "torch build: cuda" in cuda.stdout
    pins_cpu, pins_cuda = _pins(cpu.stdout), _pins(cuda.stdout)
    assert pins_cpu["triton"] == "3.8.0" and pins_cuda["triton"] == "3.7.1"
    assert pins_cpu["torch"] == pins_cuda["torch"] == "2.13.0"
    assert {k: v for k, v in pins_cpu.items() if k != "triton"} == {k: v for k, v in pins_cuda.items() if k != "triton"}
    assert not (tmp_path / "venv").exists()  # the plan installs nothing


def test_auto_follows_nvidia_smi(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    with_gpu = _plan(tmp_path, SOFTTOPK_TORCH="auto", PATH=f"{fake}:{os.environ['PATH']}")
    assert "torch build: cuda" in with_gpu.stdout, with_gpu.stderr
    smi.write_text("#!/bin/sh\nexit 9\n")  # no driver / no GPU
    without = _plan(tmp_path, SOFTTOPK_TORCH="auto", PATH=f"{fake}:{os.environ['PATH']}")
    assert "torch build: cpu" in without.stdout, without.stderr


def test_unknown_build_is_a_clear_error(tmp_path):
    out = _plan(tmp_path, SOFTTOPK_TORCH="gpu")
    assert out.returncode == 2 and "SOFTTOPK_TORCH must be cpu, cuda or auto, got 'gpu'" in out.stderr


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_an_explicit_index_is_used_for_the_cuda_build_only(tmp_path, flavour):
    out = _plan(tmp_path, SOFTTOPK_TORCH=flavour, SOFTTOPK_TORCH_INDEX="https://example.invalid/whl")
    assert out.returncode == 0
    assert ("(index https://example.invalid/whl)" in out.stdout) == (flavour == "cuda")


def test_the_lowest_versions_checked_are_the_floors_pyproject_declares():
    """scripts/test_lowest.sh's pins (constraints-lowest.txt) sit on the floors that pyproject.toml declares --
    Python, torch, numpy, fairseq-fixed --, so that what is declared is what is tested; and the test files it runs
    exist."""
    import re
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    with open(os.path.join(root, "constraints-lowest.txt"), encoding="utf-8") as f:
        pins = {line.split("==")[0]: line.split("==")[1].strip() for line in f if "==" in line and line[0] != "#"}
    floors = dict(re.findall(r'"(torch|numpy|fairseq-fixed)>=([\d.]+)"', pyproject))
    assert set(floors) == {"torch", "numpy", "fairseq-fixed"}, floors
    for name, floor in floors.items():
        assert pins[name].startswith(floor + ".") or pins[name] == floor, (name, floor, pins[name])
    python_floor = re.search(r'requires-python = ">=(3\.\d+)"', pyproject).group(1)
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" == python_floor  # the check's venv: this Python
    with open(os.path.join(root, "tests", "lowest_versions.txt"), encoding="utf-8") as f:
        files = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert files and all(os.path.exists(os.path.join(root, path)) for path in files), files
