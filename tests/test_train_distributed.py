"""Multi-process trainer tests on gloo (torchrun, CPU processes) against one process, float64, 3 steps.

Every layout's loss / policy-loss / router-loss / grad-norm sequence equals the one-process run to 1e-10
relative and its final weights (incl. the expert bias, updated from counts summed over DP) to 1e-9 of each
tensor's scale. Layouts plan differently from one process (D = 2 vs D = 1, pipeline fills), so equality also
rests on the split-invariant objective. The runs of one process count share one torchrun
(``helpers.torchrun_many``):

- two processes: FSDP2 (DP = 2), also under selective checkpointing; EP = 2 (experts sharded over the DP
  ranks, tokens exchanged by all-to-all); PP = 2 with full activation checkpointing on steps planned as one
  microbatch and replanned to fill the two stages (harts.fill_pipeline); PP = 2 with PPO recomputing old
  log-probs; TP = 2 + SP dumping hidden states for benchmarks.layout_fidelity;
- four processes: FSDP2 x TP x EP (with AC), FSDP2 x PP x EP (PP at the default capacity), TP + SP x PP x EP
  (with AC);
- eight processes: the paper's three 8-GPU layouts at full degree (DP4 x TP2 + SP x EP8, DP2 x PP4 x EP2,
  DP2 x TP2 + SP x PP2 x EP4), compiled (aot_eager) under selective checkpointing, each rank initialising its
  own shards (model.init_on_meta);
- kill and resume: a run that exits right after step 2's checkpoint and is restarted reproduces the
  uninterrupted FSDP run's losses and final weights bit for bit.

All but the expert-order unit test are marked slow (CI runs them; ``-m 'not slow'`` skips them locally).
"""
import pytest
import torch

from harts.train.config import load_config
from harts.train.trainer import Trainer
from tests.helpers import DIST_STEPS, assert_same_run, one_process_reference, records, torchrun, torchrun_many, weights

