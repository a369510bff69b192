"""The arguments the relaxed top-k operators share -- the scores, ``k``, ``dim``, the temperature and a mask --
checked by one rule for all of them (``soft_topk``, ``softmax_k_times``, ``perturbed_topk``): each error names
the operator, the bad value and what is allowed. What only one operator takes (its scaling, method, backend,
samples) it checks itself. The scores' values follow one rule too: a NaN, or an infinity on the selected side,
is refused (only ``-inf`` -- ``+inf`` with ``largest=False`` -- marks an excluded entry); ``soft_topk``'s fused
kernels report them in their status bits, the others call :func:`check_score_values`."""
import math
from typing import List, Optional

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type the operators compute in for scores of ``dtype``: float64 for float64, float32 otherwise (float16
    and bfloat16 scores are computed in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def temperature_problems(name: str, value, dtype: torch.dtype = torch.float32) -> List[str]:
    """What is wrong with a temperature (or noise scale) called ``name`` (empty when nothing is): it must be a
    Python number, finite, > 0, and within the normal range of ``dtype``, the type it is computed in -- a
    smaller one is rounded towards 0 there (NaN outputs), a larger one overflows."""
    if isinstance(value, Tensor):  # a constant of the operators, not an input they differentiate
        return [f"{name} must be a Python float, got a Tensor"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = type(value).__qualname__ if type(value).__module__ == "builtins" else \
            f"{type(value).__module__}.{type(value).__qualname__}"
        return [f"{name} must be a Python float, got {value!r} (a {kind}: pass float(...))"]
    if not ((not isinstance(value, float) or math.isfinite(value)) and value > 0):  # (an int beyond floats: the range)
        return [f"{name} must be a finite number > 0, got {value!r}"]
    info = torch.finfo(dtype)
    if not info.tiny <= value <= info.max:
        return [f"{name}={value!r} is outside {info.dtype}'s range {info.tiny:.3g}..{info.max:.3g}, in which it is "
                "computed" + (" (float64 scores are computed in float64)" if dtype != torch.float64 else "")]
    return []


def solver_option_problems(tol, max_iter, tol_name: str = "tol", max_iter_name: str = "max_iter") -> List[str]:
    """What is wrong with the OT solver's ``tol`` and ``max_iter`` (None: the solver's defaults), one line each
    naming the option as given."""
    problems = []
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < math.inf):
        problems.append(f"{tol_name} must be a finite number >= 0 (0: up to {max_iter_name} steps, Newton stopping "
                        f"earlier at its rounding floor), got {tol!r}")
    if max_iter is not None and (isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0):
        problems.append(f"{max_iter_name} must be an int >= 0, got {max_iter!r}")
    return problems


def count_problems(name: str, value, least: int = 1) -> List[str]:
    """What is wrong with a count called ``name`` -- ``k``, a beam size, the perturbed top-k's samples -- that
    must be an int >= ``least`` (empty when nothing is)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        return [f"{name} must be an int >= {least}, got {value!r}"]
    return []


def flag_problems(**flags) -> List[str]:
    """What is wrong with true/false options such as ``sorted`` and ``largest``, named by their keywords (empty when
    nothing is): each must be a bool, as ``torch.topk`` wants -- any other value would be read one way without a
    word (``largest=None`` as False: the smallest selected)."""
    return [f"{name} must be True or False, got {value!r}" for name, value in flags.items()
            if not isinstance(value, bool)]


def check_flags(op: str, **flags) -> None:
    """Raise TypeError for :func:`flag_problems`."""
    for problem in flag_problems(**flags):
        raise TypeError(f"{op}: {problem}")


def check_scores(op: str, scores, dim) -> None:
    """Raise TypeError / ValueError unless ``scores`` is a floating-point tensor with at least one dimension and
    ``dim`` one of its dimensions."""
    if not isinstance(scores, Tensor):
        raise TypeError(f"{op}: scores must be a torch.Tensor, got {type(scores).__name__}")
    if not scores.is_floating_point():
        raise TypeError(f"{op}: scores must be a floating-point tensor, got {scores.dtype}")
    if scores.dim() == 0:
        raise ValueError(f"{op}: scores must have at least one dimension")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int, got {dim!r} (a {type(dim).__name__}: pass int(dim))")
    if not -scores.dim() <= dim < scores.dim():
        raise ValueError(f"{op}: dim={dim!r} is out of range for scores with {scores.dim()} dimension(s) "
                         f"(valid: {-scores.dim()}..{scores.dim() - 1})")


def check_selection(op: str, scores, k, dim, temperature_name: str, temperature,
                    mask: Optional[Tensor]) -> None:
    """Raise TypeError / ValueError unless the scores and ``dim`` pass :func:`check_scores`, ``k`` is an int in
    ``1..scores.shape[dim]``, the temperature (called ``temperature_name`` in the messages) passes
    :func:`temperature_problems` in the scores' :func:`compute_dtype`, and ``mask`` is None or a bool tensor on the
    scores' device that broadcasts to them."""
    check_scores(op, scores, dim)
    n = scores.shape[dim]
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{op}: k must be an int, got {k!r} (a {type(k).__name__}: pass int(k))")
    if n == 0:
        raise ValueError(f"{op}: scores have no entries along dim {dim} (shape {tuple(scores.shape)}): nothing to "
                         "select from")
    if not 1 <= k <= n:
        raise ValueError(f"{op}: k must be in 1..n = 1..{n} along dim {dim}, got k={k}")
    for problem in temperature_problems(temperature_name, temperature, compute_dtype(scores.dtype)):
        raise (TypeError if isinstance(temperature, Tensor) else ValueError)(f"{op}: {problem}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"{op}: mask must be a bool tensor (True = keep), got {got}: pass mask.bool() or a "
                            "comparison")
        if mask.device != scores.device:
            raise ValueError(f"{op}: mask is on {mask.device} but scores are on {scores.device}")
        try:
            fits = torch.broadcast_shapes(mask.shape, scores.shape) == scores.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"{op}: mask of shape {tuple(mask.shape)} does not broadcast to scores "
                             f"of shape {tuple(scores.shape)}")


