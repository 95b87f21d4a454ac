"""The kernels Inductor writes for the compiled regions on an sm90 GPU (benchmarks.inductor_kernels, lowered on
CPU for a described device): the selective policy's saved 1 / rms lets a norm's backward read its rows once,
and the Ling router's selection is a Triton sort, not an ATen top-k. Each run is its own process (the tool
patches torch's CUDA queries)."""
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

ROWS = "4096"  # above Inductor's size floor for fusing a row and a column reduction (4096 rows, 5M elements)


def _kernels(tmp_path, *args) -> dict:
    out = tmp_path / "_".join(a.strip("-") for a in args)
    r = subprocess.run([sys.executable, "-m", "benchmarks.inductor_kernels", "--rows", ROWS, *args, "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads((out / "inductor_kernels.json").read_text())["graphs"]


def _row_passes(graph: dict) -> list[dict]:
    """Kernels that reduce (the tiny cast of the weight gradient is pointwise)."""
    return [k for k in graph["triton"] if k["kind"] != "pointwise"]


@pytest.mark.parametrize("region", ["rms_norm", "gated_rms_norm"])
def test_norm_backward_reads_its_rows_once(region, tmp_path):
    saved = _row_passes(_kernels(tmp_path, "--region", region)["backward"])
    assert [k["kind"] for k in saved] == ["mix-order reduction"], saved
    # the same region with the 1 / rms recomputed: the weight gradient's column reduction reads the sum of
    # squares the row pass wrote, so it cannot join it and reads x and dy again
    recomputed = _row_passes(_kernels(tmp_path, "--region", region, "--recompute", "rsqrt")["backward"])
    assert len(recomputed) >= 2 and "mix-order reduction" not in [k["kind"] for k in recomputed], recomputed


def test_ling_router_selects_with_a_triton_sort(tmp_path):
    fwd = _kernels(tmp_path, "--region", "ling_router")["forward"]
    assert fwd["aten_fallbacks"] == [], fwd["aten_fallbacks"]
    sorts = [k for k in fwd["triton"] if "sort" in k["kernel"] and "'r0_': 128" in k["size_hints"]]
    assert len(sorts) == 1 and sorts[0]["kind"] == "reduction (persistent)", fwd["triton"]