# A capacity above a whole step's raw tokens (at most 360 here), so each step plans as one microbatch before
# harts.fill_pipeline splits it; the pipeline's static activations are padded to the capacity, so it stays small.
FILL_CAPACITY = 1024
PP_PPO = ["--rl.objective=ppo", "--rl.old_logprobs=recompute", "--rl.advantages=grpo"]
TWO = {  # name -> extra arguments ({d}: the runs' folder)
    "fsdp": ["--checkpoint.enable"],
    "fsdp_sac": ["--activation_checkpoint.mode=selective"],
    "ep": ["--parallelism.expert_parallel_degree=2"],
    "ppfill": ["--parallelism.pipeline_parallel_degree=2", "--activation_checkpoint.mode=full",
               f"--harts.capacity={FILL_CAPACITY}"],
    "pp_ppo": ["--parallelism.pipeline_parallel_degree=2", *PP_PPO],
    "fid_tp": ["--parallelism.tensor_parallel_degree=2", "--parallelism.enable_sequence_parallel=true",
               "--parallelism.data_parallel_shard_degree=1", "--training.steps=1", "--debug.dump_hidden={d}/tp"],
    # tensor parallelism with sequence parallelism, selective checkpointing and compiled regions (aot_eager)
    "tp_sp_sac_compile": ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                          "--parallelism.enable_sequence_parallel=true", "--activation_checkpoint.mode=selective",
                          "--compile.enable=true", "--compile.backend=aot_eager"],
    # expert parallelism under selective checkpointing, and compiled (aot_eager; the MoE regions break their
    # graph around the all-to-all)
    "ep_sac": ["--parallelism.expert_parallel_degree=2", "--activation_checkpoint.mode=selective"],
    "ep_compile": ["--parallelism.expert_parallel_degree=2", "--activation_checkpoint.mode=none",
                   "--compile.enable=true", "--compile.backend=aot_eager"],
    # killed right after step 2's checkpoint (the process ends there, so this run comes last)
    "resume": ["--checkpoint.enable", "--debug.exit_after_step=2"],
}
FOUR = {
    "fsdp_tp_ep": ["--parallelism.tensor_parallel_degree=2", "--parallelism.expert_parallel_degree=4",
                   "--activation_checkpoint.mode=full"],
    "dp_pp_ep": ["--parallelism.pipeline_parallel_degree=2", "--parallelism.expert_parallel_degree=2"],
    "tp_pp_ep": ["--parallelism.tensor_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2",
                 "--parallelism.expert_parallel_degree=2", "--parallelism.enable_sequence_parallel=true",
                 "--activation_checkpoint.mode=full"],
}
# The paper's three 8-GPU layouts (Table 4) at full degree on eight gloo processes, debug-size model: the
# meshes, placements and schedules of the 8-GPU configs, against one process.
LAYOUTS_8 = {
    "dp4_tp2_sp_ep8": (dict(dp=4, tp=2, pp=1, ep=8), ["--parallelism.data_parallel_shard_degree=4",
                       "--parallelism.tensor_parallel_degree=2", "--parallelism.enable_sequence_parallel=true",
                       "--parallelism.expert_parallel_degree=8"]),
    "dp2_pp4_ep2": (dict(dp=2, tp=1, pp=4, ep=2), ["--parallelism.data_parallel_shard_degree=2",
                    "--parallelism.pipeline_parallel_degree=4", "--parallelism.expert_parallel_degree=2"]),
    "dp2_tp2_sp_pp2_ep4": (dict(dp=2, tp=2, pp=2, ep=4), ["--parallelism.data_parallel_shard_degree=2",
                           "--parallelism.tensor_parallel_degree=2", "--parallelism.enable_sequence_parallel=true",
                           "--parallelism.pipeline_parallel_degree=2", "--parallelism.expert_parallel_degree=4"]),
}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The one-process reference run (and config) every layout must equal."""
    d = tmp_path_factory.mktemp("dist")
    cfg, one = one_process_reference(d)
    return d, cfg, one


@pytest.fixture(scope="module")
def two(ref):
    d, cfg, _ = ref
    torchrun_many([(cfg, d / name, [a.format(d=d) for a in args], {}) for name, args in TWO.items()], nproc=2)
    return d


@pytest.fixture(scope="module")
def four(ref):
    d, cfg, _ = ref
    torchrun_many([(cfg, d / name, args, {}) for name, args in FOUR.items()], nproc=4)
    return d


@pytest.fixture(scope="module")
def eight(ref):
    d, cfg, _ = ref
    torchrun_many([(cfg, d / name, ["--checkpoint.enable", "--activation_checkpoint.mode=selective",
                                    "--compile.enable=true", "--compile.backend=aot_eager",
                                    "--model.init_on_meta=true", *args], {}) for name, (_, args) in LAYOUTS_8.items()],
                  nproc=8)
    return d


@pytest.mark.slow
def test_fsdp2_two_processes_equal_one(ref, two):
    assert_same_run(ref[2], two / "fsdp")
    assert [r["step"] for r in records(two / "fsdp")] == list(range(1, DIST_STEPS + 1))
    assert all((r["world"], r["dp"], r["ep"]) == (2, 2, 1) for r in records(two / "fsdp"))
    assert any("expert_bias" in k and v.abs().sum() > 0 for k, v in weights(two / "fsdp").items())


@pytest.mark.slow
def test_fsdp2_with_selective_checkpointing_equals_one_process(ref, two):
    """Selective checkpointing runs each layer as regions; the layer is still called as a module, so FSDP2's
    per-layer hooks gather its parameters for the forward and the recomputation."""
    assert_same_run(ref[2], two / "fsdp_sac")


@pytest.mark.slow
def test_tensor_parallel_compiled_with_selective_checkpointing_equals_one_process(ref, two):
    """TP2 + SP with the layers compiled (aot_eager) under selective checkpointing: the layer runs on local
    parameter views, its regions cross the TP boundaries as module hooks, and a recomputation sees the same
    views (harts.train.tensor_parallel)."""
    assert_same_run(ref[2], two / "tp_sp_sac_compile")
    assert all(r["tp"] == 2 for r in records(two / "tp_sp_sac_compile"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep_sac", "ep_compile"])
def test_expert_parallel_with_selective_checkpointing_or_compile_equals_one_process(ref, two, name):
    """EP2 is a parallel style around the experts module: its dispatch and combine hooks run inside the
    selectively checkpointed regions (again in their recomputation) and inside the compiled ones."""
    assert_same_run(ref[2], two / name)
    assert all(r["ep"] == 2 for r in records(two / name))


@pytest.mark.slow
def test_expert_parallel_equals_one_process(ref, two):
    assert_same_run(ref[2], two / "ep")
    assert all((r["world"], r["dp"], r["ep"]) == (2, 2, 2) for r in records(two / "ep"))


@pytest.mark.slow
def test_pipeline_fill_with_activation_checkpointing(ref, two):
    """PP = 2 (two layer stages, padded static activations, GPipe when a step has fewer slots than stages,
    1F1B otherwise; forwards of later microbatches run before earlier backwards) with full AC. harts.capacity
    holds each whole step in one microbatch; under PP = 2 the trainer plans >= 2 per step
    (harts.fill_pipeline, so the stages can overlap) and still equals one process at the default capacity.
    (PP at the default capacity, and PP with AC there, run in the four- and eight-process layouts.)"""
    assert_same_run(ref[2], two / "ppfill")
    assert all(r["pp"] == 2 and r["microbatches"] >= 2 and r["raw_tokens"] <= FILL_CAPACITY
               for r in records(two / "ppfill"))


@pytest.mark.slow
def test_pipeline_parallel_ppo_recomputes_old_logprobs(ref, two):
    """PPO with old_logprobs = 'recompute' under PP = 2: a forward-only pipeline pass before each update
    (GPipe, no gradients) gives the last stage each microbatch's log-probs; equal to one process."""
    d, cfg, _ = ref
    one = d / "one_ppo"
    Trainer(load_config(str(cfg), **{"job.dump_folder": str(one), "checkpoint.enable": False,
                                     "rl.objective": "ppo", "rl.old_logprobs": "recompute"})).train()
    assert_same_run(one, two / "pp_ppo")
    assert all(r["pp"] == 2 and r["clip_frac"] == 0 for r in records(two / "pp_ppo"))  # ratio 1: nothing clipped


