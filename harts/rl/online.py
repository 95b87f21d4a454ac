"""The online loop's pieces: the trainer's rollout source, the reward plot, and the Figure 5 analog.

``OnlineSource(cfg.online, model)`` is what the trainer hands its step builder in online mode: called
with step s it samples ``online.episodes`` rollout trees from ``model`` (its current weights) on
``online.task`` with a generator seeded from (online.seed, s), and returns ``harts.rl.rollout.Rollouts``
whose trajectories go through the same GRPO, planning and packing path as JSONL rollouts.

The paper's Figure 5 (reward per step of HARTS and the trajectory-wise baseline from the same seed),
on the lookup task on CPU::

    python -m harts.rl.online --config configs/online_cpu.toml --out out/online_figure5.png

runs the config twice in this process (``harts.enabled`` true, then false; checkpoints off) and plots
both reward curves in one PNG. In float64 the rollouts and losses of the two runs agree step by step
(tests/test_online.py), so the curves coincide.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from harts.models.ling.generate import Sampling
from harts.rl.rollout import Rollouts, rollout_trees
from harts.rl.tasks import make_task

__all__ = ["OnlineSource", "plot_rewards", "main"]

log = logging.getLogger("harts.train")

_SEED_STRIDE = 1_000_003  # episode seeds of (seed, step) never collide for fewer episodes per step


class OnlineSource:
    """Step -> rollout trees sampled from ``model`` (see the module docstring)."""

    def __init__(self, online_cfg, model):
        self.cfg, self.model = online_cfg, model
        self.env = make_task(online_cfg.task)
        need = getattr(self.env, "vocab_needed", lambda: 0)()
        if need > model.config.vocab_size:
            raise ValueError(f"online.task = {online_cfg.task!r} uses token ids up to {need - 1}, beyond the model's "
                             f"vocab_size = {model.config.vocab_size}")
        self.sampling = Sampling(temperature=online_cfg.temperature, top_p=online_cfg.top_p)

    def __call__(self, step: int) -> Rollouts:
        c = self.cfg
        base = c.seed * _SEED_STRIDE + (step - 1) * c.episodes
        gen = torch.Generator().manual_seed(c.seed * _SEED_STRIDE + step)
        return rollout_trees(self.model, self.env, range(base, base + c.episodes), c.branching,
                             sampling=self.sampling, generator=gen, max_turns=c.max_turns)


def plot_rewards(curves: dict, path: str, title: str = "reward per step") -> bool:
    """One PNG with a line per entry of ``curves`` (label -> (steps, rewards)). Returns False (and logs
    why) when matplotlib is missing: it is in the ``bench`` extra, not a dependency of training."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e '.[bench]'): no plot written to %s", path)
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, (steps, rewards) in curves.items():
        ax.plot(steps, rewards, label=label, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    """The Figure 5 analog (module docstring): HARTS and the baseline from the same seed, one PNG."""
    ap = argparse.ArgumentParser(prog="python -m harts.rl.online", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="an online config, e.g. configs/online_cpu.toml")
    ap.add_argument("--out", default="out/online_figure5.png", help="the PNG to write")
    ap.add_argument("overrides", nargs="*", help="--section.key=value overrides for both runs")
    args, extra = ap.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from harts.train.config import parse_args
    from harts.train.trainer import Trainer

    curves = {}
    for enabled, label in ((True, "HARTS"), (False, "baseline")):
        argv_run = ["--config", args.config, *args.overrides, *extra, f"--harts.enabled={str(enabled).lower()}",
                    "--online.enabled=true", "--online.plot=false", "--checkpoint.enable=false"]
        cfg = parse_args(argv_run)
        cfg.job.dump_folder = os.path.join(cfg.job.dump_folder, "harts" if enabled else "baseline")
        trainer = Trainer(cfg)
        try:
            hist = trainer.train()
        finally:
            trainer.close()
        curves[label] = ([r["step"] for r in hist], [r["reward"] for r in hist])
        log.info("%s: mean reward %.3f over the first 5 steps, %.3f over the last 5", label,
                 sum(curves[label][1][:5]) / len(curves[label][1][:5]),
                 sum(curves[label][1][-5:]) / len(curves[label][1][-5:]))
    if plot_rewards(curves, args.out, "lookup task, online GRPO, same seed"):
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
