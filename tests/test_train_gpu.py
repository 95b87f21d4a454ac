"""The trainer and a library user run the same model on the GPU.

The trainer's policy (configs/ling3_tiny_1gpu.toml: built on the meta device, parallelised for one device,
initialised shard-wise by harts.train, activation checkpointing on, gradients enabled) and a LingForCausalLM
built the way a library user and the fidelity benchmark build it (benchmarks.common.build_model, under no_grad)
must give bit-identical log-probs on the same HARTS and trajectory-wise microbatches. Then the HARTS-vs-baseline
agreement that the fidelity benchmark reports is, by construction, the trainer's."""
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.common import build_model
from harts.runtime import pack

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def _trees(B: int, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    """Two rollout trees with forks before, at and after chunk boundaries, and one lone trajectory."""
    out = []
    for _ in range(2):
        root = rng.integers(0, vocab, 12 * B + 5).tolist()
        out.append(root)
        for p, n in ((B - 1, 3 * B), (B, 5 * B + 7), (B + 1, 2 * B), (4 * B + 3, 6 * B)):
            out.append(root[:p] + rng.integers(0, vocab, n).tolist())
    out.append(rng.integers(0, vocab, 9 * B).tolist())
    return out


def compare_trainer_and_library(tmp_path: Path, config: str, **over) -> None:
    """Build the trainer of ``config`` and a library model of the same preset and seed; compare log-probs."""
    from harts.train.config import load_config
    from harts.train.trainer import Trainer

    cfg = load_config(str(ROOT / config), **{
        "training.steps": 1, "job.dump_folder": str(tmp_path / "run"), "profile.enable": False, **over})
    tr = Trainer(cfg)
    try:
        policy = tr.model
        lib = build_model(tr.model_cfg, tr.device, tr.dtype, seed=cfg.model.init_seed)
        B = lib.config.kda_chunk_size
        trajs = _trees(B, lib.config.vocab_size, np.random.default_rng(7))
        batches = {"harts": pack(trajs, config=lib.config).to(tr.device),
                   "baseline": pack(trajs, config=lib.config, prefix_sharing=False).to(tr.device)}
        got = {}
        for name, b in batches.items():
            with torch.enable_grad(), tr.amp:
                lp_policy = policy.logprobs(b)
            with torch.no_grad():
                lp_lib = lib.logprobs(b)
            assert lp_policy.requires_grad
            assert torch.equal(lp_policy.detach(), lp_lib), (
                f"{name}: trainer policy and library model differ, max |dlogp| = "
                f"{(lp_policy.detach() - lp_lib).abs().max().item():.3e}")
            got[name] = lp_lib.float()
        d = (got["harts"] - got["baseline"]).abs()
        print(f"HARTS vs trajectory-wise on {len(trajs)} trajectories, {d.numel()} positions: "
              f"max |dlogp| {d.max().item():.3e}, mean {d.mean().item():.3e} (the same in both paths)")
    finally:
        tr.close()


def test_trainer_policy_and_library_model_agree_bitwise(tmp_path):
    compare_trainer_and_library(tmp_path, "configs/ling3_tiny_1gpu.toml")
