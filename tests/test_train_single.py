"""One-process trainer tests in float64 on ling3-tiny-debug (4 layers) and a truncated tiny workload.

HARTS and the trajectory-wise baseline give the same loss sequence (and weights) over 3 steps: the
baseline is planned and packed differently (its own microbatches, no sharing), so this also checks that
the step's objective does not depend on the split. Activation checkpointing changes nothing; NaN/Inf
stop the step naming it; the expert bias follows the multiplicity-weighted counts and is no parameter.
The multi-step tests are marked slow (CI runs them).
"""
import json
import math

import pytest
import torch

from harts.train.config import load_config
from harts.train.trainer import NonFiniteError, Trainer
from tests.helpers import COMMON, write_ppo_steps

BASE = COMMON + """[metrics]
log_freq = 100
disable_color_printing = true
"""


@pytest.fixture
def make(tmp_path):
    p = tmp_path / "base.toml"
    p.write_text(BASE)

    def build(**over):
        over.setdefault("job.dump_folder", str(tmp_path / "out"))
        return Trainer(load_config(str(p), **over))

    return build


@pytest.fixture(scope="module")
def harts_run(tmp_path_factory):
    """Three HARTS steps of the base config and the final weights, shared by the tests that compare with it
    (a step's loss and gradient norm do not depend on how many steps the run has)."""
    d = tmp_path_factory.mktemp("single")
    (d / "base.toml").write_text(BASE)
    tr = Trainer(load_config(str(d / "base.toml"), **{"training.steps": 3, "job.dump_folder": str(d / "out")}))
    return tr.train(), {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _close(a, b, rel=1e-10):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


@pytest.mark.slow
def test_harts_equals_baseline_for_three_steps(make, harts_run):
    tr = make(**{"training.steps": 3, "harts.enabled": False})
    (h, hs), (b, bs) = harts_run, (tr.train(), {k: v.detach().clone() for k, v in tr.model.state_dict().items()})
    assert len(h) == len(b) == 3
    assert all(r["compression"] > 1.2 for r in h) and all(r["compression"] == 1 for r in b)
    assert all(r["microbatches"] >= 2 for r in h + b)
    assert any(r["router_loss"] != 0 for r in h)
    for rh, rb in zip(h, b):
        for k in ("loss", "policy_loss", "router_loss", "grad_norm"):
            assert _close(rh[k], rb[k]), (rh["step"], k, rh[k], rb[k])
    for k in bs:
        scale = bs[k].abs().max().item()
        assert (hs[k] - bs[k]).abs().max().item() <= 1e-9 * max(scale, 1e-12), k


@pytest.mark.slow
def test_activation_checkpointing_is_exact(make, harts_run):
    a = harts_run[0][:2]
    b = make(**{"training.steps": 2, "activation_checkpoint.mode": "full"}).train()
    assert len(b) == 2
    for ra, rb in zip(a, b):
        assert _close(ra["loss"], rb["loss"], 1e-13) and _close(ra["grad_norm"], rb["grad_norm"], 1e-12)


def test_garbage_collection_runs_every_gc_freq_steps_only(make, monkeypatch):
    """Training runs with automatic collection off (no collection stops the host inside a step) and collects at
    the start of every training.gc_freq-th step (torchtitan's rule: from the second one on); the caller's
    collector is back on afterwards."""
    import gc

    from torchtitan.tools.utils import GarbageCollection

    seen = []  # (step being started, automatic collection on)
    monkeypatch.setattr(GarbageCollection, "collect",
                        staticmethod(lambda reason, generation=1: seen.append(("collect", gc.isenabled()))))
    tr = make(**{"training.steps": 4, "training.gc_freq": 2})
    step = tr.train_step

    def train_step(data):
        seen.append((data.step, gc.isenabled()))
        return step(data)

    tr.train_step = train_step
    assert gc.isenabled()
    tr.train()
    assert gc.isenabled()
    assert seen == [("collect", False), (1, False), ("collect", False), (2, False), (3, False), ("collect", False),
                    (4, False)], seen


def test_non_finite_loss_and_gradients_name_step_and_microbatch(make):
    tr = make(**{"training.steps": 1})
    with torch.no_grad():
        tr.model.lm_head.weight[7, 3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite loss in microbatch \d+ on rank 0"):
        tr.train()
    tr = make(**{"training.steps": 1})
    tr.model.model.norm.weight.register_hook(lambda g: g * math.inf)
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite gradients in microbatch \d+"):
        tr.train()


def test_expert_bias_follows_weighted_counts_and_is_not_optimised(make):
    """After one HARTS step the bias equals the aux-loss-free update computed from the initial model's
    counts on the whole step run trajectory-wise in one piece (independent of planner and sharing)."""
    from harts.runtime import pack

    tr = make(**{"training.steps": 1})
    bias_ids = {id(m.gate.expert_bias) for m in tr.model.moe_layers()}
    assert not bias_ids & {id(p) for g in tr.optimizers.optimizers[0].param_groups for p in g["params"]}
    assert not bias_ids & {id(p) for p in tr.model.parameters()}
    data = tr.builder.build(1)
    trajs = [t for mb in data.plan.microbatches for t in (tr.builder.load(1)[i] for i in mb)]
    ref = make(**{"training.steps": 1})  # same init weights
    with torch.no_grad():
        ref.model(pack(trajs, chunk_size=16, prefix_sharing=False))
    counts = ref.model.moe_counts()
    tr.train()
    rate = 1e-2
    for m, c in zip(tr.model.moe_layers(), counts):
        want = rate * torch.sign(c.mean() - c)
        want = want - want.mean()
        assert torch.allclose(m.gate.expert_bias.double(), want.double(), rtol=0, atol=1e-12)
        assert m.gate.expert_bias.abs().sum() > 0


def test_compile_and_profiler(make, harts_run, tmp_path):
    """Per-block compile of the layout-free modules leaves the step unchanged (float64); --profile.enable
    writes a chrome trace with the microbatch ranges for the chosen step."""
    a = harts_run[0]
    b = make(**{"training.steps": 1, "compile.enable": True, "profile.enable": True, "profile.steps": [1],
                "job.dump_folder": str(tmp_path / "prof")}).train()
    assert _close(a[0]["loss"], b[0]["loss"], 1e-12) and _close(a[0]["grad_norm"], b[0]["grad_norm"], 1e-12)
    trace = (tmp_path / "prof" / "profile" / "step1" / "rank0_trace.json").read_text()
    assert '"traceEvents"' in trace and "harts.microbatch." in trace and "harts.backward." in trace
    from benchmarks.trace_summary import summarize

    summ = summarize(json.loads(trace))
    assert summ["source"] == "cpu_ops_inclusive" and summ["total_s"] > 0
    assert summ["ranges_s"]["harts.microbatch"] > 0 and summ["ranges_s"]["harts.backward"] > 0


def test_compiled_selective_checkpointing_step_equals_eager(make, harts_run, tmp_path):
    """The trainer's compiled layers under selective activation checkpointing (aot_eager: the partitioner that
    applies the save policy, without inductor's C++ compile) give the eager, uncheckpointed step (float64)."""
    a = harts_run[0]
    b = make(**{"training.steps": 1, "compile.enable": True, "compile.backend": "aot_eager",
                "activation_checkpoint.mode": "selective", "job.dump_folder": str(tmp_path / "sel")}).train()
    assert _close(a[0]["loss"], b[0]["loss"], 1e-12) and _close(a[0]["grad_norm"], b[0]["grad_norm"], 1e-12)
    assert _close(a[0]["router_loss"], b[0]["router_loss"], 1e-12)


@pytest.mark.slow
def test_ppo_with_kl_from_jsonl_harts_equals_baseline(make, tmp_path):
    """PPO-clip + k3 KL on JSONL steps carrying old/ref log-probs and data advantages (one file per step):
    HARTS and baseline agree, the clip is active, and 'recompute' old log-probs make the first update's
    ratio 1 (so PPO's loss then equals GRPO's on the same advantages)."""
    paths = [str(p) for p in write_ppo_steps(tmp_path, seed=10)]
    common = {"training.steps": 2, "data.source": "jsonl", "data.path": paths, "data.reward": "data",
              "rl.advantages": "data", "rl.kl_coef": 0.1}
    h = make(**common, **{"rl.objective": "ppo"}).train()
    b = make(**common, **{"rl.objective": "ppo", "harts.enabled": False}).train()
    assert len(h) == len(b) == 2
    for rh, rb in zip(h, b):
        for k in ("loss", "policy_loss", "kl", "clip_frac", "grad_norm"):
            assert _close(rh[k], rb[k]), (rh["step"], k, rh[k], rb[k])
    assert all(r["clip_frac"] > 0 and r["kl"] > 0 for r in h)
    p = make(**{**common, "training.steps": 1, "rl.objective": "ppo", "rl.old_logprobs": "recompute"}).train()
    g = make(**{**common, "training.steps": 1, "rl.objective": "grpo"}).train()
    assert p[0]["clip_frac"] == 0 and _close(p[0]["grad_norm"], g[0]["grad_norm"], 1e-12)


@pytest.mark.slow
def test_train_speedup_reads_both_runs(make, tmp_path):
    """fbgrad_s is logged inside step_s, and benchmarks.train_speedup compares a HARTS and a baseline run of
    the same fixed step (and refuses runs that trained different rollouts)."""
    from benchmarks import train_speedup

    recs = {}
    for enabled in (True, False):
        recs[enabled] = make(**{"training.steps": 2, "harts.enabled": enabled, "data.fixed_step": True,
                                "metrics.log_freq": 1, "job.dump_folder": str(tmp_path / f"run{enabled}")}).train()
    for r in recs[True] + recs[False]:
        assert 0 < r["fbgrad_s"] <= r["step_s"]
    out = tmp_path / "cmp"
    assert train_speedup.main(["--harts", str(tmp_path / "runTrue" / "metrics.jsonl"), "--baseline",
                               str(tmp_path / "runFalse" / "metrics.jsonl"), "--skip", "1", "--out", str(out)]) == 0
    res = json.loads((out / "train_speedup.json").read_text())
    h = recs[True][1:]
    assert res["harts"]["steps"] == [2]
    assert abs(res["compression"] - sum(r["raw_tokens"] for r in h) / sum(r["compact_rows"] for r in h)) < 1e-12
    want = (sum(r["fbgrad_s"] for r in recs[False][1:]) / sum(r["fbgrad_s"] for r in h))
    assert abs(res["speedup_fbgrad"] - want) < 1e-9 * want
    core = lambda rs: sum(r["fbgrad_s"] + r["plan_s"] + r["pack_s"] for r in rs)  # noqa: E731
    want = core(recs[False][1:]) / core(h)
    assert abs(res["speedup_core"] - want) < 1e-9 * want and res["harts"]["tp"] == res["harts"]["pp"] == 1
    # --config: the step's forward FLOPs of both paths (the baseline's are the sum over its trajectories
    # whatever the grouping), and the speedups against the FLOP compression
    cfg = ["--config", str(tmp_path / "base.toml"), "--data.fixed_step=true"]
    assert train_speedup.main(["--harts", str(tmp_path / "runTrue" / "metrics.jsonl"), "--baseline",
                               str(tmp_path / "runFalse" / "metrics.jsonl"), "--skip", "1", "--out", str(out),
                               *cfg]) == 0
    res = json.loads((out / "train_speedup.json").read_text())
    from benchmarks.flops import active_matmul_params, batch_forward_flops
    from harts.runtime import pack
    tr = make(**{"data.fixed_step": True, "job.dump_folder": str(tmp_path / "flops")})
    trajs, m = tr.builder.load(1), tr.model
    B, act = m.config.kda_chunk_size, active_matmul_params(m)
    per_traj = sum(batch_forward_flops(m, pack([t], chunk_size=B, prefix_sharing=False), act)["total"] for t in trajs)
    assert abs(res["forward_flops_baseline"] - per_traj) <= 1e-9 * per_traj
    assert 1 < res["flop_compression"] and abs(res["fbgrad_over_flop_compression"] * res["flop_compression"]
                                               - res["speedup_fbgrad"]) < 1e-9
    with pytest.raises(ValueError, match="raw tokens"):  # a config whose step is not the runs' step
        train_speedup.main(["--harts", str(tmp_path / "runTrue" / "metrics.jsonl"), "--baseline",
                            str(tmp_path / "runFalse" / "metrics.jsonl"), "--skip", "1", "--out", str(out), *cfg,
                            "--data.seed=7"])
    with pytest.raises(ValueError, match="expected a HARTS run and a baseline run"):
        train_speedup.main(["--harts", str(tmp_path / "runFalse" / "metrics.jsonl"), "--baseline",
                            str(tmp_path / "runFalse" / "metrics.jsonl"), "--skip", "1", "--out", str(out)])
