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
