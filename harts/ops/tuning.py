"""Shipped autotune results: one compile per kernel and key class instead of benchmarking every config.

fla's KDA, norm and convolution kernels and our round kernels are ``triton.autotune``d over 2-48 configs
each. On a fresh machine every new autotune key compiles and benchmarks all of them, which costs minutes
before the first training step, on every new container. The winners depend on the GPU and the kernel's
key (head count, head dims, chunk size, dtypes), not on the data, so they are recorded once per GPU
architecture and shipped as data (``harts/ops/tuned/sm90.json``).

``apply()`` (called by the fast entry points, ``@tuned``, before their first launch on CUDA) restricts
every autotuner named in the table for the running device's architecture:

- a key recorded exactly is entered into the autotuner's cache: no benchmarking, one compile;
- an unseen key of a recorded kernel is pruned to the recorded config whose key agrees with it in most
  positions (its key class): one compile, one short timing of that single config.

Every config in the table is one of the kernel's own candidates (a recorded config that is no longer
among them, e.g. after an fla upgrade, is ignored and said), so the result is one the full autotuner could
have chosen: the numerics stay those of the kernel. The kernel choice ``autotune="full"``
(``harts.ops.set_kernel_choices``; default from ``HARTS_AUTOTUNE``) turns the table off (normal autotuning)
for the autotuners not restricted yet; GPUs without a table keep normal autotuning.

Where a kernel's own candidates miss a launch config that measures faster at our shapes, ``EXTRA_CANDIDATES``
adds it to that autotuner's list (in both modes, so full autotuning benchmarks it and a table may name it):
the same kernel code and tiles, launched differently.

Re-tune and rewrite the table (on the GPU to record, with an empty or any Triton cache)::

    python -m harts.warmup --config configs/ling3_tiny_1gpu.toml --record harts/ops/tuned/sm90.json
"""
from __future__ import annotations

import collections
import datetime
import functools
import json
import logging
import os
import sys
from typing import Any

from harts.env import ENV

__all__ = ["autotuners", "record", "apply", "retune", "table_path", "mode", "tuned", "EXTRA_CANDIDATES"]

log = logging.getLogger("harts.ops.tuning")

_TUNED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
_MODULE_PREFIXES = ("fla.", "harts.kernels.", "harts.ops.")


def mode() -> str:
    """``table`` (default: use the shipped winners where the device has a table) or ``full`` (autotune all):
    ``harts.ops.kernel_choices().autotune``, default from ``HARTS_AUTOTUNE``."""
    from harts.ops.choices import kernel_choices

    return kernel_choices().autotune


def autotuners() -> dict[str, Any]:
    """Every ``triton.autotune`` object in the loaded fla and HARTS kernel modules, as ``module:kernel``.

    Decorators stack (``heuristics`` over ``autotune`` over ``jit``), so each module attribute is unwrapped
    down to its autotuner. Only modules imported so far are seen: import the ops first.
    """
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_MODULE_PREFIXES):
            continue
        for obj in list(vars(module).values()):
            while isinstance(obj, KernelInterface) and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn
            if isinstance(obj, Autotuner):
                fn = obj.base_fn
                found.setdefault(f"{fn.__module__}:{fn.__name__}", obj)
    return found


# Launch configs added to a kernel's autotuner candidates (``module:kernel`` -> configs as the table writes them).
EXTRA_CANDIDATES: dict[str, list[dict[str, Any]]] = {
    # fla offers this kernel 2 or 4 warps on Hopper (8 elsewhere). At Ling-3.0's KDA shape (T 65,536 packed rows,
    # 16 heads, K = V = 128, chunk 64) fla's own BK = BV = 64 tiles with 8 warps took 3.94 ms per call against
    # 6.46 ms with 4 (the best of fla's list) on an H100, outputs equal to fp32 rounding (relative 2e-7); it is
    # the largest kernel of the model's training step (benchmarks.model's profile).
    "fla.ops.kda.chunk_bwd:chunk_kda_bwd_kernel_wy_dqkg_fused": [
        {"kwargs": {"BK": 64, "BV": 64}, "num_warps": 8, "num_stages": stages, "num_ctas": 1, "maxnreg": None}
        for stages in (2, 3)
    ],
}


