"""benchmarks.gradgap: the shared-row masks against brute-force prefix matching, and HARTS vs baseline step
gradients equal part by part in float64 on CPU (the equality the GPU run's bf16 gap is measured against)."""
import numpy as np

from benchmarks import gradgap
from harts.data.synthetic import generate
from harts.train.config import load_config


def test_shared_masks_match_brute_force_prefix_matching():
    trajs = generate("tiny", seed=3, scale=1.0).trajectories
    masks = gradgap.shared_masks(trajs, chunk_size=16, conv_width=4)
    for i, (t, m) in enumerate(zip(trajs, masks)):
        assert m.shape == (len(t) - 1,)  # one entry per predicted position
        for j in range(len(t) - 1):
            # position j's row holds token j: shared iff another trajectory starts with the same j+1 tokens
            shared = any(k != i and len(u) > j and np.array_equal(u.tokens[:j + 1], t.tokens[:j + 1])
                         for k, u in enumerate(trajs))
            assert m[j] == shared, (i, j)
    assert 0 < sum(m.sum() for m in masks) < sum(len(m) for m in masks)  # both parts are exercised


def test_harts_and_baseline_gradients_agree_in_every_part_float64(tmp_path):
    cfg = load_config("configs/debug_cpu.toml", **{"model.dtype": "float64", "training.steps": 1,
                                                   "checkpoint.enable": False, "data.prefetch": 1,
                                                   "job.dump_folder": str(tmp_path)})
    res = gradgap.run(cfg, with_truth=True)  # the truth of an fp64 model is fp64: all three agree
    assert 0 < res["shared_positions"] < res["positions"]
    assert res["microbatches_baseline"] > res["microbatches_harts"] or res["trajectories"] > 1
    for part, r in res["parts"].items():
        assert r["norm_harts"] > 0.1, part
        for pair in ("harts_baseline", "harts_truth", "baseline_truth"):
            assert r[f"rel_{pair}"] < 1e-12, (part, pair, r)
            for g, q in r["groups"].items():
                assert q[f"rel_{pair}"] < 1e-10, (part, pair, g, q)
        # the groups partition the parameters
        assert {"KDA mixers", "MLA mixers", "routed experts", "router", "norms"} <= set(r["groups"])
        sq_groups = sum(q["norm_harts"] ** 2 for q in r["groups"].values())
        assert abs(sq_groups - r["norm_harts"] ** 2) <= 1e-9 * r["norm_harts"] ** 2
    assert "| shared |" in gradgap.table(res)


def test_bf16_paths_against_the_fp32_truth(tmp_path):
    """The truth path in a mixed setting: bf16 trainer (fp32 gradient accumulation), fp32 copy of its weights.
    Both bf16 gradients sit at bf16 distance from the truth, well below its norm."""
    cfg = load_config("configs/debug_cpu.toml", **{"model.dtype": "bfloat16", "training.steps": 1,
                                                   "checkpoint.enable": False, "data.prefetch": 1,
                                                   "job.dump_folder": str(tmp_path)})
    res = gradgap.run(cfg, parts=("all", "shared"), with_truth=True)
    for part, r in res["parts"].items():
        assert r["norm_truth"] > 0.1, part
        for path in ("harts", "baseline"):
            assert 1e-6 < r[f"rel_{path}_truth"] < 0.1, (part, path, r)
    assert "truth norm" in gradgap.table(res)


def test_bf16_depth_bench_runs_and_both_paths_sit_near_the_truth(tmp_path):
    """benchmarks.bf16_depth at a small size: both bf16 gradients a few percent from the fp32 one, and the
    JSON is written."""
    import json

    from benchmarks import bf16_depth

    assert bf16_depth.main(["--layers", "4", "--experts", "16", "--top-k", "4", "--length", "64",
                            "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bf16_depth.json").read_text())["depths"]["4"]
    for pair in ("harts_baseline", "harts_truth", "baseline_truth", "baseline_split_truth"):
        assert 1e-4 < r[f"rel_{pair}"] < 0.1, (pair, r)
    assert {"routed experts", "router", "KDA mixers"} <= set(r["groups"])


def test_bf16_depth_variants_are_the_same_gradient_in_float64():
    """The bench's four computations (HARTS, packed baseline, one trajectory per backward, truth) differ only
    by rounding: in float64 they agree."""
    import torch

    from benchmarks.bf16_depth import gradients_at_depth

    r = gradients_at_depth(4, 16, 4, 48, 0.75, low=torch.float64, high=torch.float64)
    for pair in ("harts_baseline", "harts_truth", "baseline_truth", "baseline_split_truth"):
        assert r[f"rel_{pair}"] < 1e-12, (pair, r[f"rel_{pair}"])
    assert r["norm_truth"] > 0


def test_compare_figures_match_numpy_on_flattened_vectors():
    """compare() accumulates per tensor and per group; check it against numpy on the concatenated vectors."""
    import torch

    from benchmarks.gradgap import compare

    g = torch.Generator().manual_seed(3)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    vec = {k: [torch.randn(s, generator=g) for s in shapes] for k in ("harts", "baseline", "truth")}
    pairs = [("harts", "baseline"), ("harts", "truth"), ("baseline", "truth")]
    out = compare(vec, pairs, groups=["x", "y", "x"])
    flat = {k: np.concatenate([t.double().numpy().ravel() for t in v]) for k, v in vec.items()}
    for a, b in pairs:
        na, nb = np.linalg.norm(flat[a]), np.linalg.norm(flat[b])
        assert np.isclose(out[f"diff_{a}_{b}"], np.linalg.norm(flat[a] - flat[b]))
        assert np.isclose(out[f"cos_{a}_{b}"], flat[a] @ flat[b] / (na * nb))
        assert np.isclose(out[f"proj_{a}_{b}"], flat[a] @ flat[b] / nb)
    x = {k: np.concatenate([vec[k][0].double().numpy().ravel(), vec[k][2].double().numpy().ravel()]) for k in vec}
    assert np.isclose(out["groups"]["x"]["norm_truth"], np.linalg.norm(x["truth"]))
    assert np.isclose(out["groups"]["x"]["proj_harts_truth"], x["harts"] @ x["truth"] / np.linalg.norm(x["truth"]))
