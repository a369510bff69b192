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
def test_an_explicit_index_is_used_for_either_build(tmp_path, flavour):
    out = _plan(tmp_path, SOFTTOPK_TORCH=flavour, SOFTTOPK_TORCH_INDEX="https://example.invalid/whl")
    assert out.returncode == 0 and f"torch build: {flavour} (index https://example.invalid/whl)" in out.stdout


# A venv whose python records each call and whose pip, as on a machine whose index is PyPI, cannot install
# torch==2.13.0 with our pins unless an index is named (PyPI's Linux wheel is the CUDA build, pinning its own triton).
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls"
case "$*" in
  *"import torch"*) echo "2.13.0+cpu None" ;;
  *"pip install"*"torch==2.13.0"*) case "$*" in *--index-url*) ;; *) echo "ResolutionImpossible" >&2; exit 1 ;; esac ;;
esac
"""


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_a_cpu_setup_where_the_index_serves_the_cuda_torch_takes_pytorchs_cpu_wheels(tmp_path, flavour):
    """A stock machine's pip (PyPI) has no CPU torch 2.13.0 for Linux: the CPU set-up failed there on the CUDA
    wheel's triton pin. It takes the CPU build from PyTorch's own index instead; the CUDA set-up has no such
    fallback (it fails as pip did)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("SOFTTOPK_TORCH_INDEX", "SOFTTOPK_SETUP_PLAN")}
    out = subprocess.run(["bash", SCRIPT], env=dict(env, SOFTTOPK_VENV=str(venv), SOFTTOPK_TORCH=flavour),
                         capture_output=True, text=True)
    torch_calls = [c for c in (venv / "bin" / "calls").read_text().splitlines() if c.endswith("torch==2.13.0")]
    if flavour == "cuda":
        assert out.returncode == 1 and len(torch_calls) == 1
        return
    assert out.returncode == 0, out.stderr
    assert "--index-url" not in torch_calls[0] and len(torch_calls) == 2
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in torch_calls[1]
    assert "the package index serves no CPU build of torch 2.13.0" in out.stderr


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


def test_a_python_older_than_the_declared_floor_is_named_before_anything_is_installed(tmp_path):
    """pyproject.toml declares Python >= 3.11, which pip enforced only at the last step, minutes in."""
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\ncase \"$1\" in --version) echo 'Python 3.9.18' ;; *) exit 1 ;; esac\n")
    old.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("SOFTTOPK_TORCH_INDEX", "SOFTTOPK_SETUP_PLAN")}
    out = subprocess.run(["bash", SCRIPT], env=dict(env, SOFTTOPK_VENV=str(tmp_path / "venv"), PYTHON=str(old)),
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Python >= 3.11 is needed" in out.stderr and "Python 3.9.18" in out.stderr
    assert "set PYTHON=python3.11" in out.stderr and not (tmp_path / "venv").exists()