def _config_dict(c) -> dict[str, Any]:
    return {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
            "num_ctas": c.num_ctas, "maxnreg": c.maxnreg}


def _jsonable_key(key: tuple) -> list:
    return [k if isinstance(k, (bool, int, float, str)) or k is None else str(k) for k in key]


def _arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def table_path(arch: str | None = None) -> str:
    return os.path.join(_TUNED_DIR, f"{arch or _arch()}.json")


def record(path: str, command: str = "") -> dict[str, Any]:
    """Write every autotuner's current winners (one entry per key it has seen) to ``path``, merged into the
    table already there for the same architecture (so several processes, e.g. one per training mode, add
    up to one table; a key seen again takes the new winner)."""
    import torch
    import triton

    kernels: dict[str, dict[str, dict]] = {}
    old_table = None
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("arch") == _arch():
            old_table = old
            for name, rows in old["kernels"].items():
                kernels[name] = {json.dumps(r["key"]): r for r in rows}
    for name, at in autotuners().items():
        for k, c in at.cache.items():
            row = {"key": _jsonable_key(k), "config": _config_dict(c)}
            kernels.setdefault(name, {})[json.dumps(row["key"])] = row
    kernels = {name: [rows[k] for k in sorted(rows)] for name, rows in sorted(kernels.items()) if rows}
    run = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "triton": triton.__version__, "fla": _fla_version(), "command": command}
    # every recording merged into this table, oldest first (the top-level fields are the latest one's)
    history = []
    if old_table is not None:
        history = old_table.get("history") or [{k: old_table.get(k) for k in run}]
    table = {"arch": _arch(), **run, "history": history + [run], "kernels": kernels}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return table


def _fla_version() -> str:
    from harts.ops._fla import installed_version

    return installed_version() or "unknown"


def _run_key(at, kwargs: dict) -> tuple:
    """The key ``Autotuner.run`` computes: the key arguments' values, then every tensor argument's dtype."""
    all_args = {**at.nargs, **kwargs}
    args = {k: v for k, v in all_args.items() if k in at.arg_names}
    key = [args[k] for k in at.keys if k in args]
    key += [str(v.dtype) for v in args.values() if hasattr(v, "dtype")]
    return tuple(key)


def _nearest(entries: list[tuple[tuple, Any]], key: tuple):
    """The recorded config whose key agrees with ``key`` in most positions; ties go to the commonest config."""
    counts = collections.Counter(c for _, c in entries)

    def score(entry):
        k, c = entry
        same = sum(a == b for a, b in zip(k, key)) if len(k) == len(key) else -1
        return same, counts[c]

    return max(entries, key=score)[1]


def _add_candidates(name: str, at) -> int:
    """Append ``EXTRA_CANDIDATES[name]`` to ``at.configs`` (those not already there); returns how many."""
    extra = EXTRA_CANDIDATES.get(name)
    if not extra:
        return 0
    import triton

    have = {json.dumps(_config_dict(c), sort_keys=True) for c in at.configs}
    added = 0
    for d in extra:
        if json.dumps(d, sort_keys=True) in have:
            continue
        at.configs.append(triton.Config(dict(d["kwargs"]), num_warps=d["num_warps"], num_stages=d["num_stages"],
                                        num_ctas=d["num_ctas"], maxnreg=d["maxnreg"]))
        added += 1
    return added


def _restrict(name: str, at, rows: list[dict]) -> int:
    by_dict = {json.dumps(_config_dict(c), sort_keys=True): c for c in at.configs}
    entries = []
    for row in rows:
        c = by_dict.get(json.dumps(row["config"], sort_keys=True))
        if c is None:
            log.warning("tuned table: %s config %s is not among the kernel's candidates (fla or triton changed?); "
                        "that key autotunes normally", name, row["config"])
            continue
        key = tuple(row["key"])
        at.cache.setdefault(key, c)
        entries.append((key, c))
    if not entries:
        return 0
    original = at.prune_configs

    def prune_to_key_class(kwargs):
        if len(at.configs) <= 1:
            return original(kwargs)
        return [_nearest(entries, _run_key(at, kwargs))]

    _unrestricted_prune.setdefault(id(at), original)
    at.prune_configs = prune_to_key_class
    return len(entries)