@pytest.mark.slow
def test_fsdp2_x_tp_x_ep_with_activation_checkpointing_four_processes(ref, four):
    """FSDP2 (DP = 2) x TP = 2 x EP = 4 (EP spans DP x TP: each TP rank dispatches its slice of the rows)
    on four processes, with full activation checkpointing: the paper's DP4/TP2/EP8 layout at half size."""
    assert_same_run(ref[2], four / "fsdp_tp_ep")
    assert all((r["world"], r["dp"], r["tp"], r["ep"]) == (4, 2, 2, 4) for r in records(four / "fsdp_tp_ep"))


@pytest.mark.slow
def test_fsdp2_x_pp_x_ep_four_processes(ref, four):
    """The paper's DP2/PP4/EP2 layout at half size: FSDP2 (DP = 2) x PP = 2 x EP = 2, default capacity."""
    assert_same_run(ref[2], four / "dp_pp_ep")
    recs = records(four / "dp_pp_ep")
    assert all((r["dp"], r["pp"], r["ep"]) == (2, 2, 2) for r in recs)


@pytest.mark.slow
def test_tp_sp_x_pp_x_ep_with_activation_checkpointing_four_processes(ref, four):
    """The paper's DP2/TP2/SP/PP2/EP4 layout without its DP dimension: TP = 2 with sequence parallelism
    (row shards between regions and stages) x PP = 2 x EP = 2, full AC, default capacity."""
    assert_same_run(ref[2], four / "tp_pp_ep")
    recs = records(four / "tp_pp_ep")
    assert all((r["tp"], r["pp"], r["ep"]) == (2, 2, 2) for r in recs) and max(r["microbatches"] for r in recs) >= 2


