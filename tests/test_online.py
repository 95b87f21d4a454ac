"""Online RL end to end: the lookup task's rollout trees, HARTS vs the baseline over online steps, learning.

The rollout tests check the trees against the environment replayed by hand (the task's own rules, step
by step) and the sampler's log-probs against the training forward, for Ling-3.0 and Qwen3.5-MoE; the trainer
tests run configs/online_cpu.toml in one process, float64, at debug size (with ``model.preset =
"qwen3.5-debug"`` for Qwen3.5-MoE).
"""
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
from harts.rl.rollout import rollout_trees
from harts.rl.tasks import Environment, LookupTask, Turn
from harts.train.config import load_config
from harts.train.trainer import Trainer

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "online_cpu.toml")
QWEN35 = {"model.preset": "qwen3.5-debug", "rl.expert_bias_rate": 0.0}  # softmax routing: no expert bias


@pytest.fixture(scope="module")
def model():
    cfg = LingConfig.preset("ling3-tiny-debug", num_hidden_layers=4, backend="reference")
    return LingForCausalLM(cfg).init_weights(0).cast_(torch.float64)


@pytest.fixture(scope="module")
def qwen35_model():
    cfg = Qwen35Config.preset("qwen3.5-debug", num_hidden_layers=4, backend="reference")  # 3 GDN + 1 attention
    return Qwen35ForCausalLM(cfg).init_weights(seed=0).cast_(torch.float64)


def test_lookup_task_rules():
    env = LookupTask()
    assert isinstance(env, Environment)
    state, prompt = env.reset(5)
    _, key, table = state
    assert prompt == (env.bos, env.ask, env.key_base + key, env.call)
    good = env.step(state, [env.key_base + key])
    assert good.observation == (env.obs, env.value_base + table[key], env.ans) and not good.done
    assert good.reward == 0.5
    bad = env.step(state, [env.ask])
    assert bad.observation == (env.obs, env.err, env.ans)
    end = env.step(good.state, [env.value_base + table[key]])
    assert end.done and end.reward == 0.5
    assert env.step(good.state, [0]).reward == 0.0  # far from the value range: no closeness
    with pytest.raises(ValueError, match="one token"):
        env.step(state, [1, 2])


def test_rollout_trees_share_prefixes_and_follow_the_environment(model):
    env = LookupTask()
    r = rollout_trees(model, env, [10, 11, 12], (3, 2), generator=torch.Generator().manual_seed(0))
    trajs = r.trajectories
    assert len(trajs) == 3 * 3 * 2 and [t.group_id for t in trajs] == sorted(t.group_id for t in trajs)
    for g in range(3):
        tree = [t for t in trajs if t.group_id == g]
        assert len({tuple(t.tokens[:4]) for t in tree}) == 1  # one prompt per tree
        assert len({tuple(t.tokens[:8]) for t in tree}) <= 3  # 3 tool calls, each with its observation
        for i in range(0, 6, 2):  # the two answers of one call share its call and observation
            assert np.array_equal(tree[i].tokens[:8], tree[i + 1].tokens[:8])
    for t in trajs:  # replay the environment by hand on the sampled actions
        state, prompt = env.reset(t.extra["seed"])
        assert tuple(t.tokens[:4]) == prompt
        first = env.step(state, [int(t.tokens[4])])
        assert tuple(t.tokens[5:8]) == first.observation
        last = env.step(first.state, [int(t.tokens[8])])
        assert math.isclose(t.reward, first.reward + last.reward) and last.done and len(t) == 9
        assert t.loss_mask.tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 1]
        assert (t.old_logprobs[t.loss_mask == 0] == 0).all() and (t.old_logprobs[t.loss_mask == 1] < 0).all()


