"""The compact benchmark runs end to end on CPU and its fidelity block measures what it says: in fp32
both paths agree with a float64 run of the same weights, and the floor control is the baseline itself."""
import json

from benchmarks import compact


def test_compact_bench_cpu_fp32_against_float64_truth(tmp_path):
    rc = compact.main(["--preset", "ling3-tiny-debug", "--workload", "tiny", "--device", "cpu", "--dtype", "float32",
                       "--scale", "1", "--capacity", "4096", "--repeats", "0", "--truth", "float64",
                       "--truth-subbatches", "1000", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "compact.json").read_text())
    fid = res["fidelity"]
    assert set(fid) == {"harts_vs_baseline", "baseline_vs_baseline_floor", "harts_vs_float64_truth",
                        "baseline_vs_float64_truth", "harts_vs_baseline_on_truth_positions"}
    for name, f in fid.items():
        assert f["tokens"] == fid["harts_vs_baseline"]["tokens"] > 0, name
        assert f["cosine_min"] > 0.99999 and f["max_abs_dlogprob"] < 1e-3, (name, f)
    assert res["compact_rows"] < res["raw_tokens"]
    rt = res["routing"]  # fp32 vs the same math: no expert flips at all
    assert rt["moe_layers"] > 0 and max(rt["topk_differs_per_layer"]) == 0
    assert rt["positions_routed_identically_everywhere"] == 1.0
