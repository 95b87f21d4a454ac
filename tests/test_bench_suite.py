"""The benchmark suite's CPU smoke run writes one complete record per benchmark, and benchmarks/RESULTS.md
is exactly what its committed records generate."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from benchmarks import results, suite


def test_cpu_smoke_records_carry_date_commit_device_command(tmp_path):
    assert suite.main(["--out", str(tmp_path), "--cpu-smoke", "--only", "planner,kernels"]) == 0
    for name in ("planner", "kernels"):
        rec = json.loads((tmp_path / f"{name}.json").read_text())
        assert "error" not in rec, rec.get("error")
        assert rec["benchmark"] == name and rec["smoke"] is True
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", rec["date"])
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", rec["commit"])
        assert rec["device"].startswith("cpu")
        assert rec["command"].startswith(f"python -m benchmarks.{name} ")
        assert rec["raw"] and rec["values"]  # the module's JSON and its headline numbers
    # the planner's headline numbers are its own summary's, not recomputed
    rec = json.loads((tmp_path / "planner.json").read_text())
    summary = rec["raw"]["results"]["dp2"]["summary"]
    assert rec["values"]["dp2 harts: compact rows"] == summary["harts"]["compact"]
    # a smoke record measures nothing: the results page refuses it
    folder = tmp_path / "records"
    folder.mkdir()
    shutil.copy(tmp_path / "planner.json", folder / "planner.json")
    with pytest.raises(ValueError, match="planner.json.*cpu-smoke"):
        results.load_records(str(folder))


def test_unknown_benchmark_is_named():
    with pytest.raises(ValueError, match="nosuch"):
        suite.parse_only("model,nosuch")


def test_results_md_regenerates_byte_identically():
    with open(results.RESULTS_MD) as f:
        assert f.read() == results.render(results.load_records())


def test_every_committed_record_is_complete():
    recs = results.load_records()
    assert {r["benchmark"] for _, r in recs} >= {"model", "kernels", "speedup", "fidelity", "planner", "calls"}
    for name, rec in recs:
        assert rec.get("values") or rec.get("tables"), name


def test_configuration_md_is_generated_from_the_config_classes():
    from benchmarks import docgen

    with open(docgen.CONFIG_MD) as f:
        assert f.read() == docgen.render()
