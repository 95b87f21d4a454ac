"""Every shipped config (configs/*.toml) loads, and its parallel degrees fit the number of GPUs its name gives
(``..._2gpu_...``: 2; no count: 1): torchtitan's ParallelDims on that world size and the trainer's
expert-parallel rule (``harts.train.parallelize.parallel_dims``), so a layout that cannot run is found here
rather than after a multi-GPU job has started."""
import re
from pathlib import Path

import pytest

from harts.train.config import load_config
from harts.train.parallelize import parallel_dims

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


def test_the_configs_folder_is_found():
    names = {p.stem for p in CONFIGS}
    assert {"debug_cpu", "ling3_tiny_1gpu", "ling3_tiny_2gpu_tp2", "qwen35_2gpu_ep2"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_and_its_degrees_fit_its_gpus(path):
    cfg = load_config(str(path))
    m = re.search(r"_(\d+)gpu", path.stem)
    world = int(m.group(1)) if m else 1
    dims = parallel_dims(cfg.parallelism, world)
    degrees = dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp * dims.pp
    assert degrees == world, f"{path.name}: degrees multiply to {degrees}, its name says {world} GPU(s)"
    if world > 1:
        assert f"{world}x H200" in cfg.job.description, f"{path.name}: description {cfg.job.description!r}"
