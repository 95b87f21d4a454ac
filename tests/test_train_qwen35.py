"""The trainer on Qwen3.5-MoE (``model.preset = "qwen3.5-debug"``, 4 layers: 3 GDN + 1 gated attention), float64,
reference ops, a truncated tiny workload.

- One process: two HARTS steps and two trajectory-wise baseline steps from the same seed give the same
  losses, router losses and gradient norms (1e-9 relative) and the same exported weights: HARTS ==
  trajectory-wise through the whole trainer (planner, packing, GDN rounds, tree attention, objective). The
  export is an HF folder that ``Qwen35ForCausalLM.from_pretrained`` reads back bit for bit and that
  ``model.load_hf`` starts a run from.
- Two gloo processes: the 8-GPU config's layout (FSDP2 + EP over all ranks), once with host init and once
  with each rank initialising its own shards (``model.init_on_meta``) and full activation checkpointing, two
  pipeline stages (PP2, full AC), context parallelism (CP2 with full AC; CP2 + EP2), and on four processes
  dp_shard 2 x CP2 x EP4, and tensor parallelism (TP2; TP2 + SP compiled under selective checkpointing), each
  equal the one-process run (losses, grad norms, final weights;
  ``helpers.assert_same_run``).
- One step with the layers compiled (aot_eager) under selective activation checkpointing equals the eager,
  uncheckpointed step (loss, router loss, gradient norm; float64).
- Settings Qwen3.5 has no implementation for (expert-bias updates) are refused by name, and so are head
  counts that context parallelism cannot split.
"""
import pytest
import torch

from harts.train.config import load_config
from harts.train.trainer import Trainer
from tests.helpers import COMMON, assert_same_run, records, torchrun_many, weights

# the shared float64 debug config with the Qwen3.5 debug model; no expert bias (softmax routing)
BASE = COMMON.replace('preset = "ling3-tiny-debug"', 'preset = "qwen3.5-debug"').replace(
    "expert_bias_rate = 1e-2", "expert_bias_rate = 0.0") + """[training]
steps = 2
[metrics]
log_freq = 1
disable_color_printing = true
[checkpoint]
export_hf = true
folder = "ckpt"
"""
assert 'preset = "qwen3.5-debug"' in BASE and "expert_bias_rate = 0.0" in BASE, "tests.helpers.COMMON changed"
FSDP_EP = ["--parallelism.data_parallel_shard_degree=2", "--parallelism.expert_parallel_degree=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The HARTS run (the reference every other run must equal) and its config path."""
    d = tmp_path_factory.mktemp("qwen35")
    cfg = d / "base.toml"
    cfg.write_text(BASE)
    tr = Trainer(load_config(str(cfg), **{"job.dump_folder": str(d / "harts")}))
    tr.train()
    return d, cfg, tr


def test_harts_equals_baseline_and_export_round_trips(runs):
    d, cfg, tr = runs
    Trainer(load_config(str(cfg), **{"job.dump_folder": str(d / "base"), "harts.enabled": False})).train()
    h, b = records(d / "harts"), records(d / "base")
    assert [r["step"] for r in h] == [1, 2]
    assert all(r["compression"] > 1.5 for r in h) and all(r["compression"] == 1 for r in b)
    assert all(r["microbatches"] >= 2 for r in h + b)
    assert all(r["router_loss"] > 0 for r in h)
    assert_same_run(d / "harts", d / "base", rel=1e-9, wrel=1e-9)

    from harts.models.qwen35 import Qwen35ForCausalLM

    hf = d / "harts" / "ckpt" / "hf"
    loaded = Qwen35ForCausalLM.from_pretrained(hf)
    own = tr.model.state_dict()
    assert set(loaded.state_dict()) == set(own)
    for k, v in loaded.state_dict().items():
        assert v.dtype == own[k].dtype == torch.float64 and torch.equal(v, own[k]), k
    start = Trainer(load_config(str(cfg), **{"job.dump_folder": str(d / "load"), "model.load_hf": str(hf)}))
    for k, v in start.model.state_dict().items():
        assert torch.equal(v, own[k]), k


# the two-process layouts: (extra arguments, the layout every record reports)
TWO = {"fsdp_ep": (FSDP_EP, dict(dp=2, cp=1, ep=2, pp=1)),
       "fsdp_ep_meta_ac": ([*FSDP_EP, "--model.init_on_meta=true", "--activation_checkpoint.mode=full"],
                           dict(dp=2, cp=1, ep=2, pp=1)),
       "pp_ac": (["--parallelism.pipeline_parallel_degree=2", "--activation_checkpoint.mode=full"],
                 dict(dp=1, cp=1, ep=1, pp=2)),
       # context parallelism: cp folded into FSDP2's dimension; with EP spanning dp_shard x cp
       "cp2_ac": (["--parallelism.context_parallel_degree=2", "--activation_checkpoint.mode=full"],
                  dict(dp=1, cp=2, ep=1, pp=1)),
       "cp2_ep2": (["--parallelism.context_parallel_degree=2", "--parallelism.expert_parallel_degree=2"],
                   dict(dp=1, cp=2, ep=2, pp=1)),
       # tensor parallelism (harts.train.tensor_parallel): eager, and with sequence parallelism, selective
       # activation checkpointing and compiled regions (aot_eager) together
       "tp2": (["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"],
               dict(dp=1, cp=1, ep=1, pp=1, tp=2)),
       "tp2_sp_sac_compile": (["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                               "--parallelism.enable_sequence_parallel=true", "--activation_checkpoint.mode=selective",
                               "--compile.enable=true", "--compile.backend=aot_eager"],
                              dict(dp=1, cp=1, ep=1, pp=1, tp=2)),
       # FSDP2 + EP2 with selective checkpointing and compiled regions (configs/qwen35_2gpu_ep2.toml's layout)
       "fsdp_ep_sac_compile": ([*FSDP_EP, "--activation_checkpoint.mode=selective", "--compile.enable=true",
                                "--compile.backend=aot_eager"], dict(dp=2, cp=1, ep=2, pp=1))}
CP = "--parallelism.context_parallel_degree=2"


@pytest.fixture(scope="module")
def two(runs):
    d, cfg, _ = runs
    torchrun_many([(cfg, d / n, args, {}) for n, (args, _) in TWO.items()], nproc=2)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO))