_unrestricted_prune: dict[int, Any] = {}


def retune(names) -> list[str]:
    """Undo the table for the autotuners ``names`` (``module:kernel``): forget their cached winners and let them
    benchmark every candidate (``EXTRA_CANDIDATES`` included) at their next launch. For re-recording a few
    kernels at a real shape without autotuning all the others; returns the names found."""
    found = []
    ats = autotuners()
    for name in names:
        at = ats.get(name)
        if at is None:
            continue
        _add_candidates(name, at)
        if id(at) in _unrestricted_prune:
            at.prune_configs = _unrestricted_prune[id(at)]
        at.cache.clear()
        found.append(name)
    return found


_table_cache: dict[str, Any] = {}
_modules_seen = -1  # len(sys.modules) at the last apply(): new kernels can only come with new modules
_restricted: set[int] = set()
_summary = {"mode": None, "table": None, "kernels": 0, "keys": 0}


def _load_table(path: str) -> dict[str, Any] | None:
    if path not in _table_cache:
        _table_cache[path] = None
        if os.path.isfile(path):
            with open(path) as f:
                _table_cache[path] = json.load(f)
    return _table_cache[path]


def apply(path: str | None = None) -> dict[str, Any]:
    """Restrict the loaded autotuners to the table of the running GPU; a no-op (said once) without one.

    Incremental: autotuners of modules imported since the last call are restricted too, the others are
    left as they are. Returns the running summary ``{"mode", "table", "kernels", "keys"}``.
    The fast entry points call it through ``@tuned`` before they launch anything.
    """
    global _modules_seen
    first = _summary["mode"] is None
    if not first and path is None and len(sys.modules) == _modules_seen:
        return dict(_summary)
    _modules_seen = len(sys.modules)
    _summary["mode"] = mode()
    if first and ENV.kernel_report:  # set by harts.warmup for its training processes
        from harts.warmup import install_kernel_report

        install_kernel_report(ENV.kernel_report, ENV.autotune_record)
    ats = autotuners()
    for name in EXTRA_CANDIDATES.keys() & ats.keys():  # idempotent: a config already there is not added again
        _add_candidates(name, ats[name])
    if _summary["mode"] == "full":
        if first:
            log.info("autotuning: full (kernel choice autotune='full'): every config of every new key is benchmarked")
        return dict(_summary)
    path = path or table_path()
    table = _load_table(path)
    if table is None:
        if first:
            log.info("autotuning: full (no shipped table for this GPU at %s)", path)
        return dict(_summary)
    for name, at in ats.items():
        if id(at) in _restricted or name not in table["kernels"]:
            continue
        _restricted.add(id(at))
        n = _restrict(name, at, table["kernels"][name])
        _summary["kernels"] += bool(n)
        _summary["keys"] += n
    _summary["table"] = path
    if first:
        log.info("autotuning: shipped table %s (%s, %s); autotune='full' (HARTS_AUTOTUNE=full) benchmarks every "
                 "config instead",
                 path, table.get("device"), table.get("date"))
    return dict(_summary)


@functools.cache
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def tuned(*modules: str):
    """Decorator for the public fast-path entry points (``chunk_kda_round``, ``kda_fast``, the fused norms,
    the short convolutions): on CUDA, import ``modules`` (the kernels the function launches, where it
    imports them lazily) and restrict the loaded autotuners to the shipped table before the first launch,
    whichever entry point a caller uses first. After that a call costs a dict lookup per module and one
    ``len(sys.modules)``."""
    import importlib

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if _cuda():
                for m in modules:
                    if m not in sys.modules:
                        if m.startswith("fla."):
                            from harts.ops import _fla  # noqa: F401  (its version check, before any fla module)
                        importlib.import_module(m)
                apply()
            return fn(*args, **kwargs)

        return wrapper

    return decorate
