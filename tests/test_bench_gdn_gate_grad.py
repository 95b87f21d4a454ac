"""benchmarks.gdn_gate_grad at its CPU smoke settings (Triton interpreter, float32, float64 truth)."""
import json

from benchmarks import gdn_gate_grad


def test_gdn_gate_grad_bench_cpu(tmp_path, fla_interpreter_patches):
    """The bench runs every implementation; the float32 per-token recurrence and chunk_gdn_round have an
    accurate gate gradient at a fast decay, fla's kernel (pinned 0.6.0) does not (its dg cancels O(1) terms),
    and every error is rounding-sized against the whole backward."""
    assert gdn_gate_grad.main(["--device", "cpu", "--T", "64", "--log-decays", "-20", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gdn_gate_grad.json").read_text())
    assert [r["log_decay"] for r in res["rows"]] == [-20.0]  # slow decays: tests/test_ops_gdn_gate_grad.py
    for row in res["rows"]:
        for impl in gdn_gate_grad.IMPLS:
            for n in gdn_gate_grad.GRAD_NAMES:
                assert row[impl][n]["rel_all"] < 1e-5, (row["log_decay"], impl, n, row[impl][n])
                if n != "g":
                    assert row[impl][n]["rel"] < 1e-5, (row["log_decay"], impl, n, row[impl][n])
        for impl in ("ref32", "gdn_round"):
            assert row[impl]["g"]["rel"] < 1e-3, (row["log_decay"], impl, row[impl]["g"])
    fast = res["rows"][0]
    assert fast["true_norms"]["g"] < 1e-6 * fast["true_norms"]["q"]  # the true gate gradient is tiny there
    assert fast["fla"]["g"]["rel"] > 1.0  # the control: fla's own kernel loses it
