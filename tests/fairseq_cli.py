"""Helpers that run fairseq's real command lines in a subprocess, as a user would."""
import os
import subprocess

from softtopk_fairseq.pipeline.run import fairseq_cmd

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO_ROOT, "user_dir")


def fairseq(tool, *args, cwd=None, check=True):
    """Run ``fairseq-<tool> ARGS`` with this interpreter; return the completed process (output captured)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*fairseq_cmd(tool), *map(str, args)],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"fairseq-{tool} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc
