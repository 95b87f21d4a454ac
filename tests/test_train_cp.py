"""Context parallelism in the trainer on gloo, float64, against one process.

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

The two-process runs share one torchrun, and so do the four-process runs (``helpers.torchrun_many``).
"""
import pytest

from harts.train.config import load_config
from harts.train.trainer import Trainer
from tests.helpers import (
    DIST_BASE,
    assert_same_run,
    one_process_reference,
    records,
    torchrun_many,
    write_ppo_steps,
)

PPO = {"rl.objective": "ppo", "rl.advantages": "data", "rl.kl_coef": 0.1, "training.steps": 2}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The one-process references: the base config, and a PPO + KL config on two JSONL steps."""
    d = tmp_path_factory.mktemp("cp")
    cfg, one = one_process_reference(d)
    paths = [f'"{p}"' for p in write_ppo_steps(d, seed=20)]
    ppo = d / "ppo.toml"
    data = f'reward = "data"\nsource = "jsonl"\npath = [{", ".join(paths)}]'
    ppo.write_text(DIST_BASE.replace('reward = "learnable"', data))
    Trainer(load_config(str(ppo), **PPO, **{"job.dump_folder": str(d / "one_ppo"), "checkpoint.enable": False})).train()
    return d, cfg, one, ppo


@pytest.fixture(scope="module")
def two(ref):
    d, cfg, _, ppo = ref
    torchrun_many([(cfg, d / "cp2", ["--parallelism.context_parallel_degree=2",
                                     "--activation_checkpoint.mode=full"], {}),
                   (ppo, d / "cp2_ppo", ["--parallelism.context_parallel_degree=2",
                                         *(f"--{k}={v}" for k, v in PPO.items())], {})], nproc=2)
    return d


@pytest.fixture(scope="module")
def four(ref):
    d, cfg, _, _ = ref
    torchrun_many([(cfg, d / "dp_cp_ep", ["--parallelism.data_parallel_shard_degree=2",
                                          "--parallelism.context_parallel_degree=2",
                                          "--parallelism.expert_parallel_degree=4"], {}),
                   (cfg, d / "cp4", ["--parallelism.context_parallel_degree=4",
                                     "--parallelism.expert_parallel_degree=4"], {})], nproc=4)
    return d


@pytest.mark.slow
def test_cp2_equals_one_process(ref, two):
    one = ref[2]
    assert_same_run(one, two / "cp2")
    recs = records(two / "cp2")
    assert all((r["world"], r["dp"], r["cp"]) == (2, 1, 2) for r in recs)
    # every rank sees the same microbatches: the step's raw/compact counts are not doubled
    assert [r["compact_rows"] for r in recs] == [r["compact_rows"] for r in records(one)]


@pytest.mark.slow
def test_fsdp2_x_cp_x_ep_four_processes(ref, four):
    """dp_shard 2 x cp 2 (FSDP2 over the four ranks), EP = 4 spanning dp_shard x cp."""
    assert_same_run(ref[2], four / "dp_cp_ep")
    assert all((r["world"], r["dp"], r["cp"], r["ep"]) == (4, 2, 2, 4) for r in records(four / "dp_cp_ep"))


@pytest.mark.slow
def test_cp4_x_ep4_four_processes(ref, four):
    assert_same_run(ref[2], four / "cp4")
    assert all((r["world"], r["dp"], r["cp"], r["ep"]) == (4, 1, 4, 4) for r in records(four / "cp4"))


@pytest.mark.slow
def test_ppo_with_kl_cp2_equals_one_process(ref, two):
    """PPO-clip + k3 KL with old/ref log-probs from JSONL (two files, one per step) at cp = 2: each CP rank
    evaluates the objective on its own positions only (l(log p = 0) != 0 here, so zero-masking the
    partial log-probs would be wrong), and the losses, clip fraction and KL add up over the group."""
    d = ref[0]
    assert_same_run(d / "one_ppo", two / "cp2_ppo",
                    keys=("loss", "policy_loss", "kl", "clip_frac", "router_loss", "grad_norm"))
    b = records(two / "cp2_ppo")
    assert [r["step"] for r in b] == [1, 2] and all(r["cp"] == 2 for r in b)
    assert all(r["clip_frac"] > 0 and r["kl"] > 0 for r in b)


def test_cp_config_errors(tmp_path):
    with pytest.raises(ValueError, match="context_parallel_degree > 1 needs harts.enabled"):
        load_config(None, **{"parallelism.context_parallel_degree": 2, "harts.enabled": False})
    with pytest.raises(ValueError, match="context_parallel_degree = 0"):
        load_config(None, **{"parallelism.context_parallel_degree": 0})
