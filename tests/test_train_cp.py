"""Context parallelism in the trainer (issue 11) on gloo, float64, against one process.

The reference is the one-process trainer (no CP) on the same config. CP runs fold cp into FSDP2's
dimension (parameters sharded and gradients summed over dp_shard x cp); each CP rank embeds, routes and
scores only its share of the compact rows, and the sequence mixers exchange rows for heads around their
cores (harts.runtime.cp). Equality of the loss / grad-norm sequences and the final weights (incl. the
expert bias, updated from MoE counts summed over DP and CP) checks that the partial gradients, the
per-rank objectives on own positions, the router losses and the counts add up over the CP group.

- cp = 2 with full activation checkpointing (2 processes; FSDP2 over the two CP ranks);
- FSDP2 x CP: dp_shard 2 x cp 2 with EP = 4 spanning dp_shard x cp (4 processes);
- cp = 4 with EP = 4 (4 processes; the debug model's heads split four ways);
- PPO with a KL term (l(log p = 0) != 0) at cp = 2, which a zero-masking objective would get wrong.
"""
import pytest

from harts.train.config import load_config
from harts.train.trainer import Trainer
from tests.test_train_distributed import BASE, _same, one_process_reference, records, torchrun
from tests.train_toml import write_ppo_steps


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    d = tmp_path_factory.mktemp("cp")
    cfg, one = one_process_reference(d)
    return d, cfg, one


def test_cp2_equals_one_process(ref):
    d, cfg, one = ref
    torchrun(cfg, d / "cp2", "--parallelism.context_parallel_degree=2", "--activation_checkpoint.mode=full")
    _same(one, d / "cp2")
    recs = records(d / "cp2")
    assert all((r["world"], r["dp"], r["cp"]) == (2, 1, 2) for r in recs)
    # every rank sees the same microbatches: the step's raw/compact counts are not doubled
    assert [r["compact_rows"] for r in recs] == [r["compact_rows"] for r in records(one)]


def test_fsdp2_x_cp_x_ep_four_processes(ref):
    """dp_shard 2 x cp 2 (FSDP2 over the four ranks), EP = 4 spanning dp_shard x cp."""
    d, cfg, one = ref
    torchrun(cfg, d / "dp_cp_ep", "--parallelism.data_parallel_shard_degree=2",
             "--parallelism.context_parallel_degree=2", "--parallelism.expert_parallel_degree=4", nproc=4)
    _same(one, d / "dp_cp_ep")
    assert all((r["world"], r["dp"], r["cp"], r["ep"]) == (4, 2, 2, 4) for r in records(d / "dp_cp_ep"))


def test_cp4_x_ep4_four_processes(ref):
    d, cfg, one = ref
    torchrun(cfg, d / "cp4", "--parallelism.context_parallel_degree=4", "--parallelism.expert_parallel_degree=4",
             nproc=4)
    _same(one, d / "cp4")
    assert all((r["world"], r["dp"], r["cp"], r["ep"]) == (4, 1, 4, 4) for r in records(d / "cp4"))


def test_ppo_with_kl_cp2_equals_one_process(tmp_path):
    """PPO-clip + k3 KL with old/ref log-probs from JSONL (two files cycled) at cp = 2: each CP rank
    evaluates the objective on its own positions only (l(log p = 0) != 0 here, so zero-masking the
    partial log-probs would be wrong), and the losses, clip fraction and KL add up over the group."""
    paths = [f'"{p}"' for p in write_ppo_steps(tmp_path, seed=20)]
    cfg = tmp_path / "ppo.toml"
    cfg.write_text(BASE.replace('reward = "learnable"', f'reward = "data"\nsource = "jsonl"\npath = [{", ".join(paths)}]'))
    over = {"rl.objective": "ppo", "rl.advantages": "data", "rl.kl_coef": 0.1, "training.steps": 3}
    one = tmp_path / "one"
    Trainer(load_config(str(cfg), **over, **{"job.dump_folder": str(one), "checkpoint.enable": False})).train()
    torchrun(cfg, tmp_path / "cp2", "--parallelism.context_parallel_degree=2", *(f"--{k}={v}" for k, v in over.items()))
    a, b = records(one), records(tmp_path / "cp2")
    assert [r["step"] for r in b] == [1, 2, 3] and all(r["cp"] == 2 for r in b)
    for ra, rb in zip(a, b):
        for k in ("loss", "policy_loss", "kl", "clip_frac", "router_loss", "grad_norm"):
            assert abs(ra[k] - rb[k]) <= 1e-10 * max(abs(ra[k]), 1e-30), (ra["step"], k, ra[k], rb[k])
    assert all(r["clip_frac"] > 0 and r["kl"] > 0 for r in b)


def test_cp_config_errors(tmp_path):
    with pytest.raises(ValueError, match="context_parallel_degree > 1 needs harts.enabled"):
        load_config(None, **{"parallelism.context_parallel_degree": 2, "harts.enabled": False})
    with pytest.raises(ValueError, match="context_parallel_degree = 0"):
        load_config(None, **{"parallelism.context_parallel_degree": 0})
