"""``--lr-scheduler reduce_lr_on_plateau_resumable``: a run continued from its checkpoint takes the same learning
rates and stops at the same epoch as one that never stopped -- where fairseq's ``reduce_lr_on_plateau`` does not."""
import argparse
import math
import re

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.optim.lr_scheduler.reduce_lr_on_plateau import (
    ReduceLROnPlateauLRSchedule,
    ReduceLROnPlateauLRScheduleConfig,
)
from fairseq.optim.sgd import SGD

import softtopk_fairseq.fairseq_plugin  # noqa: F401
from softtopk_fairseq.lr_schedulers.resumable_plateau import (
    ResumableReduceLROnPlateau,
    ResumableReduceLROnPlateauConfig,
    validated_at_end_of,
)

from fairseq_cli import USER_DIR, fairseq, tiny_arch  # the tests' helper module, which shadows fairseq's package


def _load_fairseq_train():
    """fairseq's own ``fairseq_cli/train.py`` (its package name is taken by the helper module here), registered
    under its name, as the scheduler finds it inside fairseq-train."""
    import importlib.util
    import os
    import sys

    import fairseq

    path = os.path.join(os.path.dirname(os.path.dirname(fairseq.__file__)), "fairseq_cli", "train.py")
    spec = importlib.util.spec_from_file_location("fairseq_cli.train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["fairseq_cli.train"] = module
    return module


fairseq_train = _load_fairseq_train()

# Validation BLEU per epoch: gains, a tie, plateaus long enough to halve the rate three times, a late gain.
SCORES = [20.0, 25.0, 24.0, 23.0, 26.0, 26.0, 25.5, 27.0, 26.0, 25.0, 24.0, 23.0, 22.0]
PATIENCE = 4  # --patience: stop after 4 validations without a gain


def _reset_fairseq_globals():
    for fn, names in ((fairseq_train.should_stop_early, ("best", "num_runs")),
                      (checkpoint_utils.save_checkpoint, ("best",))):
        for name in names:
            if hasattr(fn, name):
                delattr(fn, name)


@pytest.fixture(autouse=True)
def fresh_process_state():
    _reset_fairseq_globals()
    yield
    _reset_fairseq_globals()


UPDATES_PER_EPOCH = 10


def _build(scheduler_class, validate_interval=1):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = SGD(argparse.Namespace(lr=[1.0], momentum=0.0, weight_decay=0.0), [param])
    cfg = ResumableReduceLROnPlateauConfig(lr=[1.0], lr_shrink=0.5, lr_patience=1,
                                           maximize_best_checkpoint_metric=True, validate_interval=validate_interval,
                                           validate_interval_updates=0, validate_after_updates=0,
                                           disable_validation=False)
    return optimizer, scheduler_class(cfg, optimizer)


def _run(scheduler_class, stop_after=None, validate_interval=1):
    """fairseq-train's end-of-epoch sequence (validate every ``validate_interval`` epochs, early-stopping check,
    save, then the plateau step), with a restart from the checkpoint of epoch ``stop_after`` as a new process
    would load it: (learning rate after each epoch's step, the epoch training stopped at)."""
    stop_cfg = argparse.Namespace(checkpoint=argparse.Namespace(patience=PATIENCE,
                                                                maximize_best_checkpoint_metric=True))
    optimizer, scheduler = _build(scheduler_class, validate_interval)
    rates = []
    for epoch, score in enumerate(SCORES, start=1):
        scheduler.step_update(epoch * UPDATES_PER_EPOCH)
        if epoch % validate_interval:
            score = None  # not validated: fairseq steps the scheduler without a score
        should_stop = fairseq_train.should_stop_early(stop_cfg, score)
        if score is not None:
            best = max(score, getattr(checkpoint_utils.save_checkpoint, "best", -math.inf))
            checkpoint_utils.save_checkpoint.best = best
        checkpoint = {"scheduler": scheduler.state_dict(), "optimizer": optimizer.state_dict(),
                      "best": getattr(checkpoint_utils.save_checkpoint, "best", None)}
        if should_stop:
            return rates, epoch
        if epoch == stop_after:  # the process ends here; a new one continues from the checkpoint
            _reset_fairseq_globals()
            if checkpoint["best"] is not None:
                checkpoint_utils.save_checkpoint.best = checkpoint["best"]
            optimizer, scheduler = _build(scheduler_class, validate_interval)
            scheduler.load_state_dict(checkpoint["scheduler"])   # trainer.load_checkpoint's order
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.step_update(epoch * UPDATES_PER_EPOCH)     # trainer.set_num_updates
            scheduler.step(epoch + 1)                            # trainer.load_checkpoint
            scheduler.step(epoch + 1)                            # checkpoint_utils.load_checkpoint
        else:
            scheduler.step(epoch, score)
        rates.append(optimizer.get_lr())
    return rates, None


def test_a_continued_run_takes_the_same_rates_and_stops_at_the_same_epoch():
    uninterrupted = _run(ResumableReduceLROnPlateau)
    # halved after every second epoch without a gain (4, 7, 10), stopped after 4 validations without one (12)
    assert uninterrupted == ([1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125], 12)
    for stop_after in range(1, len(SCORES)):
        _reset_fairseq_globals()
        assert _run(ResumableReduceLROnPlateau, stop_after) == uninterrupted, stop_after


def test_a_continued_run_validated_every_second_epoch_takes_the_same_rates():
    """With ``--validate-interval 2`` the checkpoint of an epoch without validation is not behind the plateau:
    nothing is replayed there (a replay would count an epoch without a gain that never was)."""
    uninterrupted = _run(ResumableReduceLROnPlateau, validate_interval=2)
    assert len(set(uninterrupted[0])) >= 2, uninterrupted  # the rate did move
    for stop_after in range(1, len(SCORES)):
        _reset_fairseq_globals()
        assert _run(ResumableReduceLROnPlateau, stop_after, validate_interval=2) == uninterrupted, stop_after


def test_validated_at_end_of_follows_fairseq_trains_rule():
    cfg = ResumableReduceLROnPlateauConfig(validate_interval=3, validate_interval_updates=0, validate_after_updates=50,
                                           disable_validation=False)
    assert [e for e in range(1, 10) if validated_at_end_of(e, 10 * e, cfg)] == [6, 9]
    cfg.validate_interval_updates = 20  # an epoch ending at a multiple of it validates too
    assert [e for e in range(1, 10) if validated_at_end_of(e, 10 * e, cfg)] == [6, 8, 9]
    cfg.disable_validation = True
    assert not any(validated_at_end_of(e, 10 * e, cfg) for e in range(1, 10))
    # without the flags (the scheduler built from the base config): every epoch
    assert validated_at_end_of(1, 0, ReduceLROnPlateauLRScheduleConfig())


def test_fairseqs_own_plateau_schedule_drifts_when_continued():
    """The control: fairseq's reduce_lr_on_plateau, continued from its checkpoint, differs (rates or stop)."""
    uninterrupted = _run(ReduceLROnPlateauLRSchedule)
    drifted = []
    for stop_after in range(1, len(SCORES)):
        _reset_fairseq_globals()
        drifted.append(_run(ReduceLROnPlateauLRSchedule, stop_after) != uninterrupted)
    assert sum(drifted) >= len(SCORES) // 2


def test_fairseq_train_continued_matches_uninterrupted(toy_data_bin, tmp_path):
    """Through fairseq-train itself: 5 epochs in one go against 2 + 3 from checkpoint_last.pt, with a plateau rule
    that halves the rate after every epoch without a 50 % gain: the same rates (fairseq's own schedule would skip
    the halving of epoch 2 after the restart) and validation losses. ``--update-epoch-batch-itr``: fairseq
    composes the batches with the seed plus the epoch its batch iterator is built at, and an uninterrupted run
    reuses epoch 1's -- a continued one would build new ones (same sizes, other sentences)."""
    def train(save, max_epoch):
        return fairseq("train", toy_data_bin, "--user-dir", USER_DIR, "--cpu", "--seed", "1",
                       *tiny_arch("transformer"), "--dropout", "0", "--optimizer", "adam", "--lr", "0.01",
                       "--lr-scheduler", "reduce_lr_on_plateau_resumable", "--lr-shrink", "0.5", "--lr-patience", "0",
                       "--lr-threshold", "0.5", "--patience", "3", "--criterion", "cross_entropy",
                       "--max-tokens", "400", "--max-epoch", str(max_epoch), "--save-dir", save,
                       "--no-epoch-checkpoints", "--log-format", "simple", "--num-workers", "0",
                       "--required-batch-size-multiple", "1", "--update-epoch-batch-itr", "True").stdout

    def epochs(log):
        valid = re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)
        rates = re.findall(r"\| train \|.* lr ([0-9.e-]+)", log)
        return list(zip(valid, rates))

    once = epochs(train(tmp_path / "once", 5))
    first = epochs(train(tmp_path / "split", 2))
    rest = train(tmp_path / "split", 5)
    assert re.search(r"[Ll]oaded checkpoint .*checkpoint_last\.pt", rest), rest[-3000:]
    assert len(once) == 5 and len({rate for _, rate in once}) >= 3, once  # the rate did move
    assert first + epochs(rest) == once