@pytest.mark.parametrize("family", ["model", "qwen35_model"])
def test_rollouts_old_logprobs_are_the_policy_logprobs(request, family):
    """The sampler's recorded log-probs equal the training forward's on the finished trajectories."""
    model = request.getfixturevalue(family)
    r = rollout_trees(model, LookupTask(), [3, 4], (2, 2), generator=torch.Generator().manual_seed(1))
    for t in r.trajectories:
        ids = torch.as_tensor(t.tokens)
        with torch.no_grad():
            lp = torch.log_softmax(model.logits(model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]))), -1)
        ref = lp[:-1].gather(1, ids[1:, None]).squeeze(1).numpy()
        on = t.loss_mask[1:] == 1
        assert np.abs(t.old_logprobs[1:][on] - ref[on]).max() <= 1e-10


def test_custom_environment_plugs_in(model):
    """A user's environment: two pure functions and two attributes (docs/online.md)."""

    class Echo:
        max_action_tokens, stop_ids = 3, (2,)

        def reset(self, seed):
            return 0, [1, 10 + seed % 5]

        def step(self, state, action):
            return Turn(observation=(9,) if state == 0 else (), reward=float(len(action)), done=state == 1,
                        state=state + 1)

    r = rollout_trees(model, Echo(), [0, 1], (2,), generator=torch.Generator().manual_seed(2))
    assert len(r.trajectories) == 4
    for t in r.trajectories:
        mask = t.loss_mask.tolist()
        assert mask[:2] == [0, 0] and 9 in t.tokens.tolist() and t.reward >= 2


def _run(tmp_path: Path, name: str, capture=None, model_type=None, **over):
    over = {"model.dtype": "float64", "online.plot": False, "job.dump_folder": str(tmp_path / name), **over}
    tr = Trainer(load_config(CONFIG, **over))
    if model_type is not None:
        assert isinstance(tr.model, model_type), type(tr.model).__name__
    if capture is not None:
        sample = tr.builder.online
        tr.builder.online = lambda step: capture.append(sample(step)) or capture[-1]
    try:
        return tr.train()
    finally:
        tr.close()


def _assert_same_online_runs(tmp_path, steps, model_type, **over):
    ra, rb = [], []
    ha = _run(tmp_path, "harts", ra, model_type, **{"training.steps": steps, "harts.enabled": True, **over})
    hb = _run(tmp_path, "base", rb, model_type, **{"training.steps": steps, "harts.enabled": False, **over})
    assert len(ha) == len(hb) == steps
    for a, b in zip(ra, rb):
        assert len(a.trajectories) == len(b.trajectories)
        assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a.trajectories, b.trajectories))
        assert all(np.abs(x.old_logprobs - y.old_logprobs).max() <= 1e-10
                   for x, y in zip(a.trajectories, b.trajectories))
    assert any(len({tuple(t.tokens) for t in r.trajectories}) > 8 for r in ra)  # the rollouts vary
    for x, y in zip(ha, hb):
        assert x["reward"] == y["reward"]
        for k in ("loss", "policy_loss", "grad_norm"):
            assert abs(x[k] - y[k]) <= 1e-9 * max(abs(x[k]), abs(y[k]), 1e-30), (k, x[k], y[k])
        assert x["compression"] > 2 and y["compression"] == 1
        assert x["entropy"] > 0 and x["decode_tok_s"] > 0


def test_harts_and_baseline_sample_and_train_identically(tmp_path):
    """Same seed, HARTS on and off: step by step the same rollouts (the sampler is seeded and the models
    agree to rounding) and the same losses, over steps whose weights each depend on all earlier ones."""
    _assert_same_online_runs(tmp_path, 4, LingForCausalLM)


def test_qwen35_harts_and_baseline_sample_and_train_identically(tmp_path):
    """As above for Qwen3.5-MoE (Gated DeltaNet + gated attention): step 2's rollouts are sampled from the
    weights step 1 trained, so HARTS and the baseline must agree through sampling, training and sampling."""
    _assert_same_online_runs(tmp_path, 2, Qwen35ForCausalLM, **QWEN35)


