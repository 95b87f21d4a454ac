"""Policy objectives on per-position log-probs, normalised so a step's gradient ignores its split.

A step's loss is a sum over predicted positions s of c_s * l_s, where l_s is the per-token objective
and c_s a coefficient fixed *before* the step from the whole step's metadata (every rank reads the same
step, so no communication is needed):

- ``token``:    c_s = m_s / M,             M = sum of loss weights m over the whole step;
- ``sequence``: c_s = m_s / (M_i * N),     M_i = trajectory i's weight sum, N = trajectories with M_i > 0.

Each microbatch contributes sum_{s in mb} c_s l_s; the step's loss (and gradient) is the plain sum over
microbatches and DP ranks, so it is the same for any grouping of trajectories into microbatches and
replicas, and for the trajectory-wise baseline (same positions, same metadata). A per-microbatch mean
would weight small microbatches more and depend on the planner: that is what this avoids.

The MoE router terms are treated the same way: a layer's z-loss of microbatch b is a weighted mean over
its rows with multiplicities q (``RouterStats``); multiplied by W_b / W (W_b = sum of q in b = its raw
tokens, W = the step's raw tokens) it becomes a step-level token mean. The balance loss sum_E f_E P_E
(DeepSeek-V3's f and P) has a detached factor f computed from expert counts; with f from the current
microbatch it would change with the split, so the trainer uses f from the *previous step's* global,
multiplicity-weighted counts (uniform before the first step) and P_b weighted by W_b / W, which makes
the whole term linear in the microbatches (``harts.models.ling.blocks.router_term``).

Legend: S predicted (nonterminal) positions of a microbatch, N trajectories.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LossConfig", "StepNormalizer", "step_normalizer", "microbatch_coefficients", "token_losses",
           "aux_scale"]


@dataclass(frozen=True)
class LossConfig:
    objective: str = "grpo"  # "grpo": -A * logp (on-policy) | "ppo": clipped ratio against old log-probs
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # asymmetric upper clip (DAPO); None = clip_eps
    kl_coef: float = 0.0  # k3 estimator of KL(pi || ref) per token, needs ref_logprobs
    normalization: str = "token"  # "token" | "sequence"

    def __post_init__(self):
        if self.objective not in ("grpo", "ppo"):
            raise ValueError(f"rl.objective={self.objective!r}: expected 'grpo' or 'ppo'")
        if self.normalization not in ("token", "sequence"):
            raise ValueError(f"rl.loss_norm={self.normalization!r}: expected 'token' or 'sequence'")
        if not self.clip_eps > 0 or (self.clip_eps_high is not None and not self.clip_eps_high > 0):
            raise ValueError("rl.clip_eps (and clip_eps_high) must be > 0")
        if self.kl_coef < 0:
            raise ValueError(f"rl.kl_coef={self.kl_coef} must be >= 0")


@dataclass(frozen=True)
class StepNormalizer:
    loss_weight: float  # M: sum of loss weights over every predicted position of the step
    trajectories: int  # N: trajectories with a positive loss weight
    raw_tokens: int  # W: raw tokens of the step (the MoE statistics' multiplicity sum)


def _weights(t) -> np.ndarray:
    """Loss weight of each predicted position (tokens 1..L-1): loss_mask * loss_weights, default 1."""
    w = np.ones(len(t) - 1, dtype=np.float64)
    if t.loss_mask is not None:
        w = w * t.loss_mask[1:]
    if t.loss_weights is not None:
        w = w * t.loss_weights[1:]
    return w


def step_normalizer(trajectories) -> StepNormalizer:
    ws = [_weights(t) for t in trajectories]
    sums = np.array([w.sum() for w in ws], dtype=np.float64)
    if not (sums > 0).any():
        raise ValueError("the step has no loss tokens (every loss_mask / loss_weights entry is 0)")
    return StepNormalizer(float(sums.sum()), int((sums > 0).sum()), int(sum(len(t) for t in trajectories)))


def microbatch_coefficients(trajectories, norm: StepNormalizer, mode: str = "token") -> np.ndarray:
    """c_s for the microbatch's predicted positions, in ``CompactBatch.logprob_rows`` order."""
    parts = []
    for t in trajectories:
        w = _weights(t)
        if mode == "token":
            parts.append(w / norm.loss_weight)
        elif mode == "sequence":
            m = w.sum()
            parts.append(w / (m * norm.trajectories) if m > 0 else w)
        else:
            raise ValueError(f"unknown loss normalisation {mode!r}")
    return np.concatenate(parts) if parts else np.zeros(0)


def aux_scale(raw_tokens_in_microbatch, norm: StepNormalizer) -> float:
    """W_b / W: turns a microbatch's multiplicity-weighted router mean into its share of the step mean."""
    return float(raw_tokens_in_microbatch) / norm.raw_tokens


def token_losses(logp_S: torch.Tensor, adv_S: torch.Tensor, cfg: LossConfig, *,
                 old_logp_S: torch.Tensor | None = None, ref_logp_S: torch.Tensor | None = None):
    """Per-position objective l_s (to be minimised) and its parts: (loss_S, pg_S, kl_S, clipped_S).

    grpo: l = -A logp (the on-policy policy gradient; its value is not a probability ratio).
    ppo:  r = exp(logp - old); l = -min(r A, clip(r, 1 - eps, 1 + eps_high) A).
    KL:   + kl_coef * (exp(ref - logp) - (ref - logp) - 1)  (k3, unbiased and >= 0).
    """
    adv_S = adv_S.to(logp_S.dtype)
    clipped = torch.zeros_like(logp_S)
    if cfg.objective == "grpo":
        pg = -adv_S * logp_S
    else:
        if old_logp_S is None:
            raise ValueError("rl.objective='ppo' needs old log-probs")
        ratio = torch.exp(logp_S - old_logp_S.to(logp_S.dtype))
        hi = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        unclipped, clip = ratio * adv_S, ratio.clamp(1.0 - cfg.clip_eps, 1.0 + hi) * adv_S
        pg = -torch.minimum(unclipped, clip)
        clipped = (clip < unclipped).to(logp_S.dtype).detach()
    if cfg.kl_coef > 0:
        if ref_logp_S is None:
            raise ValueError("rl.kl_coef > 0 needs reference log-probs")
        d = ref_logp_S.to(logp_S.dtype) - logp_S
        kl = torch.exp(d) - d - 1.0
        loss = pg + cfg.kl_coef * kl
    else:
        kl = torch.zeros_like(logp_S)
        loss = pg
    return loss, pg, kl, clipped
