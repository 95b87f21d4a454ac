"""The code examples of the user docs run as written.

``docs/runtime.md``'s ```python block (using HARTS from your own trainer) is read from the page and executed
in a fresh namespace; its results are then checked against the trajectories it packs.
"""
import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of a docs page, in order."""
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), flags=re.S | re.M)


def test_runtime_example_runs():
    blocks = python_blocks("runtime.md")
    assert len(blocks) == 1, f"docs/runtime.md has {len(blocks)} python blocks; this test runs exactly one"
    ns: dict = {"__name__": "docs_runtime_example"}
    exec(compile(blocks[0], str(DOCS / "runtime.md"), "exec"), ns)
    trajs, lp, per_traj, model = ns["trajectories"], ns["lp"], ns["per_traj"], ns["model"]
    assert [len(p) for p in per_traj] == [len(t.tokens) - 1 for t in trajs]
    assert lp.shape == (sum(len(t.tokens) - 1 for t in trajs),)
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    stats = ns["batch"].stats
    assert stats["raw_tokens"] == sum(len(t.tokens) for t in trajs)
    assert stats["compact_rows"] < stats["raw_tokens"]  # the prompt is shared
    counts = ns["counts"]
    assert counts.shape == (len(model.moe_layers()), model.config.num_experts)
    assert model.lm_head.weight.grad is not None  # the loss went back through the model


def test_trl_example_runs(tmp_path, monkeypatch):
    """docs/trl.md: one GRPO step of TRL's trainer on a HARTS model, its log-prob passes through HARTS."""
    import pytest

    pytest.importorskip("trl", minversion="1.16.0",
                        reason="the TRL example needs the trl extra (the README's test command installs it)")
    blocks = python_blocks("trl.md")
    assert len(blocks) == 1, f"docs/trl.md has {len(blocks)} python blocks; this test runs exactly one"
    monkeypatch.chdir(tmp_path)  # the example writes under out/
    ns: dict = {"__name__": "docs_trl_example"}
    exec(compile(blocks[0], str(DOCS / "trl.md"), "exec"), ns)
    model, trainer = ns["model"], ns["trainer"]
    assert trainer.model.harts is model  # TRL trained the HARTS model itself
    assert trainer.state.global_step == 1
    assert model.model.checkpoint_policy == "full"  # TRL's default gradient_checkpointing=True, as HARTS's policy
    assert len(ns["stats"]) == len(model.moe_layers())
    assert all(torch.isfinite(p).all() for p in model.parameters())
