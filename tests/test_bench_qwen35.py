"""The benchmarks on the Qwen3.5 model (debug preset, CPU) against independent counts.

- FLOPs: the active matmul parameters and every per-layer coefficient derived by hand from the HF
  architecture (GDN projections, gated attention with its output gate, softmax MoE with a gated shared
  expert), attention pairs and linear-core positions from the brute-force set of distinct prefixes.
- speedup / fidelity: a qwen3.5-debug run builds Qwen35ForCausalLM; rows and compression equal the distinct
  prefixes of the timed microbatches; in float32 every fidelity path agrees with Baseline A to rounding; a
  saved Qwen3.5 checkpoint decides the model over the preset.
- gdn_round: fork requests equal a pairwise brute force; on the reference backend (float64) the bench's
  numbers are consistent with its own timings and its numerics check finds both cores exact.
"""
import json

import numpy as np
import pytest
import torch

from benchmarks.flops import active_matmul_params, batch_forward_flops
from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
from harts.runtime import pack
from tests.test_bench_flops import _trajs


def _prefixes(trajs) -> set:
    return {tuple(t[: i + 1]) for t in trajs for i in range(len(t))}


def _meta_model(cfg):
    with torch.device("meta"):
        return Qwen35ForCausalLM(cfg)


def test_qwen35_flops_by_hand():
    cfg = Qwen35Config.preset("qwen3.5-debug")
    model = _meta_model(cfg)
    D, H, G, Dh, Hk, HV, Dk, Dv = 64, 4, 2, 16, 2, 4, 16, 16
    E, top, Fe, Fs, vocab, C, W = 8, 2, 32, 32, 512, 16, 4
    gdn_layer = D * (2 * Hk * Dk + HV * Dv) + D * HV * Dv + 2 * D * HV + HV * Dv * D  # qkv, z, b, a, out
    attn_layer = D * H * Dh * 2 + 2 * D * G * Dh + H * Dh * D  # q + gate, k, v, o
    moe_layer = E * D + top * 3 * Fe * D + 3 * Fs * D + D  # router, routed top-k, shared expert, its gate
    assert active_matmul_params(model) == 6 * gdn_layer + 2 * attn_layer + 8 * moe_layer + vocab * D

    trajs = _trajs(0)
    prefixes = _prefixes(trajs)
    hb, bb = pack(trajs, config=cfg), pack(trajs, config=cfg, prefix_sharing=False)
    fh, fb = batch_forward_flops(model, hb), batch_forward_flops(model, bb)
    per_pair = 2 * H * (Dh + Dh)
    gdn_per_position = HV * (4 * C * Dk + 3 * C * Dv + 6 * Dk * Dv)
    conv_per_position = 2 * (2 * Hk * Dk + HV * Dv) * W
    positions = len(prefixes) + hb.stats["replay_tokens"]
    # HARTS: each distinct prefix is one row whose query attends its own path
    assert fh["attention"] == 2 * per_pair * sum(len(p) for p in prefixes)
    assert fh["kda"] == 6 * positions * gdn_per_position and fh["conv"] == 6 * positions * conv_per_position
    raw = sum(len(t) for t in trajs)
    assert fb["attention"] == 2 * per_pair * sum(len(t) * (len(t) + 1) // 2 for t in trajs)
    assert fb["kda"] == 6 * raw * gdn_per_position and fb["matmul"] == 2 * active_matmul_params(model) * raw


def test_speedup_qwen35_debug(tmp_path):
    from benchmarks.speedup import main, planned_microbatches

    assert main(["--preset", "qwen3.5-debug", "--workload", "tiny", "--capacity", "128", "--microbatches", "2",
                 "--device", "cpu", "--dtype", "float64", "--no-profile", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "speedup.json").read_text())
    assert r["model"] == "Qwen35ForCausalLM" and "profile" not in r

    class A:
        preset, workload, seed, scale, capacity, microbatches = "qwen3.5-debug", "tiny", 0, 0.2, 128, 2
    mbs, _, _ = planned_microbatches(A)
    arrays = [[t.tokens.tolist() for t in m] for m in mbs]
    raw = sum(len(t) for m in arrays for t in m)
    compact = sum(len(_prefixes(m)) for m in arrays)
    assert (r["raw_rows"], r["compact_rows"]) == (raw, compact) and r["compression"] == raw / compact > 1
    assert r["speedup_fbgrad"] == r["fbgrad_baseline_s"] / r["fbgrad_harts_s"]
    assert r["flop_compression"] == r["forward_flops_baseline"] / r["forward_flops_harts"] > 1
    # --flops-only counts the same microbatches on a meta-device model
    assert main(["--flops-only", "--preset", "qwen3.5-debug", "--workload", "tiny", "--capacity", "128",
                 "--microbatches", "2", "--device", "cpu", "--out", str(tmp_path)]) == 0
    f = json.loads((tmp_path / "speedup_flops.json").read_text())
    assert (f["raw_rows"], f["compact_rows"]) == (raw, compact)
    assert (f["forward_flops_harts"], f["forward_flops_baseline"]) == (r["forward_flops_harts"],
                                                                       r["forward_flops_baseline"])


def test_fidelity_qwen35_checkpoint_cpu_fp32(tmp_path):
    """The checkpoint's config.json decides the model (the default --preset is a Ling one)."""
    from benchmarks import fidelity
    from benchmarks.common import build_model

    build_model("qwen3.5-debug", "cpu", torch.float32, seed=3).save_pretrained(tmp_path / "ckpt")
    assert fidelity.main(["--checkpoint", str(tmp_path / "ckpt"), "--workload", "tiny", "--device", "cpu",
                          "--dtype", "float32", "--scale", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fidelity.json").read_text())
    assert res["model"] == "Qwen35ForCausalLM"
    assert all(abs(c - 1) < 1e-6 for c in res["mean_token_cosine"].values()), res["mean_token_cosine"]
    assert res["tokens_by_depth"][1] > 0  # some positions behind a state handoff
    for name, per_depth in res["symkl_by_depth"].items():
        assert all(0 <= x < 1e-8 for x in per_depth), (name, per_depth)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fork_requests_match_pairwise_brute_force(seed):
    from benchmarks.gdn_round import fork_requests

    trajs = _trajs(seed) + [_trajs(seed)[1][:50]]  # a prefix trajectory ending inside another's path
    arrays = [np.asarray(t) for t in trajs]
    for chunk in (4, 16):
        want = set()
        for i, a in enumerate(trajs):
            for j, b in enumerate(trajs):
                m = next((p for p in range(min(len(a), len(b))) if a[p] != b[p]), min(len(a), len(b)))
                if i != j and m < len(a) and m < len(b) and m // chunk > 0:
                    want.add((i, m // chunk))
        seq, chk = fork_requests(arrays, chunk)
        assert len(seq) == len(set(zip(seq, chk))) and set(zip(seq, chk)) == want and want


def test_gdn_round_bench_reference_backend(tmp_path):
    from benchmarks import gdn_round

    assert gdn_round.main(["--preset", "qwen3.5-debug", "--workload", "tiny", "--capacity", "256", "--max-tokens",
                           "200", "--backend", "reference", "--reps", "1", "--warmup", "0", "--rounds", "1",
                           "--check-tokens", "64", "--noise-factor", "100", "--device", "cpu", "--dtype", "float64",
                           "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "gdn_round.json").read_text())
    ms = r["ms"]
    assert set(ms) == {"fla", "fla_rep", "round", "round_states", "rounds", "rounds_fla_pieces", "fla_fwd", "round_fwd",
                       "round_states_fwd", "round_fla_pieces", "round_fla_pieces_states", "round_fla_pieces_fwd",
                       "round_fla_pieces_states_fwd"}
    assert r["round_over_fla"] == ms["round"] / ms["fla"] and r["fla_backward_refused"] is None
    assert r["round_states_over_fla"] == ms["round_states"] / ms["fla"]
    assert r["rounds_speedup_over_trajectory_wise"] == ms["round"] / ms["rounds"]
    assert r["rounds_fla_pieces_speedup_over_trajectory_wise"] == ms["round_fla_pieces"] / ms["rounds_fla_pieces"]
    assert (r["key_heads"], r["value_heads"], r["key_dim"], r["chunk"]) == (2, 4, 16, 16)
    assert r["requested_states"] > 0 and r["plan"]["boundary_states"] > 0
    p = r["plan"]
    assert p["compression"] == p["trajectory_wise_rows"] / p["compact_rows"] > 1
    assert p["round_positions"] == p["compact_rows"] + p["replay_rows"]
    nm = r["numerics"]
    assert nm["ok"] and nm["sequences"] == min(4, r["trajectories"]) == 2 and nm["rows"] <= 64
    assert len(nm["fla"]) == len(nm["round"]) == 6
    assert max(nm["fla"] + nm["round"]) < 1e-12  # float64 pure-torch cores against the float64 truth


def test_gdn_round_bench_when_fla_refuses_its_backward(tmp_path, monkeypatch):
    """fla 0.6.0 refuses the GDN backward on Hopper with Triton < 3.7.1 (its module flag
    ``chunk_o.TRITON_ABOVE_3_7_1`` false): the bench then times fla's forward + backward with that flag lifted,
    judges the round variants' outputs against fla's and their gradients against each other, reports the
    lifted fla's gradient errors without using them as a reference, and says so."""
    from fla.ops.common import chunk_o

    from benchmarks import gdn_round

    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)

    class Refuse(torch.autograd.Function):  # refuses as fla does: reads the flag when the backward runs
        @staticmethod
        def forward(ctx, o):
            return o.clone()

        @staticmethod
        def backward(ctx, do):
            if not chunk_o.TRITON_ABOVE_3_7_1:
                raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for "
                                   "gated chunk_bwd_dqkwg")
            return do

    core_fla = gdn_round.core_fla
    monkeypatch.setattr(gdn_round, "core_fla", lambda *a, **kw: Refuse.apply(core_fla(*a, **kw)))
    assert gdn_round.main(["--preset", "qwen3.5-debug", "--workload", "tiny", "--capacity", "256", "--max-tokens",
                           "200", "--backend", "reference", "--reps", "1", "--warmup", "0", "--rounds", "1",
                           "--check-tokens", "32", "--noise-factor", "100", "--device", "cpu", "--dtype", "float64",
                           "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "gdn_round.json").read_text())
    assert "chunk_bwd_dqkwg" in r["fla_backward_refused"] and r["fla_backward_guard_lifted"]
    assert chunk_o.TRITON_ABOVE_3_7_1 is False  # restored after every lifted call
    assert r["round_over_fla"] == r["ms"]["round"] / r["ms"]["fla"]
    assert r["round_fla_pieces_over_fla"] == r["ms"]["round_fla_pieces"] / r["ms"]["fla"]
    assert r["round_fwd_over_fla_fwd"] == r["ms"]["round_fwd"] / r["ms"]["fla_fwd"]
    nm = r["numerics"]
    assert not nm["fla_grads"] and nm["fla"][1:] == [None] * 5 and nm["within_noise"][1:] == [None] * 5
    assert nm["grad_floor_from"] == "round" and len(nm["fla_guard_lifted"]) == 6
    assert max(nm["fla_guard_lifted"]) < 1e-12  # the reference core under the mock: exact, reported only
    assert nm["ok"] and nm["within_noise"][0] and max(nm["round"]) < 1e-12


@pytest.mark.gpu_bench
def test_gdn_round_bench_gpu_numerics(tmp_path):
    """On the GPU, the Triton round kernel with the broadcast decay and fla's GDN kernel on qwen3.5-8l shapes:
    both within bf16 noise of the float64 truth."""
    from benchmarks import gdn_round

    assert gdn_round.main(["--preset", "qwen3.5-8l", "--workload", "swe-small", "--capacity", "8192", "--scale", "1",
                           "--max-tokens", "8192", "--reps", "1", "--warmup", "1", "--rounds", "1", "--check-tokens",
                           "512", "--device", "cuda", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "gdn_round.json").read_text())
    assert r["numerics"]["ok"], r["numerics"]
    assert all(v > 0 for v in r["ms"].values())
