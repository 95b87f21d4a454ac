"""Compile everything a training config needs before the first real run: ``python -m harts.warmup --config X``.

A GPU's first training step compiles every Triton kernel the model uses (fla's KDA, norm and convolution
kernels, ours, inductor's) for every new key. The warm-up runs exactly what training runs, one step of
the config per mode (HARTS and the trajectory-wise baseline) in a scratch folder, so that the compiled
kernels land in the persistent caches that later runs read:

- Triton: ``TRITON_CACHE_DIR``, default ``~/.cache/harts/triton``;
- inductor: ``TORCHINDUCTOR_CACHE_DIR``, default ``~/.cache/harts/inductor``.

(``harts.warmup.cache_dirs()``, defined in ``harts.env``, sets those defaults; ``train.py`` calls it too, so both
use one location.)
It prints the kernels as they compile and ends with a table of time per kernel family. With
``--record PATH`` it autotunes every config (``HARTS_AUTOTUNE=full``) and writes the autotune winners of every kernel
that ran as a shipped table (see ``harts.ops.tuning``).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

from harts.env import cache_dirs

__all__ = ["cache_dirs", "main"]

_REPORT_ENV = "HARTS_KERNEL_REPORT"  # read by the training processes through harts.env


def family(kernel: str) -> str:
    """``fla.ops.kda.chunk_bwd:chunk_kda_bwd_kernel_dAv`` -> ``fla.ops.kda``: the summary's rows."""
    module = kernel.split(":")[0]
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[0] in ("fla", "harts") else module


def install_kernel_report(path: str, record: str | None = None) -> None:
    """In a training process: time every autotuned kernel's first launch per key (compile, plus benchmarks
    when autotuning) and append each to ``path`` as a JSON line; with ``record``, rewrite the autotune
    table there after every new key (rank 0). Used by the warm-up's subprocesses."""
    from triton.runtime.autotuner import Autotuner

    from harts.ops import tuning

    names: dict[int, str] = {}
    seen: set[tuple] = set()
    rows: list[dict] = []
    rank0 = os.environ.get("RANK", "0") == "0"
    original = Autotuner.run

    def timed_run(self, *args, **kwargs):
        nargs = dict(zip(self.arg_names, args))
        self.nargs = nargs
        key = (id(self), tuning._run_key(self, kwargs))
        self.nargs = None
        if key in seen:
            return original(self, *args, **kwargs)
        seen.add(key)
        if id(self) not in names:
            names.update({id(a): n for n, a in tuning.autotuners().items()})
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        import torch

        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        name = names.get(id(self), self.base_fn.__name__)
        rows.append({"kernel": name, "key": tuning._jsonable_key(key[1]), "seconds": dt})
        if rank0:
            print(f"[warmup] {len(rows):3d} kernels  {dt:6.1f} s  {name}", file=sys.stderr, flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
            if record:
                tuning.record(record, command="HARTS_AUTOTUNE=full python -m harts.warmup --record")
        return out

    Autotuner.run = timed_run


def _train_cmd(args, config: str, mode: str, folder: str) -> list[str]:
    train_py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
    if not os.path.isfile(train_py):
        raise SystemExit(f"harts.warmup: {train_py} not found (the warm-up runs the trainer of a source checkout)")
    return ["torchrun", "--nproc_per_node", str(args.nproc), "--standalone", train_py, "--config", config,
            "--training.steps=1", f"--job.dump_folder={folder}", "--checkpoint.enable=false",
            "--profile.enable=false", f"--harts.enabled={'true' if mode == 'harts' else 'false'}", *args.overrides]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.warmup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, nargs="+", help="training TOML(s), as given to train.py")
    ap.add_argument("--nproc", type=int, default=1, help="processes, as in torchrun --nproc_per_node")
    ap.add_argument("--modes", default="harts,baseline", help="comma-separated: harts, baseline")
    ap.add_argument("--record", metavar="PATH", help="write the autotune winners as a shipped table to PATH")
    ap.add_argument("overrides", nargs="*", help="extra train.py overrides (--section.key=value), after --")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("harts", "baseline")]
    if bad:
        raise SystemExit(f"harts.warmup: unknown mode(s) {bad}; expected harts and/or baseline")
    dirs = cache_dirs()
    print(f"[warmup] caches: triton {dirs['triton']}, inductor {dirs['inductor']}", flush=True)
    report = tempfile.NamedTemporaryFile(prefix="harts_kernels_", suffix=".jsonl", delete=False).name
    env = dict(os.environ, **{_REPORT_ENV: report})
    if args.record:  # a fresh table from full autotuning
        env["HARTS_AUTOTUNE_RECORD"] = os.path.abspath(args.record)
        env["HARTS_AUTOTUNE"] = "full"
        if os.path.exists(args.record):
            os.unlink(args.record)
    wall = {}
    runs = [(c, m) for c in args.config for m in modes]
    for i, (config, mode) in enumerate(runs, 1):
        with tempfile.TemporaryDirectory(prefix=f"harts_warmup_{mode}_") as folder:
            cmd = _train_cmd(args, config, mode, folder)
            print(f"[warmup] ({i}/{len(runs)}) {config} {mode}: {' '.join(cmd)}", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.call(cmd, env=env)
            wall[config, mode] = time.perf_counter() - t0
            if rc != 0:
                print(f"[warmup] {config} {mode} failed (exit {rc}) after {wall[config, mode]:.0f} s", file=sys.stderr)
                return rc
            print(f"[warmup] ({i}/{len(runs)}) {config} {mode} done in {wall[config, mode]:.0f} s", flush=True)
    rows = [json.loads(line) for line in open(report)]
    os.unlink(report)
    by_family = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        by_family[family(r["kernel"])][0] += 1
        by_family[family(r["kernel"])][1] += r["seconds"]
    print(f"\n{'kernel family':<28} {'keys':>5} {'seconds':>8}")
    for fam, (n, s) in sorted(by_family.items(), key=lambda kv: -kv[1][1]):
        print(f"{fam:<28} {n:>5} {s:>8.1f}")
    tuned = sum(s for _, s in by_family.values())
    total = sum(wall.values())
    print(f"{'autotuned kernels, total':<28} {len(rows):>5} {tuned:>8.1f}")
    print(f"{'whole warm-up (all runs)':<28} {'':>5} {total:>8.1f}  (the rest: start-up, model build, data, "
          f"inductor and untuned kernels)")
    if args.record:
        print(f"[warmup] autotune table written to {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
