"""``--lr-scheduler reduce_lr_on_plateau_resumable``: fairseq's ``reduce_lr_on_plateau`` whose checkpoint holds
everything a continued run needs to take the same steps as one that never stopped.

fairseq 0.12 loses three things when a run with ``reduce_lr_on_plateau`` and ``--patience`` continues from
``checkpoint_last.pt``:

* the plateau's count of epochs without a gain (torch's ``num_bad_epochs``, ``cooldown_counter``): only its
  best value and epoch are saved, so after a restart the rate halves later than it would have;
* the plateau step of the epoch the checkpoint closes: at the end of epoch ``e`` fairseq validates, saves, and
  only then steps the scheduler with epoch ``e``'s score, so the saved state is one step behind and the resumed
  run never takes that step;
* the early-stopping count of ``--patience`` (``fairseq_cli.train.should_stop_early``'s ``best`` and
  ``num_runs``), kept only in the process: a continued run counts from zero again and takes its first
  validation as the best so far.

This scheduler saves the first and third, and replays the second when the run continues (at fairseq's first
``step(epoch)`` after loading, once the optimizer state is back). The missing score itself is not in the
scheduler's reach, but its effect on the plateau is: it is a gain exactly when it raised fairseq's best score
(``checkpoint_utils.save_checkpoint.best``, saved in the checkpoint) -- then the plateau steps with that best --
and otherwise it is no better than a score already seen, which the plateau counts as an epoch without a gain
whatever its value. Nothing is replayed when that epoch was not validated (``--validate-interval``,
``--validate-after-updates``, ``--disable-validation``: fairseq's rule, from the flags), as the plateau took no
step there either. Exact when every score comes at an epoch's end (with ``--validate-interval-updates`` a
mid-epoch score can raise the best instead).
"""
import math
import sys
from dataclasses import dataclass

from omegaconf import II

from fairseq import checkpoint_utils
from fairseq.optim.lr_scheduler import register_lr_scheduler
from fairseq.optim.lr_scheduler.reduce_lr_on_plateau import (
    ReduceLROnPlateauLRSchedule,
    ReduceLROnPlateauLRScheduleConfig,
)

# torch's ReduceLROnPlateau counters that fairseq does not save.
PLATEAU_COUNTERS = ("num_bad_epochs", "cooldown_counter")


def _early_stopping():
    """fairseq-train's early-stopping function (its state lives in its attributes), or None outside
    fairseq-train. Run as ``python -m fairseq_cli.train`` (as this package's tools run it), fairseq-train is the
    module ``__main__`` and ``fairseq_cli.train`` is not imported at all; run as the ``fairseq-train`` script
    (or by ``fairseq-hydra-train``), it is ``fairseq_cli.train``."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "fairseq_cli.train":
        return getattr(main, "should_stop_early", None)
    return getattr(sys.modules.get("fairseq_cli.train"), "should_stop_early", None)


def _best_score():
    return getattr(checkpoint_utils.save_checkpoint, "best", None)


@dataclass
class ResumableReduceLROnPlateauConfig(ReduceLROnPlateauLRScheduleConfig):
    # when fairseq-train validates at an epoch's end (read, not set, here)
    validate_interval: int = II("dataset.validate_interval")
    validate_interval_updates: int = II("dataset.validate_interval_updates")
    validate_after_updates: int = II("dataset.validate_after_updates")
    disable_validation: bool = II("dataset.disable_validation")


def validated_at_end_of(epoch: int, num_updates: int, cfg) -> bool:
    """Whether fairseq-train 0.12 validated at the end of ``epoch`` (``validate_and_save``'s rule; a run that
    stopped there is not continued), from the flags in ``cfg`` -- every epoch where it does not have them."""
    def flag(name, default):
        value = getattr(cfg, name, default)
        return default if isinstance(value, str) else value  # (an unresolved interpolation: not in fairseq-train)

    every, updates = flag("validate_interval", 1), flag("validate_interval_updates", 0)
    due = epoch % every == 0 or (updates > 0 and num_updates > 0 and num_updates % updates == 0)
    return due and not flag("disable_validation", False) and num_updates >= flag("validate_after_updates", 0)


@register_lr_scheduler("reduce_lr_on_plateau_resumable", dataclass=ResumableReduceLROnPlateauConfig)
class ResumableReduceLROnPlateau(ReduceLROnPlateauLRSchedule):
    def __init__(self, cfg, optimizer):
        super().__init__(cfg, optimizer)
        self.num_updates = 0        # as fairseq's trainer last set it (restored before the replay)
        self.scored_epoch = 0       # the last epoch whose score the plateau has stepped with
        self.best_when_scored = None  # fairseq's best score at that step
        self.pending = False        # set by load_state_dict: the checkpoint may be one plateau step behind
        self.saved_best = None      # fairseq's best score when that checkpoint was saved

    def state_dict(self):
        state = super().state_dict()
        state.update({name: getattr(self.lr_scheduler, name) for name in PLATEAU_COUNTERS})
        state.update(scored_epoch=self.scored_epoch, best_when_scored=self.best_when_scored, best_score=_best_score())
        stop = _early_stopping()
        if stop is not None and hasattr(stop, "num_runs"):
            state["early_stopping"] = {"best": stop.best, "num_runs": stop.num_runs}
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for name in PLATEAU_COUNTERS:
            if name in state_dict:
                setattr(self.lr_scheduler, name, state_dict[name])
        self.scored_epoch = state_dict.get("scored_epoch", 0)
        self.best_when_scored = state_dict.get("best_when_scored")
        self.pending, self.saved_best = True, state_dict.get("best_score")
        stop = _early_stopping()
        if stop is not None and "early_stopping" in state_dict:
            stop.best = state_dict["early_stopping"]["best"]
            stop.num_runs = state_dict["early_stopping"]["num_runs"]

    def step(self, epoch, val_loss=None):
        if val_loss is not None:
            self.scored_epoch = epoch
            self.best_when_scored = _best_score()
        elif self.pending:
            self.pending = False
            # Saved at the end of epoch epoch - 1 (fairseq continues with the next one) before that epoch's step.
            if (self.scored_epoch < epoch - 1 and self.warmup_end and self.saved_best is not None
                    and validated_at_end_of(epoch - 1, self.num_updates, self.cfg)):
                raised = self.best_when_scored is None or self.saved_best != self.best_when_scored
                worst = -math.inf if self.lr_scheduler.mode == "max" else math.inf
                super().step(epoch - 1, self.saved_best if raised else worst)
                self.scored_epoch = epoch - 1
                self.best_when_scored = self.saved_best
        return super().step(epoch, val_loss)

    def step_update(self, num_updates):
        self.num_updates = num_updates
        return super().step_update(num_updates)