@pytest.mark.slow
def test_online_grpo_raises_the_reward(tmp_path):
    """40 online steps: the mean reward of the last 10 exceeds that of the first 10 by more than 0.2, and
    by more than 6 times the step-to-step noise (std of consecutive differences / sqrt 2) of those steps.
    A random policy scores about 0.06 (harts.rl.tasks). Runs from seeds 0, 1, 2 rose from about 0.08 to
    0.36-0.42 with noise 0.016-0.028: a rise of 12 to 18 times the noise."""
    hist = _run(tmp_path, "learn", **{"training.steps": 40})
    r = np.array([h["reward"] for h in hist])
    first, last = r[:10], r[-10:]
    noise = max(np.std(np.diff(first)), np.std(np.diff(last))) / math.sqrt(2)
    rise = last.mean() - first.mean()
    assert rise > 0.2 and rise > 6 * noise, (first.round(3).tolist(), last.round(3).tolist(), noise)


class _FakeTrainRun:
    """Stands in for one ``train.py`` process of ``python -m harts.rl.online``: each poll logs one more step to
    the run's metrics.jsonl (the last one first as a torn line, completed at the next poll) and its console
    line to the run.log the driver opened for it."""

    def __init__(self, cmd, stdout, stderr=None):
        self.folder = [a.split("=", 1)[1] for a in cmd if a.startswith("--job.dump_folder=")][-1]  # the last wins
        self.harts = "--harts.enabled=true" in cmd
        self.log = open(stdout.name, "a")
        self.steps, self.step, self.torn, self.returncode = 3, 0, None, None

    def record(self, step: int) -> dict:
        return {"step": step, "loss": 0.25 * step + self.harts, "reward": 0.125 * step, "raw_tok_s": 1000.0 * step,
                "step_s": 0.5, "compression": 3.0 if self.harts else 1.0, "rollout_s": 0.1}

    def poll(self):
        import json

        with open(Path(self.folder) / "metrics.jsonl", "a") as f:
            if self.torn is not None:
                f.write(self.torn)
                self.torn = None
            elif self.step < self.steps:
                self.step += 1
                line = json.dumps(self.record(self.step)) + "\n"
                if self.step == self.steps:
                    f.write(line[:10])
                    self.torn = line[10:]
                else:
                    f.write(line)
                self.log.write(f"step {self.step}\n")
            else:
                self.returncode = 0
                self.log.close()
        return self.returncode

    def wait(self):
        while self.poll() is None:
            pass
        return self.returncode


def test_online_driver_prints_one_progress_line_per_step(tmp_path, monkeypatch, capsys):
    """``python -m harts.rl.online`` prints a line per step of each run (step, loss, reward, tok/s, s/step) while
    the runs train, and each run's console output is in <dump folder>/<run>/run.log."""
    import json
    import subprocess

    from harts.rl import online

    real = subprocess.Popen

    def popen(cmd, *args, **kw):  # train.py runs are faked; any other process (e.g. git) is real
        is_train = isinstance(cmd, list) and len(cmd) > 1 and str(cmd[1]).endswith("train.py")
        return _FakeTrainRun(cmd, *args, **kw) if is_train else real(cmd, *args, **kw)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(online, "_POLL_S", 0.0, raising=False)
    out = tmp_path / "fig.png"
    assert online.main(["--config", CONFIG, "--out", str(out), f"--job.dump_folder={tmp_path}",
                        "--training.steps=3", "--jobs", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ": step " in line]
    for label, harts in (("HARTS", True), ("baseline", False)):
        mine = [line for line in lines if line.startswith(f"{label}: step ")]
        assert len(mine) == 3, lines  # every step once, the torn last line included once completed
        for step, line in enumerate(mine, 1):
            assert line.startswith(f"{label}: step {step}/3")
            assert f"loss {0.25 * step + harts:.4f}" in line and f"reward {0.125 * step:.3f}" in line
            assert f"{1000 * step} tok/s" in line and "0.50 s/step" in line
        folder = tmp_path / label.lower()
        assert (folder / "run.log").read_text().splitlines() == ["step 1", "step 2", "step 3"]
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["runs"]["HARTS"]["reward"] == [0.125, 0.25, 0.375]
