"""Helpers that run fairseq's real command lines in a subprocess, as a user would."""
import os
import subprocess

from softtopk_fairseq.pipeline.run import fairseq_cmd, quiet_warnings_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO_ROOT, "user_dir")


def fairseq(tool, *args, cwd=None, check=True):
    """Run ``fairseq-<tool> ARGS`` with this interpreter; return the completed process (output captured)."""
    env = dict(quiet_warnings_env(), OMP_NUM_THREADS="1")  # (fairseq's own noise filtered, as the pipeline does)
    proc = subprocess.run(
        [*fairseq_cmd(tool), *map(str, args)],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"fairseq-{tool} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


# Tiny model sizes for CLI runs, per architecture family (the *_topk_attn variants share their family's).
TINY_SIZES = {
    "lstm": ["--encoder-embed-dim", "8", "--decoder-embed-dim", "8", "--encoder-hidden-size", "8",
             "--decoder-hidden-size", "8", "--decoder-out-embed-dim", "8"],
    "transformer": ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "8",
                    "--decoder-embed-dim", "8", "--encoder-ffn-embed-dim", "16", "--decoder-ffn-embed-dim", "16",
                    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"],
    "rnnsearch": ["--encoder-embed-dim", "8", "--decoder-embed-dim", "8", "--encoder-hidden-size", "8",
                  "--decoder-hidden-size", "8", "--attention-dim", "8", "--maxout-dim", "8"],
}


def tiny_arch(arch):
    """``--arch ARCH`` plus the tiny sizes of its family (``transformer_topk_attn`` -> ``transformer``)."""
    return ["--arch", arch, *TINY_SIZES[arch.replace("_topk_attn", "")]]