@pytest.mark.slow
def test_kill_and_resume_reproduces_the_run_exactly(ref, two):
    d, cfg, _ = ref
    out = two / "resume"
    assert [r["step"] for r in records(out)] == [1, 2] and not (out / "ckpt" / "hf").exists()
    torchrun(cfg, out, "--checkpoint.enable")
    a, b = records(two / "fsdp"), records(out)
    assert [r["step"] for r in b] == list(range(1, DIST_STEPS + 1)) and DIST_STEPS > 2
    for ra, rb in zip(a, b):
        assert (ra["loss"], ra["grad_norm"], ra["router_loss"]) == (rb["loss"], rb["grad_norm"], rb["router_loss"])
    wa, wb = weights(two / "fsdp"), weights(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS_8))
def test_paper_8gpu_layouts_on_eight_processes(ref, eight, layout):
    """Compiled regions (aot_eager) under selective activation checkpointing, as the GPU configs run them.
    Built on the meta device and initialised shard by shard on each rank
    (model.init_on_meta, as the GPU configs of these layouts): the one process initialised its whole model on
    the host, so this also checks that every rank's shards, and every replica of the replicated tensors, hold
    the one-process weights."""
    want, _ = LAYOUTS_8[layout]
    assert_same_run(ref[2], eight / layout)
    assert all(r["world"] == 8 and all(r[k] == v for k, v in want.items()) for r in records(eight / layout)), layout


@pytest.mark.parametrize("ep,El", [(1, 4), (2, 3), (4, 2)])
def test_expert_major_order_matches_a_brute_force_reordering(ep, El):
    """The EP dispatch's device-built permutation: rows arriving grouped by (source rank, local expert),
    some groups empty, must come out grouped by (local expert, source rank) with the arrival order kept
    inside each group."""
    import numpy as np
    import torch

    from harts.train.expert_parallel import expert_major_order as _expert_major_order

    g = torch.Generator().manual_seed(ep * 10 + El)
    counts = torch.randint(0, 4, (ep * El,), generator=g)
    counts[1] = 0  # an empty (rank, expert) group
    start = np.concatenate([[0], np.cumsum(counts.numpy())[:-1]])
    want = [int(start[r * El + j]) + i for j in range(El) for r in range(ep) for i in range(int(counts[r * El + j]))]
    got = _expert_major_order(counts, ep, El, int(counts.sum()))
    assert got.tolist() == want


@pytest.mark.slow
def test_layout_fidelity_dumps_equal_one_process_baseline(ref, two, tmp_path):
    """debug.dump_hidden + benchmarks.layout_fidelity (paper Table 5 under a layout): HARTS under TP2 + SP
    (both TP ranks dump the same gathered rows, which must agree) against the one-process trajectory-wise
    baseline, float64: logit cosine 1 and |delta NLL| at rounding level at every predicted position. Dumps
    of different position sets are refused, naming the mismatch."""
    from benchmarks import layout_fidelity as lf

    d, cfg, _ = ref
    base = tmp_path / "base"
    Trainer(load_config(str(cfg), **{"job.dump_folder": str(tmp_path / "one"), "checkpoint.enable": False,
                                     "training.steps": 1, "harts.enabled": False,
                                     "debug.dump_hidden": str(base)})).train()
    a, b = lf.load_run(str(base)), lf.load_run(str(two / "tp"))  # the two-process run "fid_tp" dumped there
    assert b["ranks"] == 2 and not a["harts"] and b["harts"]
    n_pred = sum(len(t) - 1 for t in Trainer(load_config(str(cfg), **{"job.dump_folder": str(tmp_path / "x"),
                                                                      "checkpoint.enable": False})).builder.load(1))
    assert a["keys"].shape[0] == n_pred  # every predicted position of the step, once
    res = lf.compare(a, b)
    assert res["positions"] == n_pred and res["min_cos"] > 1 - 1e-12
    assert res["mean_abs_dnll"] < 1e-10 and res["mean_symkl"] < 1e-20 and res["max_abs_dhidden"] < 1e-10
    assert lf.compare(a, a)["identical_positions"] == n_pred
    b["keys"], b["hidden"], b["targets"] = b["keys"][1:], b["hidden"][1:], b["targets"][1:]
    with pytest.raises(ValueError, match="1 only in A"):
        lf.compare(a, b)