class BadScoresError(ValueError):
    """Scores with a NaN, or an infinity on the selected side (:func:`check_score_values`): refused by every
    relaxed top-k operator. A ValueError; a caller that would rather behave as ``torch.softmax`` does -- NaN out
    for such a row, as fairseq's trainer expects from a float16 overflow (it skips the batch and lowers the loss
    scale) -- catches this one and no other, then calls the operator again on the rows
    :func:`bad_score_rows` does not flag."""


def bad_score_rows(scores: Tensor, dim: int = -1, largest: bool = True) -> Tensor:
    """True where a row along ``dim`` (kept as a size-1 dimension) holds a NaN or an infinity on the selected
    side: the rows a :class:`BadScoresError` is about."""
    return (torch.isnan(scores) | (scores == (torch.inf if largest else -torch.inf))).any(dim, keepdim=True)


def mask_along_last(mask: Tensor, shape: torch.Size, dim: int) -> Tensor:
    """The caller's ``mask`` broadcast to the scores' ``shape``, with ``dim`` moved last as the operators lay
    the scores out (a view: reshape it to (rows, n) as needed)."""
    return mask.expand(shape).movedim(dim, -1)


def nan_scores(op: str) -> str:
    """The error message for NaN scores: no mask admits one, so the fix is upstream (or the caller's own NaN rows)."""
    return (f"{op}: scores contain NaN (refused even where masked: a NaN means the scores' source broke, e.g. a "
            f"float16 overflow; ops.bad_score_rows(scores) finds the rows, to leave out or NaN)")


def selected_infinity(op: str) -> str:
    """The error message for an infinity on the selected side: only ``-inf`` (``+inf`` with ``largest=False``)
    marks an excluded entry."""
    return (f"{op}: scores contain an infinity on the selected side (+inf with largest=True, -inf with "
            f"largest=False); use mask=False to exclude")


def check_score_values(op: str, scores: Tensor, largest: bool = True, mask: Optional[Tensor] = None) -> None:
    """Raise :class:`BadScoresError` if ``scores`` hold a NaN (anywhere: a masked NaN still means a broken model) or an
    infinity on the selected side where ``mask`` (broadcast to the scores) keeps the entry -- as the error says,
    ``mask=False`` excludes it. One synchronisation when the scores are fine."""
    selected_inf = scores == (torch.inf if largest else -torch.inf)
    if mask is not None:
        selected_inf = selected_inf & mask
    if bool((torch.isnan(scores) | selected_inf).any()):
        raise BadScoresError(nan_scores(op) if bool(torch.isnan(scores).any()) else selected_infinity(op))
