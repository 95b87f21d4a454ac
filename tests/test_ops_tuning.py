"""The shipped autotune table (harts.ops.tuning): a recorded key runs its recorded config without
benchmarking, an unseen key runs the config of its nearest recorded key, and a stale config (no longer
among the kernel's candidates) is ignored rather than forced on the kernel."""
import json

import pytest
import torch
import triton
import triton.language as tl

from harts.ops import tuning
from harts.warmup import family

_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 1), (32, 2), (64, 4))]


def _make_kernel():
    @triton.autotune(configs=list(_CONFIGS), key=["N", "D"])
    @triton.jit
    def scale_kernel(x_ptr, y_ptr, N, D, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N)
        tl.store(y_ptr + offs, 2 * x, mask=offs < N)

    return scale_kernel


def _launch(kernel, n, d=7):
    x = torch.arange(n, dtype=torch.float32)
    y = torch.empty_like(x)
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, d)
    return x, y


def _row(key, cfg):
    return {"key": key, "config": tuning._config_dict(cfg)}


def test_recorded_key_uses_its_config_and_unseen_key_its_nearest(monkeypatch):
    kernel = _make_kernel()
    benched = []
    real_bench = type(kernel)._bench
    monkeypatch.setattr(type(kernel), "_bench", lambda self, *a, config, **k: benched.append(config) or
                        real_bench(self, *a, config=config, **k))
    rows = [_row([40, 7, "torch.float32", "torch.float32"], _CONFIGS[1]),
            _row([1000, 3, "torch.float32", "torch.float32"], _CONFIGS[2])]
    assert tuning._restrict("test:scale_kernel", kernel, rows) == 2

    x, y = _launch(kernel, 40)  # recorded exactly: cached, never benchmarked
    assert torch.equal(y, 2 * x)
    assert benched == [] and kernel.best_config == _CONFIGS[1]

    x, y = _launch(kernel, 41)  # unseen: agrees with the first row in D and dtypes -> its config, alone
    assert torch.equal(y, 2 * x)
    assert benched == [_CONFIGS[1]] and kernel.best_config == _CONFIGS[1]

    _launch(kernel, 999, d=3)  # nearest is the second row
    assert benched[-1] == _CONFIGS[2] and len(benched) == 2


def test_stale_config_is_ignored(caplog):
    kernel = _make_kernel()
    stale = {"key": [40, 7, "torch.float32", "torch.float32"],
             "config": {"kwargs": {"BLOCK": 128}, "num_warps": 8, "num_stages": 3, "num_ctas": 1, "maxnreg": None}}
    assert tuning._restrict("test:scale_kernel", kernel, [stale]) == 0
    assert not kernel.cache
    assert "not among the kernel's candidates" in caplog.text


def test_extra_candidate_is_added_once_and_a_table_may_name_it(monkeypatch):
    kernel = _make_kernel()
    extra = {"kwargs": {"BLOCK": 128}, "num_warps": 8, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    monkeypatch.setitem(tuning.EXTRA_CANDIDATES, "test:scale_kernel", [extra, tuning._config_dict(_CONFIGS[0])])
    assert tuning._add_candidates("test:scale_kernel", kernel) == 1  # the second one is already a candidate
    assert tuning._add_candidates("test:scale_kernel", kernel) == 0
    assert len(kernel.configs) == len(_CONFIGS) + 1
    assert tuning._restrict("test:scale_kernel", kernel, [{"key": [40, 7, "torch.float32", "torch.float32"],
                                                            "config": extra}]) == 1
    x, y = _launch(kernel, 40)
    assert torch.equal(y, 2 * x) and tuning._config_dict(kernel.best_config) == extra


def test_extra_candidates_name_real_kernels_and_their_tile_parameters():
    """Each added config must fit the fla kernel it names: that autotuner exists (fla not upgraded under it) and
    the config sets exactly the meta-parameters its own candidates set."""
    import importlib

    from harts.ops import _fla  # noqa: F401  (fla version check)

    for name, extras in tuning.EXTRA_CANDIDATES.items():
        module, kernel_name = name.split(":")
        importlib.import_module(module)
        at = tuning.autotuners().get(name)
        assert at is not None, f"{name}: no such autotuned kernel in the installed fla"
        own = {frozenset(c.kwargs) for c in at.configs if tuning._config_dict(c) not in extras}
        for e in extras:
            assert frozenset(e["kwargs"]) in own, f"{name}: {e['kwargs']} sets other meta-parameters than {own}"


def test_table_off_and_missing_table(tmp_path):
    import harts.ops

    assert tuning.mode() == "table"
    with harts.ops.use_kernel_choices(autotune="full"):
        assert tuning.mode() == "full"
    with pytest.raises(ValueError, match="autotune='sometimes'"):
        harts.ops.set_kernel_choices(autotune="sometimes")
    assert tuning.mode() == "table"
    assert tuning._load_table(str(tmp_path / "none.json")) is None
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"arch": "sm90", "kernels": {}}))
    assert tuning._load_table(str(p)) == {"arch": "sm90", "kernels": {}}


def test_autotuners_found_in_the_kernel_modules():
    import harts.ops.kda_round.chunk  # noqa: F401  (fla's KDA pieces and our round kernels)

    names = tuning.autotuners()
    assert "harts.kernels.kda_round:kda_round_fwd_kernel_h" in names
    assert any(n.startswith("fla.ops.kda.") for n in names)
    assert family("fla.ops.kda.chunk_bwd:chunk_kda_bwd_kernel_dAv") == "fla.ops.kda"


def test_tuned_entry_points_import_their_kernels_and_apply_first(monkeypatch):
    """On CUDA, a decorated entry point imports the kernel modules it launches lazily and applies the table
    before running; elsewhere it only runs."""
    calls = []
    monkeypatch.setattr(tuning, "apply", lambda: calls.append("apply"))

    @tuning.tuned("json")
    def entry(x):
        calls.append(("run", x))
        return x

    monkeypatch.setattr(tuning, "_cuda", lambda: False)
    assert entry(1) == 1 and calls == [("run", 1)]
    calls.clear()
    monkeypatch.setattr(tuning, "_cuda", lambda: True)
    monkeypatch.delitem(__import__("sys").modules, "json")
    assert entry(2) == 2 and calls == ["apply", ("run", 2)]
    assert "json" in __import__("sys").modules
