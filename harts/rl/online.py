"""The online loop's pieces: the trainer's rollout source, the reward plot, and the Figure 5 analog.

``OnlineSource(cfg.online, model)`` is what the trainer hands its step builder in online mode: called
with step s it samples ``online.episodes`` rollout trees from ``model`` (its current weights) on
``online.task`` with a generator seeded from (online.seed, s), and returns ``harts.rl.rollout.Rollouts``
whose trajectories go through the same GRPO, planning and packing path as JSONL rollouts.

The paper's Figure 5 (reward per step of HARTS and the trajectory-wise baseline from the same seed),
on the lookup task::

    python -m harts.rl.online --config configs/online_cpu.toml --out out/online_figure5.png
    python -m harts.rl.online --config configs/online_1gpu.toml --baseline-seeds 1 --jobs 3 \
        --out out/online_figure5_1gpu.png

runs ``train.py`` on the config with ``harts.enabled`` true, then false (checkpoints off), plus one baseline
per extra sampler seed, as processes (``--jobs`` at a time), and plots every reward curve in one PNG; a JSON
beside it holds each run's reward, compression, tokens/s and step time per step. Each run writes its console
output to ``<job.dump_folder>/<run>/run.log`` (``harts``, ``baseline``, ``baseline_seed<s>``) and its step records
to ``metrics.jsonl`` beside it; while they train, this command prints one line per step of each run on stdout
(step, loss, reward, tokens/s, seconds per step). In float64 the rollouts and
losses of HARTS and the baseline agree step by step (tests/test_online.py), so their curves coincide; the
extra seeds' spread is the run-to-run noise against which a bf16 difference between them is judged.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from harts.models.common.generate import Sampling
from harts.rl.rollout import Rollouts, rollout_trees
from harts.rl.tasks import make_task

__all__ = ["OnlineSource", "plot_rewards", "main"]

log = logging.getLogger("harts.train")

_SEED_STRIDE = 1_000_003  # episode seeds of (seed, step) never collide for fewer episodes per step
_POLL_S = 1.0  # seconds between looks at the running runs' metrics


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


def _run_argv(config: str, overrides: list[str], enabled: bool, seed: int | None, folder: str) -> list[str]:
    argv = ["--config", config, *overrides, f"--harts.enabled={str(enabled).lower()}", "--online.enabled=true",
            "--online.plot=false", "--checkpoint.enable=false", f"--job.dump_folder={folder}"]
    return argv + ([f"--online.seed={seed}"] if seed is not None else [])


def _read_metrics(folder: str) -> list[dict]:
    import json

    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        raise RuntimeError(f"no {path}: the run did not log a step (see {folder}/run.log)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class _Progress:
    """Follows one run's ``metrics.jsonl`` while it trains: each call returns one line per step logged since
    the last call (a partly written last line waits for the next call)."""

    def __init__(self, label: str, folder: str, steps: int):
        self.label, self.path, self.steps, self.offset = label, os.path.join(folder, "metrics.jsonl"), steps, 0

    def lines(self) -> list[str]:
        import json

        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for raw in data[:end].splitlines():
            try:
                r = json.loads(raw)
            except ValueError:
                continue
            parts = [f"{self.label}: step {r.get('step', '?')}/{self.steps}"]
            for key, fmt in (("loss", "loss {:.4f}"), ("reward", "reward {:.3f}"), ("raw_tok_s", "{:.0f} tok/s"),
                             ("step_s", "{:.2f} s/step")):
                if isinstance(r.get(key), (int, float)):
                    parts.append(fmt.format(r[key]))
            out.append("  ".join(parts))
        return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def main(argv=None) -> int:
    """The Figure 5 analog (module docstring): HARTS and the baseline from the same seed, one PNG; with
    ``--baseline-seeds`` more baseline runs from other sampler seeds, whose spread says how far two runs
    of the same trainer land apart; ``--jobs`` runs them as concurrent processes (e.g. on one GPU)."""
    import json
    import subprocess

    ap = argparse.ArgumentParser(prog="python -m harts.rl.online", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="an online config, e.g. configs/online_cpu.toml")
    ap.add_argument("--out", default="out/online_figure5.png", help="the PNG to write (and a .json beside it)")
    ap.add_argument("--baseline-seeds", default="", help="comma-separated online.seed values of extra baseline runs")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, each its own process (default 1)")
    args, extra = ap.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: must be >= 1")
    try:
        extra_seeds = [int(x) for x in args.baseline_seeds.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--baseline-seeds {args.baseline_seeds!r}: expected comma-separated integers") from None
    from harts.train.config import parse_args

    base = parse_args(["--config", args.config, *extra])
    root = base.job.dump_folder
    runs = [("HARTS", True, None, os.path.join(root, "harts")),
            ("baseline", False, None, os.path.join(root, "baseline"))]
    runs += [(f"baseline, seed {s}", False, s, os.path.join(root, f"baseline_seed{s}")) for s in extra_seeds]
    train_py = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train.py")
    if not os.path.exists(train_py):
        raise SystemExit(f"{train_py} not found: run from a checkout of the repository (train.py is its entry point)")
    pending, running, failed = list(runs), [], []
    while pending or running:
        while pending and len(running) < args.jobs:
            label, enabled, seed, folder = pending.pop(0)
            os.makedirs(folder, exist_ok=True)
            metrics = os.path.join(folder, "metrics.jsonl")
            if os.path.exists(metrics):  # train.py starts it afresh (checkpoints are off); removed first so the
                os.remove(metrics)        # progress lines never show an earlier run's steps
            cmd = [sys.executable, train_py, *_run_argv(args.config, extra, enabled, seed, folder)]
            log.info("%s: %s (log %s/run.log)", label, " ".join(cmd[1:]), folder)
            with open(os.path.join(folder, "run.log"), "w") as logf:
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
            running.append((label, folder, proc, _Progress(label, folder, base.training.steps)))
        # one progress line per logged step of every running run, then the finished runs leave
        time.sleep(_POLL_S)
        for label, folder, proc, progress in list(running):
            done = proc.poll() is not None
            for line in progress.lines():
                print(line, flush=True)
            if done:
                running.remove((label, folder, proc, progress))
                if proc.returncode:
                    failed.append(f"{label} (exit {proc.returncode}, {folder}/run.log)")
    if failed:
        raise SystemExit("online runs failed: " + "; ".join(failed))
    curves, summary = {}, {"config": args.config, "overrides": extra, "runs": {}}
    for label, enabled, seed, folder in runs:
        hist = _read_metrics(folder)
        steps, rewards = [r["step"] for r in hist], [r["reward"] for r in hist]
        curves[label] = (steps, rewards)
        summary["runs"][label] = {
            "harts": enabled, "online_seed": base.online.seed if seed is None else seed, "steps": steps,
            "reward": rewards, "compression": [r["compression"] for r in hist],
            "raw_tok_s": [r["raw_tok_s"] for r in hist], "step_s": [r["step_s"] for r in hist],
            "rollout_s": [r.get("rollout_s") for r in hist],
            "reward_first10": _mean(rewards[:10]), "reward_last10": _mean(rewards[-10:])}
        log.info("%s: mean reward %.3f over the first 10 steps, %.3f over the last 10", label,
                 _mean(rewards[:10]), _mean(rewards[-10:]))
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    if plot_rewards(curves, args.out, "lookup task, online GRPO"):
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
