"""Set-up without a package index: scripts/offline_wheels.sh refuses what it cannot do, and
``SOFTTOPK_WHEELS=DIR bash scripts/gpu_check.sh`` installs a directory of wheels for the interpreter's own torch,
stopping, by name, on a requirement they leave unmet. (The download itself reaches the package index and is not
run here; its output for CPython 3.12 is recorded in docs/results/setup_and_tests.md.)"""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CHECK = os.path.join(ROOT, "scripts", "gpu_check.sh")


def write_wheel(directory, name, requires=()):
    """A minimal pure-Python wheel of package ``name`` 1.0 requiring ``requires``."""
    dist = f"{name}-1.0.dist-info"
    metadata = "Metadata-Version: 2.1\nName: {}\nVersion: 1.0\n{}".format(
        name, "".join(f"Requires-Dist: {r}\n" for r in requires))
    files = {f"{name}/__init__.py": "VALUE = 1\n", f"{dist}/METADATA": metadata,
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    path = os.path.join(directory, f"{name}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
    return path


def run_gpu_check(wheels, out):
    env = dict(os.environ, SOFTTOPK_WHEELS=str(wheels), SOFTTOPK_PYTHON=sys.executable)
    return subprocess.run(["bash", GPU_CHECK, str(out)], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture
def no_cuda():
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check.sh would run everything")


def test_gpu_check_installs_the_wheels_for_the_interpreter_then_checks_for_cuda(tmp_path, no_cuda):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels, "softtopk_kit_probe", requires=["torch>=1.0"])  # met by this interpreter's torch
    out = run_gpu_check(wheels, tmp_path / "out")
    assert out.returncode == 0 and "no CUDA device" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "out" / "site" / "softtopk_kit_probe" / "__init__.py").exists()


def test_gpu_check_names_what_the_wheels_need_and_the_interpreter_lacks(tmp_path, no_cuda):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels, "softtopk_kit_probe", requires=["torch>=1.0", "softtopk-no-such-dist"])
    out = run_gpu_check(wheels, tmp_path / "out")
    assert out.returncode == 1, out.stdout + out.stderr
    missing = out.stdout.split("does not have:")[1]
    assert "requires softtopk-no-such-dist, which is not installed" in missing
    assert "requires torch" not in missing  # a met requirement is not named
    assert "no CUDA device" not in out.stdout  # it stopped before running anything


def test_gpu_check_stops_when_the_wheels_do_not_install(tmp_path, no_cuda):
    (tmp_path / "wheels").mkdir()  # no wheel at all
    out = run_gpu_check(tmp_path / "wheels", tmp_path / "out")
    assert out.returncode == 1 and "installing the wheels" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("args,python,message", [
    ([], None, "usage:"),
    (["DIR", "twelve"], None, "PYTHON_VERSION must look like 3.12"),
    (["DIR", "3.12"], "/nonexistent/python", "'/nonexistent/python -m pip' does not run"),
])
def test_offline_wheels_refuses_bad_arguments(tmp_path, args, python, message):
    args = [str(tmp_path / "w") if a == "DIR" else a for a in args]
    env = dict(os.environ, **({"PYTHON": python} if python else {}))
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "offline_wheels.sh"), *args], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "w").exists()  # nothing made before the arguments were checked
