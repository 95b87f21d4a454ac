"""RL objectives over HARTS log-probs: GRPO group-relative advantages and PPO-clip with optional KL.

``advantages`` is numpy only (it runs in the data-prefetch worker, before the step); ``losses`` is torch.
"""
from harts.rl.advantages import grpo_advantages, with_grpo_advantages
from harts.rl.losses import (
    LossConfig,
    StepNormalizer,
    aux_scale,
    microbatch_coefficients,
    step_normalizer,
    token_losses,
)

__all__ = ["grpo_advantages", "with_grpo_advantages", "LossConfig", "StepNormalizer", "step_normalizer",
           "microbatch_coefficients", "token_losses", "aux_scale"]
