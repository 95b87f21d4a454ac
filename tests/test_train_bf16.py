"""Pure-bf16 training through the trainer (ling.dtype = bfloat16, CPU): the default optimizer keeps an fp32
master weight (bf16 weight + 16 low bits) that moves where torch's AdamW on the bf16 tensors does not; its
state survives a kill and resume bit for bit (distributed checkpoint); FSDP2 x EP on 2 gloo processes
tracks one process."""
from pathlib import Path

import torch

from harts.train.bf16_adamw import BF16AdamW, _join
from harts.train.config import load_config
from harts.train.trainer import Trainer
from tests.test_train_distributed import BASE as F64_BASE
from tests.test_train_distributed import records, torchrun, weights

# the distributed tests' settings (4 steps, checkpoints every 2, HF export) with bf16 weights at lr 1e-5
BASE = F64_BASE.replace('dtype = "float64"', 'dtype = "bfloat16"').replace("lr = 1e-3", "lr = 1e-5")


def _cfg(tmp_path) -> Path:
    p = tmp_path / "bf16.toml"
    p.write_text(BASE)
    return p


def test_norm_weights_train_only_with_the_fp32_master(tmp_path):
    cfg = _cfg(tmp_path)
    norms = {}
    for mode in ("fp32_master", "plain"):
        tr = Trainer(load_config(str(cfg), **{"optimizer.bf16_update": mode, "checkpoint.enable": False,
                                              "job.dump_folder": str(tmp_path / mode)}))
        w = tr.model.model.norm.weight
        assert w.dtype == torch.bfloat16 and bool((w == 1).all())
        hist = tr.train()
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in hist)
        opt = tr.optimizers.optimizers[0]
        assert isinstance(opt, BF16AdamW) == (mode == "fp32_master")
        norms[mode] = _join(w, opt.state[w]["low_bits"]) if mode == "fp32_master" else w.detach().float()
    # 4 steps of ~1e-5 are below half a bf16 ulp of 1.0 (2^-8): plain AdamW never moves these weights,
    # the fp32 master does (by about lr per step)
    assert bool((norms["plain"] == 1).all())
    moved = (norms["fp32_master"] - 1).abs()
    assert moved.max() > 2e-5 and moved.max() < 5e-5, moved.max()


def test_kill_and_resume_reproduces_the_bf16_run_exactly(tmp_path):
    cfg = _cfg(tmp_path)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    torchrun(cfg, whole, "--checkpoint.enable", nproc=1)
    torchrun(cfg, resumed, "--checkpoint.enable", "--debug.exit_after_step=2", nproc=1)
    assert [r["step"] for r in records(resumed)] == [1, 2]
    torchrun(cfg, resumed, "--checkpoint.enable", nproc=1)
    a, b = records(whole), records(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert (ra["loss"], ra["grad_norm"]) == (rb["loss"], rb["grad_norm"]), (ra["step"], ra, rb)
    wa, wb = weights(whole), weights(resumed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_fsdp2_x_ep_bf16_tracks_one_process(tmp_path):
    """FSDP2 (DP = 2) x EP = 2 with bf16 weights: the fp32 A_log/dt_bias stay out of FSDP (it needs one
    dtype per unit without a cast policy) and their gradients are summed over the mesh; BF16AdamW updates
    the bf16 shards. bf16 runs of different layouts round differently, so the bound is bf16-sized: one
    process vs two agreed to 5.8e-4 (loss) and 2.9e-3 (grad norm) relative when this was written."""
    cfg = _cfg(tmp_path)
    one = Trainer(load_config(str(cfg), **{"checkpoint.enable": False, "job.dump_folder": str(tmp_path / "one")}))
    a = one.train()
    torchrun(cfg, tmp_path / "two", "--checkpoint.enable=false", "--parallelism.data_parallel_shard_degree=2",
             "--parallelism.expert_parallel_degree=2")
    b = records(tmp_path / "two")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and all((r["dp"], r["ep"]) == (2, 2) for r in b)
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 2e-3 * abs(ra["loss"]), (ra["step"], ra["loss"], rb["loss"])
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 2e-2 * ra["grad_norm"], (ra["step"], ra["grad_norm"],
                                                                                rb["grad_norm"])


def test_fused_update_trains_like_the_torch_ops(tmp_path):
    """optimizer.bf16_fused = true (the Triton update, interpreted here) against the torch-op update through
    the trainer: 4 steps, losses and master weights close (equal up to last-bit effects of the moments'
    bf16 rounding)."""
    cfg = _cfg(tmp_path)
    out = {}
    for fused in (False, True):
        tr = Trainer(load_config(str(cfg), **{"optimizer.bf16_fused": fused, "checkpoint.enable": False,
                                              "job.dump_folder": str(tmp_path / f"fused{fused}")}))
        hist = tr.train()
        opt = tr.optimizers.optimizers[0]
        assert opt.fused == fused
        master = torch.cat([_join(p, opt.state[p]["low_bits"]).flatten() for p in tr.model.parameters()
                            if p.dtype == torch.bfloat16])
        out[fused] = ([r["loss"] for r in hist], master)
    (l0, m0), (l1, m1) = out[False], out[True]
    assert max(abs(a - b) for a, b in zip(l0, l1)) <= 1e-3 * max(abs(x) for x in l0), (l0, l1)
    assert (m1 - m0).abs().max() <= 1e-6, (m1 - m0).abs().max()  # 4 steps of lr 1e-5 each: 4e-5 travelled


def test_fused_update_setting_auto_and_errors(tmp_path):
    """optimizer.bf16_fused: 'auto' (the default) picks the torch ops off CUDA; a value outside auto/true/false
    is an error that names the setting."""
    import pytest

    cfg = _cfg(tmp_path)
    tr = Trainer(load_config(str(cfg), **{"checkpoint.enable": False, "job.dump_folder": str(tmp_path / "a")}))
    assert tr.cfg.optimizer.bf16_fused == "auto" and tr.optimizers.optimizers[0].fused is False
    tr.close()
    with pytest.raises(ValueError, match="optimizer.bf16_fused = 'sometimes'"):
        Trainer(load_config(str(cfg), **{"optimizer.bf16_fused": "sometimes", "checkpoint.enable": False,
                                         "job.dump_folder": str(tmp_path / "b")}))
