"""benchmarks.split_pieces on a CPU: the math pieces run the same plumbing (the plan's shared, causal and gathered
pieces, the baseline's per-trajectory calls, the unmasked backward both ways) as a smoke run."""
import json

import harts.ops.attention.split as split
from benchmarks.split_pieces import main


def test_split_pieces_smoke_on_cpu(tmp_path, monkeypatch):
    # a small threshold, so that the small workload's views read runs in place
    monkeypatch.setattr(split, "IN_PLACE_MIN_ROWS", 128)
    assert main(["--preset", "ling3-tiny-debug", "--workload", "swe-small", "--scale", "0.3", "--capacity", "8192",
                 "--microbatches", "2", "--microbatch", "largest", "--device", "cpu", "--dtype", "float32",
                 "--repeats", "1", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "split_pieces.json").read_text())
    assert r["smoke"] and r["device"] == "cpu"
    kinds = {c["kind"] for c in r["calls"]}
    assert {"shared", "causal", "baseline"} <= kinds, kinds
    shared = [c for c in r["calls"] if c["kind"] == "shared"]
    assert all("bwd_ms_unmasked" in c and "bwd_ms_as_causal" in c for c in shared)
    assert all(c["bwd_picked"] == "unmasked" for c in shared)  # the math piece's default
    # the split computes fewer pairs than the baseline (the small workload shares prefixes)
    assert r["summary"]["split"]["pairs"] < r["summary"]["baseline"]["pairs"]
