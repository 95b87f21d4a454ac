"""The fidelity benchmark runs end to end on CPU: in fp32 every comparison path agrees with Baseline A to
rounding, the depth bins partition the compared positions, and the figure is written."""
import json

from benchmarks import fidelity


def test_fidelity_bench_cpu_fp32(tmp_path):
    assert fidelity.main(["--preset", "ling3-tiny-debug", "--workload", "tiny", "--device", "cpu", "--dtype",
                          "float32", "--scale", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fidelity.json").read_text())
    cos = res["mean_token_cosine"]
    assert set(cos) == {"baseline_B", "baseline_C", "baseline_D", "harts_replay", "harts_no_replay",
                         "harts_replay_recompute"}
    assert all(abs(c - 1) < 1e-6 for c in cos.values()), cos
    assert sum(res["tokens_by_depth"]) > 0 and res["tokens_by_depth"][1] > 0  # some positions behind a handoff
    for name, per_depth in res["symkl_by_depth"].items():
        assert len(per_depth) == 6 and all(0 <= x < 1e-8 for x in per_depth), (name, per_depth)
    assert (tmp_path / "fidelity.png").exists()
