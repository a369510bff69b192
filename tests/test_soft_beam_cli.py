"""``--criterion soft_beam_search`` and ``--arch rnnsearch`` through fairseq's real command lines."""
import re
import signal
import socket
import subprocess

import pytest

from fairseq_cli import USER_DIR, fairseq, fairseq_cmd, tiny_arch

ARCH_ARGS = {arch: tiny_arch(arch) for arch in ("rnnsearch", "lstm", "transformer")}
SOFT_BEAM = ["--criterion", "soft_beam_search", "--label-smoothing", "0.1", "--teacher-forcing-ratio", "0.5",
             "--soft-beam-size", "3", "--soft-beam-candidates", "20"]


@pytest.fixture
def data_bin(toy_data_bin):
    return toy_data_bin


def train_args(data_bin, save_dir, arch, max_update, *extra):
    return [data_bin, "--user-dir", USER_DIR, "--cpu", "--seed", "3", *ARCH_ARGS[arch], "--optimizer", "adam",
            "--lr", "0.005", *SOFT_BEAM, "--max-tokens", "400", "--max-update", str(max_update),
            "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "1",
            "--num-workers", "0", "--required-batch-size-multiple", "1", *extra]


def losses(log):
    return re.findall(r"train_inner \| epoch \d+: +\d+ / \d+ (loss=[^,]+, nll_loss=[^,]+, tf_loss=[^,]+, "
                      r"soft_loss=[^,]+)", log)


# RNNsearch (the paper's model) in the default run; the LSTM and the transformer, whose criterion updates the
# golden cases check, with the slow tests.
@pytest.mark.parametrize("arch", [a if a == "rnnsearch" else pytest.param(a, marks=pytest.mark.slow)
                                  for a in sorted(ARCH_ARGS)])
def test_train_resume_generate(data_bin, tmp_path, arch):
    save = tmp_path / "ckpt"
    log = fairseq("train", *train_args(data_bin, save, arch, 2)).stdout
    assert len(losses(log)) == 2, log[-3000:]
    for key in ("soft_topk_iters=", "soft_topk_err=", "pruned_mass="):
        assert key in log
    log = fairseq("train", *train_args(data_bin, save, arch, 4)).stdout
    assert re.search(r"[Ll]oaded checkpoint .*checkpoint_last\.pt .*\(epoch \d+ @ 2 updates\)", log), log[-3000:]
    assert re.search(r"num_updates 4\b", log), log[-3000:]
    out = fairseq("generate", data_bin, "--user-dir", USER_DIR, "--cpu", "--path", save / "checkpoint_last.pt",
                  "--gen-subset", "test", "--beam", "3", "--batch-size", "5", "--max-len-b", "20",
                  "--required-batch-size-multiple", "1").stdout
    assert sorted(map(int, re.findall(r"^H-(\d+)\t", out, flags=re.M))) == list(range(12)), out[-3000:]


def test_perturbed_relaxation_trains_from_the_command_line(data_bin, tmp_path):
    """--soft-beam-relaxation perturbed with its flags: trains, logs L_SOFT and the pruned-mass bound, and the same
    seed gives the same losses (the noise comes from fairseq's seeded generator) -- also when the flags are given
    by their 0.1 names, which mean the same (with a warning)."""
    new = ["--soft-beam-relaxation", "perturbed", "--soft-beam-epsilon", "0.2", "--soft-beam-samples", "4"]
    old = ["--soft-topk-method", "perturbed", "--perturbed-sigma", "0.2", "--perturbed-samples", "4",
           "--soft-topk-epsilon", "0.7"]  # (0.1 used --perturbed-sigma for this relaxation, not this one)
    logs = [fairseq("train", *train_args(data_bin, tmp_path / f"p{i}", "lstm", 2, *extra)).stdout
            for i, extra in enumerate((new, old))]
    assert len(losses(logs[0])) == 2 and losses(logs[0]) == losses(logs[1]), logs[0][-3000:]
    assert "pruned_mass=" in logs[0] and "soft_beam_relaxation='perturbed'" in logs[0]
    assert "--perturbed-sigma is the old name of --soft-beam-epsilon" in logs[1]


def test_teacher_forcing_in_the_search_trains_from_the_command_line(data_bin, tmp_path):
    """--teacher-forcing-pass search (auto's choice on a GPU) on CPU: trains with both losses logged, and the same
    seed gives the same losses."""
    extra = ["--teacher-forcing-pass", "search"]
    logs = [fairseq("train", *train_args(data_bin, tmp_path / f"s{i}", "transformer", 2, *extra)).stdout
            for i in range(2)]
    assert len(losses(logs[0])) == 2 and losses(logs[0]) == losses(logs[1]), logs[0][-3000:]
    assert "teacher_forcing_pass='search'" in logs[0]


def test_update_freq_and_seed_reproduce(data_bin, tmp_path):
    """Same seed -> identical losses; --update-freq 2 accumulates two --max-tokens batches per update."""
    runs = [fairseq("train", *train_args(data_bin, tmp_path / f"r{i}", "lstm", 3, "--update-freq", "2")).stdout
            for i in range(2)]
    assert losses(runs[0]) == losses(runs[1]) and len(losses(runs[0])) == 3
    single = fairseq("train", *train_args(data_bin, tmp_path / "single", "lstm", 3)).stdout
    bsz = lambda log: [int(b) for b in re.findall(r"train_inner .* bsz=(\d+)", log)]  # noqa: E731
    assert sum(bsz(runs[0])) > sum(bsz(single))  # two batches per update


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# PyTorch: a gloo process group that is not destroyed before exit (fairseq-train never destroys it) can abort
# in gloo's worker threads during interpreter finalisation (pytorch/pytorch#179291), after all the work is done.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def exited_cleanly(proc, log):
    """Exit 0, or the gloo teardown abort above as the process's very last words (SIGABRT)."""
    return proc.returncode == 0 or (proc.returncode == -signal.SIGABRT
                                    and log.rstrip().endswith(GLOO_TEARDOWN_ABORT))


def test_distributed_two_cpu_workers(data_bin, tmp_path):
    """fairseq's own distributed training, two gloo workers on CPU, launched by hand (torchrun and fairseq's
    spawn assume CUDA); legacy_ddp because c10d DDP wants a GPU."""
    port = free_port()
    procs = [subprocess.Popen(
        [*fairseq_cmd("train"), *map(str, train_args(data_bin, tmp_path / "ckpt", "lstm", 3)),
         "--distributed-world-size", "2", "--distributed-rank", str(rank),
         "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn",
         "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(map(exited_cleanly, procs, logs)), logs[0][-3000:] + logs[1][-3000:]
    # the master finished training, so the other rank took part in every update's all-reduce
    assert "done training in" in logs[0] and "distributed init (rank 1)" in "".join(logs)
    assert len(losses(logs[0])) == 3 and re.search(r"num_updates 3\b", logs[0])
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").exists()
