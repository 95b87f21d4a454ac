"""DP-replica assignment, slot schedule and the objective J (paper 3.2, Eq. 4) plus the Eq. 23 imbalance.

A schedule is ``slots``: a [K/D, D] int array, slots[j, d] = microbatch executed by replica d in slot j.
"""
from __future__ import annotations

import numpy as np


def assign_slots(work: np.ndarray, dp: int) -> np.ndarray:
    """Sort microbatches by work (heaviest first, then lowest id), cut consecutive blocks of D into slots,
    and inside a slot hand heavier microbatches to replicas with less cumulative work so far (ties: lower
    replica). K must be a multiple of D."""
    k = work.shape[0]
    if k % dp:
        raise ValueError(f"assign_slots: K = {k} is not a multiple of D = {dp}")
    order = np.lexsort((np.arange(k), -work)).tolist()
    w = work.tolist()
    slots = [[0] * dp for _ in range(k // dp)]
    load = [0] * dp
    for j in range(k // dp):
        block = order[j * dp : (j + 1) * dp]  # already heaviest first
        replicas = sorted(range(dp), key=load.__getitem__)  # lightest first; stable: lower replica on ties
        row = slots[j]
        for r, m in zip(replicas, block):
            row[r] = m
            load[r] += w[m]
    return np.asarray(slots, dtype=np.int64).reshape(k // dp, dp)


def objective(work: np.ndarray, slots: np.ndarray) -> tuple[int, int, int]:
    """J = (total work, sum over slots of the heaviest microbatch, heaviest replica total)."""
    w = work[slots]
    return int(work.sum()), int(w.max(axis=1).sum()), int(w.sum(axis=0).max())


def imbalance(w_d: np.ndarray) -> float:
    """Eq. 23: I = max_d w_d / mean_d w_d - 1 (0 for an all-zero observation)."""
    w_d = np.asarray(w_d, dtype=np.float64)
    mean = w_d.mean()
    return float(w_d.max() / mean - 1.0) if mean > 0 else 0.0


def slot_imbalances(work: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Within-slot imbalance of every slot (one observation per slot)."""
    w = work[slots].astype(np.float64)
    mean = w.mean(axis=1)
    return np.where(mean > 0, w.max(axis=1) / np.where(mean > 0, mean, 1.0) - 1.0, 0.0)


def step_imbalance(work: np.ndarray, slots: np.ndarray) -> float:
    """Current-step-total imbalance over replica totals."""
    return imbalance(work[slots].sum(axis=0))
