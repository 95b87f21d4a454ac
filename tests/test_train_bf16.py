"""Pure-bf16 training through the trainer (model.dtype = bfloat16, CPU): the default optimizer keeps an fp32
master weight (bf16 weight + 16 low bits) that moves where torch's AdamW on the bf16 tensors does not; its
state survives a kill and resume bit for bit (distributed checkpoint); FSDP2 x EP on 2 gloo processes
tracks one process."""
from pathlib import Path

import pytest
import torch

from harts.train.bf16_adamw import BF16AdamW, _join
from harts.train.config import load_config
from harts.train.trainer import Trainer
from tests.helpers import DIST_BASE, DIST_STEPS, records, torchrun_many, weights

# the distributed tests' settings (DIST_STEPS steps, checkpoints every 2, HF export) with bf16 weights at lr 1e-5
BASE = DIST_BASE.replace('dtype = "float64"', 'dtype = "bfloat16"').replace("lr = 1e-3", "lr = 1e-5")


def _cfg(tmp_path) -> Path:
    p = tmp_path / "bf16.toml"
    p.write_text(BASE)
    return p


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """One process, default optimizer settings (fp32 master, torch-op update off CUDA): (config, trainer
    after training, its records), shared by the tests that compare against it."""
    d = tmp_path_factory.mktemp("bf16")
    cfg = _cfg(d)
    tr = Trainer(load_config(str(cfg), **{"checkpoint.enable": False, "job.dump_folder": str(d / "default")}))
    assert tr.model.model.norm.weight.dtype == torch.bfloat16 and bool((tr.model.model.norm.weight == 1).all())
    return cfg, tr, tr.train()


def _master(tr) -> torch.Tensor:
    """The fp32 master weights of every bf16 parameter, flattened."""
    opt = tr.optimizers.optimizers[0]
    return torch.cat([_join(p, opt.state[p]["low_bits"]).flatten() for p in tr.model.parameters()
                      if p.dtype == torch.bfloat16])


@pytest.mark.slow
def test_norm_weights_train_only_with_the_fp32_master(default_run, tmp_path):
    cfg, master, hist = default_run
    plain = Trainer(load_config(str(cfg), **{"optimizer.bf16_update": "plain", "checkpoint.enable": False,
                                             "job.dump_folder": str(tmp_path / "plain")}))
    assert bool((plain.model.model.norm.weight == 1).all())
    for tr, h in ((master, hist), (plain, plain.train())):
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in h)
    assert isinstance(master.optimizers.optimizers[0], BF16AdamW)
    assert not isinstance(plain.optimizers.optimizers[0], BF16AdamW)
    w = master.model.model.norm.weight
    # DIST_STEPS steps of ~1e-5 are below half a bf16 ulp of 1.0 (2^-8): plain AdamW never moves these
    # weights, the fp32 master does (Adam's normalised step: about lr per step)
    assert bool((plain.model.model.norm.weight == 1).all())
    moved = (_join(w, master.optimizers.optimizers[0].state[w]["low_bits"]) - 1).abs()
    assert 0.5e-5 * DIST_STEPS < moved.max() <= 1.25e-5 * DIST_STEPS, moved.max()


@pytest.mark.slow
def test_kill_and_resume_reproduces_the_bf16_run_exactly(tmp_path):
    cfg = _cfg(tmp_path)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    # the uninterrupted run, then (same process) the run killed after step 2's checkpoint; then the restart in
    # a new process, which has only the checkpoint (train.py's own restart under torchrun: test_train_distributed)
    torchrun_many([(cfg, whole, ["--checkpoint.enable"], {}),
                   (cfg, resumed, ["--checkpoint.enable", "--debug.exit_after_step=2"], {})], nproc=1)
    assert [r["step"] for r in records(resumed)] == [1, 2]
    torchrun_many([(cfg, resumed, ["--checkpoint.enable"], {})], nproc=1)
    a, b = records(whole), records(resumed)
    assert [r["step"] for r in b] == list(range(1, DIST_STEPS + 1)) and DIST_STEPS > 2
    for ra, rb in zip(a, b):
        assert (ra["loss"], ra["grad_norm"]) == (rb["loss"], rb["grad_norm"]), (ra["step"], ra, rb)
    wa, wb = weights(whole), weights(resumed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_fsdp2_x_ep_bf16_tracks_one_process(default_run, tmp_path):
    """FSDP2 (DP = 2) x EP = 2 with bf16 weights: the fp32 A_log/dt_bias stay out of FSDP (it needs one
    dtype per unit without a cast policy) and their gradients are summed over the mesh; BF16AdamW updates
    the bf16 shards. bf16 runs of different layouts round differently, so the bound is bf16-sized: one
    process vs two agree to about 6e-4 (loss) and 3e-3 (grad norm) relative; the bounds are 2e-3 and 2e-2."""
    cfg, _, a = default_run
    torchrun_many([(cfg, tmp_path / "two", ["--checkpoint.enable=false", "--parallelism.data_parallel_shard_degree=2",
                                             "--parallelism.expert_parallel_degree=2"], {})], nproc=2)
    b = records(tmp_path / "two")
    assert [r["step"] for r in b] == list(range(1, DIST_STEPS + 1)) and all((r["dp"], r["ep"]) == (2, 2) for r in b)
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 2e-3 * abs(ra["loss"]), (ra["step"], ra["loss"], rb["loss"])
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 2e-2 * ra["grad_norm"], (ra["step"], ra["grad_norm"],
                                                                                rb["grad_norm"])


@pytest.mark.slow
def test_fused_update_trains_like_the_torch_ops(default_run, tmp_path):
    """optimizer.bf16_fused = true (the Triton update, interpreted here) against the torch-op update through
    the trainer: DIST_STEPS steps, losses and master weights close (equal up to last-bit effects of the moments'
    bf16 rounding)."""
    cfg, ops, hist = default_run
    tr = Trainer(load_config(str(cfg), **{"optimizer.bf16_fused": True, "checkpoint.enable": False,
                                          "job.dump_folder": str(tmp_path / "fused")}))
    l1 = [r["loss"] for r in tr.train()]
    assert tr.optimizers.optimizers[0].fused and not ops.optimizers.optimizers[0].fused
    l0, m0, m1 = [r["loss"] for r in hist], _master(ops), _master(tr)
    assert max(abs(a - b) for a, b in zip(l0, l1)) <= 1e-3 * max(abs(x) for x in l0), (l0, l1)
    assert (m1 - m0).abs().max() <= 1e-6, (m1 - m0).abs().max()  # steps of lr 1e-5 each: ~3e-5 travelled


def test_fused_update_setting_auto_and_errors(tmp_path):
    """optimizer.bf16_fused: 'auto' (the default) picks the torch ops off CUDA; a value outside auto/true/false
    is an error that names the setting."""
    cfg = _cfg(tmp_path)
    tr = Trainer(load_config(str(cfg), **{"checkpoint.enable": False, "job.dump_folder": str(tmp_path / "a")}))
    assert tr.cfg.optimizer.bf16_fused == "auto" and tr.optimizers.optimizers[0].fused is False
    tr.close()
    with pytest.raises(ValueError, match="optimizer.bf16_fused = 'sometimes'"):
        Trainer(load_config(str(cfg), **{"optimizer.bf16_fused": "sometimes", "checkpoint.enable": False,
                                         "job.dump_folder": str(tmp_path / "b")}))