def test_fairseq_train_continued_keeps_the_early_stopping_count(toy_data_bin, tmp_path):
    """``--patience`` through fairseq-train run as ``python -m fairseq_cli.train`` (how this package runs it, and
    where fairseq-train is ``__main__``, not ``fairseq_cli.train``): at learning rate 0 the val loss never improves
    after epoch 1, so patience 2 stops at epoch 3 -- and so does a run stopped after epoch 2 and continued, whose
    early-stopping count would otherwise start again from zero (stopping at epoch 5)."""
    def train(save, max_epoch):
        return fairseq("train", toy_data_bin, "--user-dir", USER_DIR, "--cpu", "--seed", "1",
                       *tiny_arch("transformer"), "--dropout", "0", "--optimizer", "adam", "--lr", "0",
                       "--lr-scheduler", "reduce_lr_on_plateau_resumable", "--patience", "2",
                       "--criterion", "cross_entropy", "--max-tokens", "400", "--max-epoch", str(max_epoch),
                       "--save-dir", save, "--no-epoch-checkpoints", "--log-format", "simple", "--num-workers", "0",
                       "--required-batch-size-multiple", "1").stdout

    def validated(log):
        return [int(e) for e in re.findall(r"epoch (\d+) \| valid on 'valid' subset", log)]

    once = train(tmp_path / "once", 10)
    assert validated(once) == [1, 2, 3] and "early stop" in once, once[-3000:]
    assert validated(train(tmp_path / "split", 2)) == [1, 2]
    rest = train(tmp_path / "split", 10)
    assert re.search(r"[Ll]oaded checkpoint .*checkpoint_last\.pt", rest), rest[-3000:]
    assert validated(rest) == [3] and "early stop" in rest, rest[-3000:]
