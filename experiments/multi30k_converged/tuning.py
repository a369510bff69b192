"""The fine-tunings to convergence (the converged study's stage ``tune``): their control, their ledger keys and the
rule that chooses their learning rate -- read by the driver, which runs them, and by the report, which reads the
ledger they fill."""
from typing import Dict, List, Optional

TUNE_CONTROL = "tf"  # continued teacher forcing


def tune_key(name: str, lr: float, seed: int) -> str:
    """The ledger key of a fine-tuning to convergence (stage ``tune``) of ``name`` at learning rate ``lr``."""
    return f"tune.{name}.lr{lr:g}.seed{seed}"


def tune_lr_choice(rows: Dict[str, dict], lrs: List[float], seed: int) -> Optional[float]:
    """The learning rate of the fine-tunings to convergence: among ``lrs``, the one at which the control
    (continued teacher forcing) of ``seed`` reached the highest val BLEU (the earlier in ``lrs`` on a tie) -- chosen
    on the control alone, so that no soft beam-search result takes part in it; None until the control has run at
    every rate."""
    val = {lr: rows[tune_key(TUNE_CONTROL, lr, seed)]["bleu"]["valid"] for lr in lrs
           if tune_key(TUNE_CONTROL, lr, seed) in rows}
    if len(val) < len(lrs):
        return None
    return max(lrs, key=lambda lr: (val[lr], -lrs.index(lr)))
