"""GRPO group-relative advantages (numpy only: computed in the data worker, before the step).

Every rank sees the whole step's trajectories, so the advantages (a per-group statistic over
trajectories that the planner may spread over several microbatches and DP replicas) are computed once
per step from the full data, never per microbatch. Legend: N trajectories, G groups.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from harts.data.trajectory import Trajectory

__all__ = ["grpo_advantages", "with_grpo_advantages", "no_signal_reason"]


def grpo_advantages(rewards_N, group_ids_N, *, std_normalize: bool = True, eps: float = 1e-6) -> np.ndarray:
    """A_i = (r_i - mean_g r) / (std_g r + eps) over the trajectories i of group g (DeepSeekMath's
    outcome supervision). std is the unbiased sample std; a group of one trajectory has advantage 0.
    ``std_normalize=False`` only subtracts the group mean (Dr. GRPO)."""
    r = np.asarray(rewards_N, dtype=np.float64)
    g = np.asarray(group_ids_N)
    if r.shape != g.shape or r.ndim != 1:
        raise ValueError(f"rewards {r.shape} and group ids {g.shape} must be matching 1-D arrays")
    if not np.all(np.isfinite(r)):
        i = int(np.flatnonzero(~np.isfinite(r))[0])
        raise ValueError(f"trajectory {i}: reward {r[i]} is not finite")
    _, inv = np.unique(g, return_inverse=True)
    G = int(inv.max()) + 1 if inv.size else 0
    count = np.bincount(inv, minlength=G).astype(np.float64)
    mean = np.bincount(inv, weights=r, minlength=G) / np.maximum(count, 1)
    adv = r - mean[inv]
    if std_normalize:
        ss = np.bincount(inv, weights=adv * adv, minlength=G)
        std = np.sqrt(ss / np.maximum(count - 1, 1))
        adv = adv / (std[inv] + eps)
    adv[count[inv] < 2] = 0.0
    return adv


def with_grpo_advantages(trajectories, *, std_normalize: bool = True, eps: float = 1e-6) -> tuple[Trajectory, ...]:
    """Copies of the trajectories with the scalar ``advantage`` set from their ``reward`` and ``group_id``."""
    trajs = tuple(trajectories)
    for i, t in enumerate(trajs):
        if t.reward is None:
            raise ValueError(f"trajectory {i}: GRPO needs a 'reward' (none given)")
        if t.group_id is None:
            raise ValueError(f"trajectory {i}: GRPO needs a 'group_id' (none given)")
        if t.advantages is not None:
            raise ValueError(f"trajectory {i}: has per-token 'advantages' in the data and GRPO would overwrite "
                             "them; set rl.advantages = \"data\" to train on the given advantages")
    adv = grpo_advantages([t.reward for t in trajs], [t.group_id for t in trajs],
                          std_normalize=std_normalize, eps=eps)
    return tuple(dataclasses.replace(t, advantage=float(a)) for t, a in zip(trajs, adv))


def no_signal_reason(trajectories) -> str | None:
    """Why GRPO gives every trajectory of a step advantage 0, or None if some trajectory's is non-zero: groups
    of one trajectory (nothing to compare with) and groups whose rewards are all equal both give 0."""
    trajs = tuple(trajectories)
    if not trajs or any(t.advantage is None or t.advantage != 0 for t in trajs):
        return None
    rewards: dict = {}
    for t in trajs:
        rewards.setdefault(t.group_id, []).append(t.reward)
    single = sum(len(r) == 1 for r in rewards.values())
    if single == len(rewards):
        return ("its one group_id has a single trajectory" if single == 1
                else f"each of its {single} group_id values has a single trajectory")
    if single == 0:
        return f"within each of its {len(rewards)} groups (group_id) every trajectory has the same reward"
    return (f"each of its {len(rewards)} groups (group_id) has a single trajectory ({single} groups) or equal "
            "rewards (the others)")