def test_two_process_layouts_equal_one(two, name):
    """FSDP2 + EP (host init; per-rank init on meta with full AC; with selective checkpointing and compiled
    regions), PP2 (full AC), CP2 (full AC), CP2 + EP2, TP2, and TP2 + SP with selective checkpointing and compiled
    regions, each on two gloo processes, equal the one-process run: losses, grad norms, final weights."""
    got = records(two / name)
    assert [r["step"] for r in got] == [1, 2]
    assert all(r["world"] == 2 and all(r[k] == v for k, v in TWO[name][1].items()) for r in got), name
    # the tensor-parallel layouts to the trainer's distributed bound (1e-10); the others keep 1e-9
    assert_same_run(two / "harts", two / name, rel=1e-10 if name.startswith("tp") else 1e-9, wrel=1e-9)
    if name.startswith("cp"):  # both CP ranks see every microbatch: the step's counts are not doubled
        assert [r["compact_rows"] for r in got] == [r["compact_rows"] for r in records(two / "harts")]
    if name == "fsdp_ep":
        assert any("mlp.experts.gate_up_proj" in k for k in weights(two / name))


@pytest.mark.slow
def test_fsdp2_x_cp_x_ep_four_processes_equal_one(runs):
    """dp_shard 2 x cp 2 (FSDP2 over the four ranks), EP = 4 spanning dp_shard x cp."""
    d, cfg, _ = runs
    args = ["--parallelism.data_parallel_shard_degree=2", CP, "--parallelism.expert_parallel_degree=4"]
    torchrun_many([(cfg, d / "dp_cp_ep", args, {})], nproc=4)
    got = records(d / "dp_cp_ep")
    assert all((r["world"], r["dp"], r["cp"], r["ep"]) == (4, 2, 2, 4) for r in got)
    assert_same_run(d / "harts", d / "dp_cp_ep", rel=1e-9, wrel=1e-9)


