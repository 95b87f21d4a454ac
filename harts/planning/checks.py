"""Argument and invariant checks shared by every planner (numpy only).

Public inputs are checked the same way in every entry point: an integer parameter must be a Python or numpy
integer (a float such as 16.7 or 16.0, a string "16" or a bool is a TypeError, never silently converted) and
at least its minimum (ValueError). Invariant checks (``validate()`` of plans and layouts) raise ValueError
naming the first offending item and its values; they are ordinary code, so ``python -O`` keeps them.
"""
from __future__ import annotations

import numpy as np


def integer_arg(value, name: str, *, where: str, minimum: int = 1, error: type[ValueError] = ValueError) -> int:
    """``value`` as a Python int; TypeError unless it is an int or numpy integer (not bool), ``error`` below
    ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be an integer, got {value!r} ({type(value).__name__})")
    v = int(value)
    if v < minimum:
        raise error(f"{where}: {name} must be >= {minimum}, got {v}")
    return v


def require(ok, message) -> None:
    """ValueError(message) unless ``ok``; ``message`` may be a callable, evaluated only on failure."""
    if not ok:
        raise ValueError(message() if callable(message) else message)


def require_all(ok, describe) -> None:
    """ValueError naming the first False entry of ``ok``: ``describe(i)`` says what is wrong with item i."""
    ok = np.asarray(ok, dtype=bool)
    bad = np.flatnonzero(~ok.ravel())
    if bad.shape[0]:
        i = int(bad[0]) if ok.ndim <= 1 else tuple(int(x) for x in np.unravel_index(int(bad[0]), ok.shape))
        more = f" ({bad.shape[0]} items fail this check)" if bad.shape[0] > 1 else ""
        raise ValueError(describe(i) + more)


def require_shape(arr, shape: tuple, name: str) -> None:
    got = tuple(np.shape(arr))
    if got != tuple(shape):
        raise ValueError(f"{name}: shape {got}, expected {tuple(shape)}")


def require_equal(got, want, name: str, item: str = "item") -> None:
    """ValueError unless the arrays are equal: names ``item`` i, the first differing entry, with both values."""
    got, want = np.asarray(got), np.asarray(want)
    require_shape(got, want.shape, name)
    diff = got != want
    if diff.any():
        require_all(~diff, lambda i: f"{name} of {item} {i} is {_at(got, i)}, expected {_at(want, i)}")


def _at(arr: np.ndarray, i) -> object:
    x = arr[i]
    return x.item() if hasattr(x, "item") else x
