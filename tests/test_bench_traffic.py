"""benchmarks.traffic: the byte rules on hand-made ops, and the whole count on a tiny planned step (meta
tensors: the real shapes cost nothing)."""
import json

import pytest
import torch

from benchmarks import traffic


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_bytes_of_gathers_scatters_and_copies():
    x, idx = _meta(100, 8), torch.arange(10, device="meta")
    with traffic.TrafficCounter() as c:
        y = x.index_select(0, idx)  # 10 rows read, 10 written
        x.index_add_(0, idx, y)  # 10 source rows read, 10 target rows read and written
        x[5:20].copy_(x[30:45])  # 15 rows read, 15 written
        x[5:20] += x[5:20]  # add_ in place (read twice, written once); the setitem copy onto itself is free
        x[0:0].zero_()  # empty: no launch
    row = 8 * 2
    assert c.bytes[("index_select", "?")] == 2 * 10 * row
    assert c.bytes[("index_add_", "?")] == 3 * 10 * row
    assert c.bytes[("copy_", "?")] == 2 * 15 * row and c.launches[("copy_", "?")] == 1
    assert c.bytes[("add_", "?")] == 3 * 15 * row
    assert c.total_launches == 4


def test_grad_heads_first_is_the_padded_rows_heads_first():
    from harts.ops.attention.split import _grad_heads_first, _heads_first, _rows, _stacked

    do = torch.randn(40, 3, 5, dtype=torch.float64)
    want = _heads_first(_rows(do[7:19], 4, 20)).contiguous()
    got = _grad_heads_first(do, ((7, 12),), 4, 20)
    assert got.is_contiguous() and torch.equal(got, want)
    spans = ((0, 5), (9, 6), (30, 10))
    assert torch.equal(_grad_heads_first(do, spans, 0, 24), _heads_first(_stacked(do, spans, 24)).contiguous())


def test_tiny_step_counts_both_paths_and_adds_up(tmp_path):
    args = ["--preset", "ling3-tiny", "--workload", "tiny", "--scale", "1", "--capacity", "128",
            "--microbatches", "2", "--device", "cpu", "--out", str(tmp_path)]
    assert traffic.main(args) == 0
    res = json.loads((tmp_path / "traffic.json").read_text())
    from benchmarks.flops import mixer_geometry
    from harts.models.family import model_config

    geo = mixer_geometry(model_config("ling3-tiny"))
    for mb in res["microbatches"]:
        lay, tot = mb["per_layer_fwd_bwd"], mb["microbatch"]
        assert lay["mla_harts_bytes"] > 0 and lay["kda_harts_bytes"] > 0 and lay["mla_baseline_bytes"] > 0
        # full recomputation: every layer's forward twice, so the microbatch is more than layers x (fwd + bwd)
        once = geo["attention_layers"] * lay["mla_harts_bytes"] + geo["linear_layers"] * lay["kda_harts_bytes"]
        assert tot["harts_bytes"] > once
        ideal = tot["baseline_bytes"] * mb["compact"] / mb["raw"]
        assert tot["excess_bytes"] == pytest.approx(tot["harts_bytes"] - ideal)
        # the dense kernels are stand-ins: no attention op is counted
        assert all("attention" not in t["op"] for t in mb["top"])


def test_refuses_a_model_without_mla(capsys):
    with pytest.raises(SystemExit):
        traffic.main(["--preset", "qwen3.5-debug", "--device", "cpu"])
    assert "Ling-3.0" in capsys.readouterr().err