def test_compiled_selective_checkpointing_step_equals_eager(runs, tmp_path):
    """The trainer's compiled Qwen3.5 layers under selective activation checkpointing (aot_eager: the partitioner
    that applies the save policy, without inductor's C++ compile) give the eager, uncheckpointed first step."""
    d, cfg, _ = runs
    over = {"job.dump_folder": str(tmp_path / "sel"), "training.steps": 1, "compile.enable": True,
            "compile.backend": "aot_eager", "activation_checkpoint.mode": "selective", "checkpoint.export_hf": False}
    tr = Trainer(load_config(str(cfg), **over))
    assert tr.model.model.checkpoint_policy == "selective" and tr.model.compile_report is not None
    tr.train()
    a, b = records(d / "harts")[0], records(tmp_path / "sel")[0]
    for k in ("loss", "policy_loss", "router_loss", "grad_norm"):
        assert abs(a[k] - b[k]) <= 1e-12 * max(abs(a[k]), 1e-30), (k, a[k], b[k])
    assert 0 < tr.model.compile_report.compilations <= 2 * 4, tr.model.compile_report.summary()


@pytest.mark.parametrize("over, named", [
    ({"rl.expert_bias_rate": 1e-3}, "rl.expert_bias_rate"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, over, named):
    p = tmp_path / "base.toml"
    p.write_text(BASE)
    with pytest.raises(ValueError, match=r"qwen3\.5-debug.*Qwen3\.5-MoE") as e:
        Trainer(load_config(str(p), **{"job.dump_folder": str(tmp_path / "out"), **over}))
    assert named in str(e.value)


def test_cp_head_counts_that_do_not_split_are_named():
    """The trainer's CP check (before any mesh or weight) names each Qwen3.5 head count that tp x cp does not
    divide: the debug model's 2 GDN key heads at cp = 4; its 2 key/value attention heads need not divide."""
    from types import SimpleNamespace

    from harts.models.qwen35 import Qwen35Config

    mc = Qwen35Config.preset("qwen3.5-debug")
    me = SimpleNamespace(dims=SimpleNamespace(tp=1, cp=4), model_cfg=mc, cfg=SimpleNamespace(harts=SimpleNamespace(
        enabled=True)))
    with pytest.raises(ValueError, match=r"context_parallel_degree=4: linear_num_key_heads=2 must be divisible .* 4"):
        Trainer._check_cp(me)
    me.dims.cp = 2  # 4 query / 2 key / 4 value heads split two ways
    Trainer._check_cp(me)
    me.model_cfg = Qwen35Config.preset("qwen3.5-debug", num_key_value_heads=1)
    Trainer._check_cp(me)


@pytest.mark.parametrize("mode, forwards", [("none", 1), ("full", 2)])
def test_apply_ac_recomputes_qwen35_layers(mode, forwards):
    """The trainer's checkpointing reaches Qwen3.5's layers: under 'full' each layer's forward runs again in
    backward, under 'none' once (a setting that did nothing would run it once in both)."""
    from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
    from harts.train.parallelize import apply_ac

    cfg = Qwen35Config.preset("qwen3.5-debug", num_hidden_layers=4, backend="reference")
    torch.manual_seed(0)
    model = Qwen35ForCausalLM(cfg).double()
    apply_ac(model, mode)
    calls = []
    for layer in model.decoder_layers():
        layer.register_forward_pre_hook(lambda m, a: calls.append(m.layer_idx))  # early stop cuts the rerun short
    ids_T = torch.randint(3, cfg.vocab_size, (20,))
    pos_T = torch.cat([torch.arange(12), torch.arange(8)])
    model(ids_T, pos_T, torch.tensor([0, 12, 20])).square().sum().backward()
    assert sorted(calls) == sorted(list(range(4)) * forwards)
    with pytest.raises(ValueError, match="checkpoint_policy = 'partial'"):
        model.model.checkpoint_policy = "partial"
