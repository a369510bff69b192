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


def control_rates(rows: Dict[str, dict]) -> Dict[int, Dict[float, float]]:
    """seed -> {learning rate: val BLEU} of the control's fine-tunings to convergence in the ledger ``rows``."""
    tried: Dict[int, Dict[float, float]] = {}
    for row in rows.values():
        if row["stage"] == "tune" and row["method"] == TUNE_CONTROL:
            tried.setdefault(row["seed"], {})[row["lr"]] = row["bleu"]["valid"]
    return tried


def rate_seed(rows: Dict[str, dict], default: Optional[int]) -> Optional[int]:
    """The seed the learning rate is chosen on: once the ledger ``rows`` hold a control run at several rates, the
    seed whose control ran at the most (whatever seeds a later invocation names first); before, ``default``."""
    tried = {seed: rates for seed, rates in control_rates(rows).items() if len(rates) > 1}
    return max(tried, key=lambda s: len(tried[s]), default=default)

