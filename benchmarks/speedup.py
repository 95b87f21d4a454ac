"""Training-speed benchmark (paper Table 4 analogue): ``python -m benchmarks.speedup --out DIR``.

On the same microbatches (the microbatch planner's plan of a SWE-like step at ``--capacity``, DP 1), with
full-layer activation recomputation on both paths:

- F/B/Grad: from a ready plan to parameter gradients, optimizer excluded. HARTS: ``pack`` of the ready call
  plan (layout to device) + forward + mapped log-probs + policy loss + backward per microbatch. Baseline: the same
  trajectories packed trajectory-wise into sub-batches of at most ``--capacity`` raw tokens.
- Core: F/B/Grad plus all HARTS planner time (microbatch planning and per-microbatch call planning).
- Non-replay compression (raw rows / compact rows), both speedups and their ratio to compression, MFU of
  both paths (model FLOPs of the rows each path must process: raw tokens for the baseline, compact rows
  for HARTS, so equal MFU means equal efficiency per useful row), peak memory, replay rows, MLA KV view
  expansion, and a torch.profiler breakdown by op family of one microbatch of each path: for each family
  the HARTS time against the ideal (baseline time / compression) says where HARTS loses.

``--preset`` picks the model (``qwen3.5-8l``: the reduced-depth Qwen3.5-MoE that trains on one H200; see
``benchmarks.common``). Writes ``speedup.json`` and ``speedup.png``.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import resource
import statistics
import tempfile
import time
from collections import defaultdict

import torch

from benchmarks.common import (
    add_workload_args,
    build_model,
    chunk_size_of,
    family,
    subbatches,
    workload_step,
)
from benchmarks.output import write_results
from benchmarks.trace_summary import device_idle
from harts.env import keep_host_memory
from harts.models.family import model_class, model_config
from harts.ops import kernel_choices


class HostStalls:
    """The process's page faults (pack's pool threads fault too) and the seconds Python's garbage collector ran,
    read before and after a host interval (pack): the two things besides pack's own work that stretch it
    between runs."""

    def __init__(self):
        self.gc_s, self._start = 0.0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.gc_s += time.perf_counter() - self._start
            self._start = None

    @staticmethod
    def _faults() -> int:
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_minflt + u.ru_majflt

    def mark(self) -> tuple[int, float]:
        return self._faults(), self.gc_s

    def since(self, mark: tuple[int, float]) -> tuple[int, float]:
        return self._faults() - mark[0], self.gc_s - mark[1]


def flops_per_row(model) -> float:
    """Forward matmul FLOPs per row: 2 x active parameters (routed experts counted top-k, LM head included)."""
    return 2.0 * model.num_params(active=True)


def profile_families(fn, device, loads, reset) -> tuple[dict, dict | None, dict, dict]:
    """Seconds of ``fn()`` by op family, and by kernel (op) name: GPU kernel time on CUDA (kernel events only,
    each once; summing the CPU ops' device time as well counted kernels two or three times), CPU ops' self time
    on CPU. Profiled again, like a timed run (``timed_run``), if a kernel load happened during it, so that no
    compilation or autotuning sweep is counted. On CUDA also the device's idle time inside the run (``device_idle``):
    the part of the wall time that no kernel explains, and the host op it waited on. The per-name seconds say
    which kernels inside a family carry its excess; on CUDA the kernel seconds under each host op (aten ops,
    autograd nodes, our autograd Functions; a nested op's time is in its parents' too) say which code launched
    them."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prof = None

    def profiled():
        nonlocal prof
        with torch.profiler.profile(activities=acts) as prof:
            fn()
            sync()

    timed_run(profiled, reset, sync, loads, max_runs=2)
    idle = None
    if device.type == "cuda":  # wall time not spent in kernels: where the device waits, and on which host op
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            with open(f"{tmp}/trace.json") as f:
                idle = device_idle(json.load(f)["traceEvents"])
    out, names, ops = defaultdict(float), defaultdict(float), defaultdict(float)
    for e in prof.key_averages():
        if device.type == "cuda":  # kernel (and memcpy) events only: a CPU op's device time is its kernels'
            on_cpu = e.device_type == torch.autograd.DeviceType.CPU
            t = 0.0 if on_cpu else e.device_time_total
            if on_cpu and e.device_time_total:  # the kernels under a host op (its children's included)
                ops[e.key] += e.device_time_total / 1e6
        else:
            t = e.self_cpu_time_total
        if t:
            out[family(e.key)] += t / 1e6
            names[e.key] += t / 1e6
    return dict(out), idle, dict(names), dict(ops)


def excess_table(harts: dict, baseline: dict, c0: float) -> dict:
    """Per key (family or kernel name): HARTS and baseline seconds, the ideal (baseline / compression ``c0``)
    and HARTS's excess over it."""
    return {k: {"harts_s": harts.get(k, 0.0), "baseline_s": baseline.get(k, 0.0), "ideal_s": baseline.get(k, 0.0) / c0,
                "excess_s": harts.get(k, 0.0) - baseline.get(k, 0.0) / c0} for k in sorted(set(harts) | set(baseline))}


# The FLOP count (benchmarks.flops) whose compression each op family's work follows: the mixer cores their own,
# every other family (projections, MoE, norms, gathers, log-probs) the per-row matmul count's, which is the row
# compression.
FAMILY_FLOPS = {"attention": "attention", "kda_state_scan": "kda", "kda_other": "kda", "conv": "conv"}


def flop_ideal(table: dict, flop_compression: dict, family_of=lambda k: k) -> None:
    """Adds to each entry of ``table`` (an ``excess_table``) its per-FLOP ideal: the baseline seconds over the
    compression of the FLOPs its family does (``flop_compression``: benchmarks.flops component -> baseline /
    HARTS forward FLOPs), and HARTS's excess over that. The row ideal overstates attention's excess, whose FLOPs
    compress less than rows (branch queries attend over their whole path)."""
    for k, v in table.items():
        c = flop_compression.get(FAMILY_FLOPS.get(family_of(k), "matmul"))
        if c:
            v.update(flop_compression=c, flop_ideal_s=v["baseline_s"] / c,
                     flop_excess_s=v["harts_s"] - v["baseline_s"] / c)


def profile_record(index: int, raw: int, compact: int, harts: tuple, baseline: tuple, top: int = 30,
                   flop_compression: dict | None = None) -> dict:
    """The report's ``profile``: per op family the HARTS and baseline seconds of one microbatch (``harts`` and
    ``baseline`` are ``profile_families`` results), the ideal (baseline / the microbatch's compression) and
    HARTS's excess over it, the ``top`` kernels by absolute excess with their family, and the device idle time
    of each path. With ``flop_compression`` (benchmarks.flops component -> its compression on this microbatch)
    the families and kernels also carry the per-FLOP ideal (``flop_ideal``), and ``flop_parity`` is the
    per-FLOP ideal kernel time over HARTS's (1: HARTS as efficient per FLOP as the baseline)."""
    (fam_h, idle_h, names_h, ops_h), (fam_b, idle_b, names_b, ops_b) = harts, baseline
    c0 = raw / compact
    kernels, ops = excess_table(names_h, names_b, c0), excess_table(ops_h, ops_b, c0)
    families = excess_table(fam_h, fam_b, c0)

    def worst(table):
        return sorted(table, key=lambda k: -abs(table[k]["excess_s"]))[:top]

    out = {"index": index, "raw": raw, "compact": compact, "compression": c0,
           "device_idle": {"harts": idle_h, "baseline": idle_b}, "families": families}
    if flop_compression:
        flop_ideal(families, flop_compression)
        flop_ideal(kernels, flop_compression, family)
        out["flop_compression"] = dict(flop_compression)
        out["flop_parity"] = sum(v["flop_ideal_s"] for v in families.values()) / sum(
            v["harts_s"] for v in families.values())
    out["kernels"] = [{"name": k, "family": family(k), **kernels[k]} for k in worst(kernels)]
    out["host_ops"] = [{"name": k, **ops[k]} for k in worst(ops)]
    return out


def planned_microbatches(args):
    """The step's fullest ``args.microbatches`` planned microbatches (trajectory lists) and the plan time."""
    from harts.planning import plan_microbatches

    step = workload_step(args)
    t0 = time.perf_counter()
    plan = plan_microbatches(step, dp_degree=1, capacity=args.capacity)
    t_mb = time.perf_counter() - t0
    order = sorted(range(len(plan.microbatches)), key=lambda j: -plan.work[j])[: args.microbatches]
    return [[step[i] for i in plan.microbatches[j]] for j in order], plan, t_mb


def baseline_flop_parts(model, trajs, capacity: int, act: int) -> dict:
    """Forward FLOPs of the trajectory-wise baseline's sub-batches of one microbatch, by benchmarks.flops component
    (``total`` included)."""
    from benchmarks.flops import batch_forward_flops
    from harts.runtime import pack

    out: dict = defaultdict(float)
    for idx in subbatches(trajs, capacity):
        parts = batch_forward_flops(model, pack([trajs[i] for i in idx], config=model.config, prefix_sharing=False),
                                    act)
        for k, v in parts.items():
            out[k] += v
    return dict(out)


def baseline_flops(model, trajs, capacity: int, act: int) -> float:
    """Forward FLOPs of the trajectory-wise baseline's sub-batches of one microbatch."""
    return baseline_flop_parts(model, trajs, capacity, act)["total"]


def flop_compressions(model, trajs, capacity: int, act: int, batch) -> dict:
    """Per benchmarks.flops component, baseline / HARTS forward FLOPs of one microbatch (``batch``: its HARTS
    layout); components HARTS does not run (zero FLOPs) are left out."""
    from benchmarks.flops import batch_forward_flops

    h = batch_forward_flops(model, batch, act)
    b = baseline_flop_parts(model, trajs, capacity, act)
    return {k: b[k] / v for k, v in h.items() if v}


def flops_only(args) -> int:
    from benchmarks.flops import active_matmul_params, batch_forward_flops
    from harts.runtime import pack

    mbs, _, _ = planned_microbatches(args)
    cfg = model_config(args.preset)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    act = active_matmul_params(model)
    raw = compact = replay = 0
    fh = fb = 0.0
    for n, trajs in enumerate(mbs, 1):
        hb = pack(trajs, config=cfg)
        fh += batch_forward_flops(model, hb, act)["total"]
        fb += baseline_flops(model, trajs, args.capacity, act)
        raw, compact, replay = raw + hb.stats["raw_tokens"], compact + hb.num_rows, replay + hb.stats["replay_tokens"]
        print(f"  microbatch {n}/{len(mbs)}: raw {hb.stats['raw_tokens']:,} compact {hb.num_rows:,}", flush=True)
    comp, fcomp = raw / compact, fb / fh
    res = {"args": vars(args), "microbatches": len(mbs), "raw_rows": raw, "compact_rows": compact,
           "replay_rows": replay, "compression": comp, "forward_flops_harts": fh, "forward_flops_baseline": fb,
           "flop_compression": fcomp, "ceiling_over_compression": fcomp / comp}
    print(f"\n{args.preset} {args.workload} scale {args.scale} capacity {args.capacity}: {len(mbs)} microbatches, "
          f"raw {raw:,} compact {compact:,} (replay {replay:,})")
    print(f"row compression {comp:.3f}x, FLOP compression {fcomp:.3f}x: a HARTS at the baseline's per-FLOP "
          f"efficiency reaches {fcomp / comp:.3f} of the row compression")
    write_results(args.out, "speedup_flops", res)
    return 0


class KernelLoads:
    """Counts one-time kernel work in this process: Triton kernel loads (a compile, an autotuning sweep or a
    disk-cache load, each the first launch of a new specialisation; Triton specialises integer arguments by
    divisibility, so a new sequence length can need one) and cuDNN attention shapes met for the first time
    (each builds execution plans). A timed run during which the count grows included one-time work and is
    timed again (otherwise a microbatch can time 2-5x slower per raw row than the rest while the caches grow)."""

    def __init__(self):
        from harts.ops.attention.fast import CUDNN_SHAPE_HOOKS

        self.n, self.available, self.names, self.seconds = 0, False, [], 0.0

        def cudnn_shape(key):
            self.n += 1
            self.names.append("cudnn attention plan")

        CUDNN_SHAPE_HOOKS.append(cudnn_shape)
        try:
            from triton import knobs
        except ImportError:
            return
        if not hasattr(knobs.runtime, "jit_post_compile_hook"):
            return  # reported as "unavailable" in the results
        prev, prev_pre = knobs.runtime.jit_post_compile_hook, getattr(knobs.runtime, "jit_cache_hook", None)
        started = []

        def pre(**kw):  # before the compile (or disk-cache load); a truthy return would skip it, so pass on
            started.append(time.perf_counter())
            return prev_pre(**kw) if prev_pre is not None else None

        def hook(**kw):
            self.n += 1
            self.names.append(getattr(kw.get("fn"), "name", "?"))
            if started:
                self.seconds += time.perf_counter() - started.pop()
            return prev(**kw) if prev is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        if hasattr(knobs.runtime, "jit_cache_hook"):
            knobs.runtime.jit_cache_hook = pre
        self.available = True


def timed_run(fn, reset, sync, loads, max_runs: int = 3, repeats: int = 1, graphs=lambda: 0) -> dict:
    """Seconds of ``fn()`` once no kernel load happens during it (runs until one is clean, at most ``max_runs``
    of them loading; ``reset()`` before each), then the median of ``repeats`` clean runs in all (``all_s`` lists
    them): one run of a 2 s microbatch moves by a few per cent between runs. ``first_s`` keeps the first run's
    time when it was repeated; ``clean`` is False when no run was clean (``s`` is then the last run's).
    ``graphs()``: torch.compile graphs compiled so far (a run that compiled one is not clean either)."""
    if repeats < 1 or max_runs < 1:
        raise ValueError(f"timed_run: max_runs={max_runs} and repeats={repeats} must be >= 1")
    out, clean_s, loading = {"runs": 0}, [], 0
    while len(clean_s) < repeats and loading < max_runs:
        reset()
        n0, s0, g0 = loads.n, loads.seconds, graphs()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        t = time.perf_counter() - t0
        out["runs"] += 1
        out.setdefault("first_s", t)
        if out["runs"] == 1 and loads.n > n0:  # which kernels the first run loaded and the seconds it took
            out["loaded"] = sorted(set(loads.names[n0:loads.n]))
            out["load_s"] = loads.seconds - s0
        if loads.n == n0 and graphs() == g0:
            clean_s.append(t)
        else:
            loading += 1
            out["s"], out["loads"] = t, loads.n - n0 + graphs() - g0
    out["clean"] = bool(clean_s)
    if clean_s:
        out["s"], out["loads"] = statistics.median(clean_s), 0
        if len(clean_s) > 1:
            out["all_s"] = clean_s
    if out["runs"] == 1:
        del out["first_s"]
    return out


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard wants I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need 0 <= I < N")
    return i, n


def summarize(meta: dict, records: list[dict], profile: dict | None) -> dict:
    """The report over timed microbatch records (one process or merged shards)."""
    res = dict(meta)
    sums = {k: sum(r[k] for r in records) for k in
            ("raw", "compact", "replay", "mla_kv", "harts_s", "baseline_s", "calls_plan_s", "flops_harts",
             "flops_baseline")}
    raw, compact, t_h, t_b = sums["raw"], sums["compact"], sums["harts_s"], sums["baseline_s"]
    comp, fcomp = raw / compact, sums["flops_baseline"] / sums["flops_harts"]
    t_plan = meta["microbatch_plan_s"] * len(records) / meta["planned_microbatches"] + sums["calls_plan_s"]
    peak = meta["peak_tflops"] * 1e12
    res.update({
        "microbatches_timed": len(records), "records": records,
        "retimed": sum(r["harts_runs"] > 1 for r in records) + sum(r["baseline_runs"] > 1 for r in records),
        "unclean_timings": sum(not r["harts_clean"] for r in records) + sum(not r["baseline_clean"] for r in records),
        "raw_rows": raw, "compact_rows": compact, "compression": comp, "replay_rows": sums["replay"],
        "mla_kv_rows": sums["mla_kv"], "mla_view_expansion": sums["mla_kv"] / compact,
        "fbgrad_harts_s": t_h, "fbgrad_baseline_s": t_b, "plan_s": t_plan,
        "speedup_fbgrad": t_b / t_h, "speedup_core": t_b / (t_h + t_plan),
        # training FLOPs = 3 x forward (recomputation not counted, as MFU conventions do)
        "mfu_baseline": 3 * meta["flops_per_row"] * raw / t_b / peak,
        "mfu_harts_useful": 3 * meta["flops_per_row"] * compact / t_h / peak,
        # FLOP compression (benchmarks.flops): what a HARTS running every op at the baseline's efficiency
        # would reach; speedup / FLOP compression is the implementation's share of the gap to row compression.
        "forward_flops_harts": sums["flops_harts"], "forward_flops_baseline": sums["flops_baseline"],
        "flop_compression": fcomp,
        "mfu_baseline_flops": 3 * sums["flops_baseline"] / t_b / peak,
        "mfu_harts_flops": 3 * sums["flops_harts"] / t_h / peak,
        "harts_peak_gb": max(r["harts_peak_gb"] for r in records),
        "baseline_peak_gb": max(r["baseline_peak_gb"] for r in records),
    })
    res["fbgrad_over_compression"] = res["speedup_fbgrad"] / comp
    res["core_over_compression"] = res["speedup_core"] / comp
    res["fbgrad_over_flop_compression"] = res["speedup_fbgrad"] / fcomp
    if all("harts_pack_s" in r for r in records):  # host seconds inside HARTS's F/B/Grad before its first kernel
        res["harts_pack_s"] = sum(r["harts_pack_s"] for r in records)
        res["harts_to_device_s"] = sum(r["harts_to_device_s"] for r in records)
    if all("harts_pack_gc_s" in r for r in records):  # what stalled pack: page faults, Python's garbage collector
        res["harts_pack_page_faults"] = sum(r["harts_pack_page_faults"] for r in records)
        res["harts_pack_gc_s"] = sum(r["harts_pack_gc_s"] for r in records)
    if profile is not None:
        res["profile"] = profile
    return res


def report(res: dict) -> None:
    print(f"\nmicrobatches {res['microbatches_timed']} timed of {res['microbatches']} (runs repeated after a "
          f"kernel load: {res['retimed']}; still loading at the last run: {res['unclean_timings']})  "
          f"raw {res['raw_rows']:,}  compact {res['compact_rows']:,}  compression {res['compression']:.3f}x  "
          f"replay {res['replay_rows']:,}  MLA KV expansion {res['mla_view_expansion']:.2f}x")
    print(f"F/B/Grad: baseline {res['fbgrad_baseline_s']:.2f}s  HARTS {res['fbgrad_harts_s']:.2f}s  speedup "
          f"{res['speedup_fbgrad']:.3f}x ({res['fbgrad_over_compression']:.3f} of compression)")
    print(f"FLOPs:    compression {res['flop_compression']:.3f}x (row compression {res['compression']:.3f}x); "
          f"F/B/Grad speedup is {res['fbgrad_over_flop_compression']:.3f} of it; MFU by counted FLOPs: baseline "
          f"{res['mfu_baseline_flops']:.3f}  HARTS {res['mfu_harts_flops']:.3f}")
    print(f"Core:     planner {res['plan_s']:.3f}s  speedup {res['speedup_core']:.3f}x "
          f"({res['core_over_compression']:.3f} of compression)")
    if "harts_pack_s" in res:
        host = res["harts_pack_s"] + res["harts_to_device_s"]
        stalls = (f" (in it: {res['harts_pack_page_faults']:,} page faults, {res['harts_pack_gc_s']:.3f}s of garbage "
                  f"collection)" if "harts_pack_gc_s" in res else "")
        print(f"HARTS host time before the first kernel (each microbatch's last run): pack {res['harts_pack_s']:.3f}s"
              f"{stalls}, batch to device {res['harts_to_device_s']:.3f}s ({host / res['fbgrad_harts_s']:.1%} of "
              f"F/B/Grad)")
    print(f"MFU: baseline {res['mfu_baseline']:.3f}  HARTS (useful rows) {res['mfu_harts_useful']:.3f}; "
          f"peak memory GB: baseline {res['baseline_peak_gb']:.1f}  HARTS {res['harts_peak_gb']:.1f}")
    c, w = res.get("compile"), res.get("warmup_s")
    if c is not None and w is not None:
        print(f"compile ({c['backend']}, checkpointing {res.get('activation_checkpointing')}): "
              f"{c['compilations_in_warmup']} graphs and {c['backend_seconds_in_warmup']:.1f} s in the backend during "
              f"the untimed warm-up (HARTS {w['harts']:.1f} s, baseline {w['baseline']:.1f} s); none in the timed runs")
    if "profile" in res:
        report_profile(res["profile"], res["device"])


def report_profile(p: dict, device: str) -> None:
    """Print a ``profile_record``: per family, the kernels and host ops with the largest excess, device idle."""
    what = "CPU op self time" if device == "cpu" else "GPU kernel time"
    print(f"\nprofile of one microbatch (raw {p['raw']:,}, compact {p['compact']:,}; {what} by family; "
          f"ideal = baseline / its compression {p['compression']:.3f}x)")
    per_flop = "flop_parity" in p
    print(f"{'family':20s} {'baseline s':>11s} {'ideal s':>9s} {'HARTS s':>9s} {'excess s':>9s}"
          + (f" {'FLOP comp.':>10s} {'per-FLOP ideal s':>16s} {'per-FLOP excess s':>17s}" if per_flop else ""))
    key = "flop_excess_s" if per_flop else "excess_s"
    for f, v in sorted(p["families"].items(), key=lambda kv_: -kv_[1].get(key, kv_[1]["excess_s"])):
        print(f"{f:20s} {v['baseline_s']:11.4f} {v['ideal_s']:9.4f} {v['harts_s']:9.4f} {v['excess_s']:9.4f}"
              + (f" {v['flop_compression']:10.3f} {v['flop_ideal_s']:16.4f} {v['flop_excess_s']:17.4f}"
                 if "flop_ideal_s" in v else ""))
    if per_flop:
        print(f"HARTS's kernel time is {1 / p['flop_parity']:.3f}x the per-FLOP ideal (each family's baseline seconds "
              f"over the compression of its FLOPs: " + ", ".join(f"{k} {c:.3f}x" for k, c in
                                                                 p["flop_compression"].items()) + ")")
    for key, title, label in (("kernels", "kernels by |excess| (s):", "family  name"),
                              ("host_ops", "host ops by |excess| of the kernels under them (nested ops repeat "
                                           "their children's time):", "name")):
        if p.get(key):
            print(f"\n{title} {'baseline':>9s} {'ideal':>8s} {'HARTS':>8s} {'excess':>8s}  {label}")
            for v in p[key][:20]:
                fam = f"{v['family']}  " if "family" in v else ""
                print(f"{'':24s} {v['baseline_s']:9.4f} {v['ideal_s']:8.4f} {v['harts_s']:8.4f} "
                      f"{v['excess_s']:8.4f}  {fam}{v['name'][:100]}")
    for path, idle in (p.get("device_idle") or {}).items():
        if idle:
            ops = ", ".join(f"{k} {v:.3f}s" for k, v in list(idle["idle_by_host_op_s"].items())[:5])
            print(f"{path}: device span {idle['span_s']:.3f}s, busy {idle['busy_s']:.3f}s, idle "
                  f"{idle['idle_s']:.3f}s in {idle['gaps_count']} gaps; idle by host op: {ops}")


def merge(paths: list[str], out: str) -> int:
    """``--merge``: one report from shard JSONs of the same workload (each microbatch timed by one process)."""
    shards = [json.load(open(p)) for p in paths]
    keys = ("preset", "workload", "seed", "scale", "capacity", "dtype", "microbatches")
    for p, s in zip(paths, shards):
        diff = [k for k in keys if s["args"][k] != shards[0]["args"][k]]
        if diff:
            raise SystemExit(f"--merge: {p} differs from {paths[0]} in {diff}")
    got = sorted(s["args"]["shard"][0] for s in shards)
    n = shards[0]["args"]["shard"][1]
    if got != list(range(n)):
        raise SystemExit(f"--merge: shards {got} of {n}; every shard 0..{n - 1} exactly once is needed")
    meta = {k: v for k, v in shards[0].items() if k in ("model", "device", "torch", "microbatch_plan_s",
                                                         "microbatches", "planned_microbatches", "flops_per_row",
                                                         "peak_tflops", "kernel_load_detection", "host_memory",
                                                         "kernel_choices", "garbage_collection")}
    meta["args"] = dict(shards[0]["args"], shard=None, merged=paths)
    records = sorted((r for s in shards for r in s["records"]), key=lambda r: r["index"])
    profile = next((s["profile"] for s in shards if "profile" in s), None)
    res = summarize(meta, records, profile)
    res["shards"] = n
    report(res)
    write_results(out, "speedup", res, _plot)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speedup", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, scale=0.2)
    ap.add_argument("--microbatches", type=int, default=16, help="how many planned microbatches to time")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time each microbatch of each path this many times (after kernel loads end) and keep the "
                         "median")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200: 989)")
    ap.add_argument("--out", default="out/bench_speedup")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds since start after which no microbatch starts, nor one whose predicted time "
                         "(this run's seconds per raw row) would end past it (0 = time all); the report says "
                         "how many were timed. For device calls with a hard time limit")
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                    help="time only microbatches I, I+N, ... (of the fullest first) and write speedup_shardIofN"
                         ".json; N processes (one per GPU) then `--merge` them. Shard 0 also profiles")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="profile one microbatch of each path by op family (shard 0); on a CPU with per-token "
                         "reference cores the profiler's event parsing can take longer than the timed runs")
    ap.add_argument("--profile-microbatch", choices=("median", "smallest", "largest"), default="median",
                    help="which of the shard's microbatches (by raw rows) the profile runs; the profiler's own "
                         "cost grows with the baseline's kernel count, so 'smallest' is the cheap one")
    ap.add_argument("--profile-only", action="store_true",
                    help="profile one microbatch of each path (--profile-microbatch), print and write the profile "
                         "(speedup_profile.json), and time nothing")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge shard JSONs into speedup.json and exit")
    ap.add_argument("--ac", choices=("full", "selective", "none"), default="full",
                    help="activation checkpointing of both paths (full: the paper's setting; selective: the "
                         "trainer's default)")
    ap.add_argument("--compile", action="store_true",
                    help="compile both paths' decoder layers the same way (harts.models.ling.compile_model, dynamic "
                         "rows); compilation happens in the untimed warm-up and is reported separately")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend with --compile")
    ap.add_argument("--flops-only", action="store_true",
                    help="no timing: plan and pack the same microbatches, count forward FLOPs of both paths on a "
                         "meta-device model and print the ceiling speedup / compression = FLOP compression / row "
                         "compression that a HARTS running every op at the baseline's efficiency would reach")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: time each microbatch at least once")
    if args.merge:
        return merge(args.merge, args.out)
    if args.profile_only and not args.profile:
        ap.error("--profile-only with --no-profile: nothing to do")
    if args.flops_only:
        return flops_only(args)
    t_proc = time.perf_counter()
    host_memory = keep_host_memory()  # as train.py: both paths' packs reuse mapped pages
    print(host_memory, flush=True)
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # as train.py (training.gc_freq): no automatic collection inside a timed run; reset() collects
    try:
        return measure(args, t_proc, host_memory)
    finally:
        if gc_was_enabled:
            gc.enable()


def measure(args, t_proc: float, host_memory: str) -> int:
    """Warm up, profile and time both paths on the planned microbatches (``main``, after its options)."""
    from benchmarks.flops import active_matmul_params, batch_forward_flops
    from harts.models.common.compile import compile_model
    from harts.planning.calls import plan_calls
    from harts.runtime import pack
    from harts.train.parallelize import apply_ac

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    loads = KernelLoads()
    shard, nshard = args.shard
    mbs, plan, t_mb = planned_microbatches(args)
    mine = list(range(shard, len(mbs), nshard))
    model = build_model(args.preset, dev, dtype, args.seed, recompute=False)
    apply_ac(model, args.ac)
    if args.compile:  # after checkpointing, as the trainer applies them
        compile_model(model, backend=args.compile_backend, dynamic=True)
    cfg = model.config
    B = chunk_size_of(cfg)
    act = active_matmul_params(model)

    def loss_of(lp):
        return -(lp * torch.linspace(-1, 1, lp.shape[0], device=lp.device, dtype=lp.dtype)).mean()

    def call_plan(trajs):
        return plan_calls([t.tokens for t in trajs], chunk_size=B)

    host = {}  # the last HARTS run's host seconds before its first kernel: pack, and the batch's copy to the device
    host_stalls = HostStalls()

    def run_harts(trajs, plan):  # from a ready plan (paper 5.2's F/B/Grad): pack lays it out
        t0 = time.perf_counter()
        before = host_stalls.mark()
        hb = pack(trajs, config=cfg, plan=plan)
        pack_stalls = host_stalls.since(before)  # inside pack's interval, so its stalls are part of its seconds
        t1 = time.perf_counter()
        hb = hb.to(dev, non_blocking=True)
        host.update(pack_s=t1 - t0, to_device_s=time.perf_counter() - t1, pack_page_faults=pack_stalls[0],
                    pack_gc_s=pack_stalls[1])
        loss_of(model.logprobs(hb)).backward()

    def run_baseline(trajs):
        for idx in subbatches(trajs, args.capacity):
            bb = pack([trajs[i] for i in idx], config=cfg, prefix_sharing=False).to(dev, non_blocking=True)
            loss_of(model.logprobs(bb)).backward()

    def reset():
        model.zero_grad(set_to_none=True)
        gc.collect(1)  # between runs, untimed, like the trainer's collection between steps
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak_gb():
        return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0

    # Warm-up (kernel compilation / autotuning, and torch.compile's graphs) on the smallest microbatch, both
    # paths, not timed; with --compile its seconds and the graphs compiled are reported on their own.
    small = min(mbs, key=lambda m: sum(len(t) for t in m))
    warmup_s = {}
    small_plan = call_plan(small)
    for name, fn in (("harts", lambda m: run_harts(m, small_plan)), ("baseline", run_baseline)):
        sync()
        t0 = time.perf_counter()
        fn(small)
        sync()
        warmup_s[name] = time.perf_counter() - t0
    reset()
    compiled = model.compile_report

    meta = {"args": vars(args), "model": type(model).__name__,
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "microbatch_plan_s": t_mb, "microbatches": len(mbs),
            "garbage_collection": "automatic collection off, a generation-1 collection before each run (untimed)",
            "planned_microbatches": len(plan.microbatches), "flops_per_row": flops_per_row(model),
            "peak_tflops": args.peak_tflops, "kernel_choices": dataclasses.asdict(kernel_choices()),
            "kernel_load_detection": ("triton jit_post_compile_hook" if loads.available else "triton: unavailable")
            + ", cuDNN attention shapes" + (", torch.compile graphs" if compiled is not None else ""),
            "activation_checkpointing": args.ac, "warmup_s": warmup_s, "host_memory": host_memory,
            "compile": None if compiled is None else {
                "backend": compiled.backend, "compilations_in_warmup": compiled.compilations,
                "backend_seconds_in_warmup": compiled.compile_seconds}}
    print("kernel choices: " + " ".join(f"{k}={v}" for k, v in meta["kernel_choices"].items()), flush=True)
    profile = None
    if shard == 0 and args.profile:
        # Where the time goes: one of the shard's microbatches (--profile-microbatch) of each path under the profiler,
        # GPU kernel time by op family. First, so that its timing does not compete with the time budget.
        by_raw = sorted(mine, key=lambda i: sum(len(t) for t in mbs[i]))
        j = by_raw[{"smallest": 0, "median": len(by_raw) // 2, "largest": -1}[args.profile_microbatch]]
        plan_j = call_plan(mbs[j])
        hb = pack(mbs[j], config=cfg, plan=plan_j)

        def profiled(name, fn):
            print(f"  profiling microbatch {j} ({hb.stats['raw_tokens']:,} raw, {hb.num_rows:,} compact rows), {name} "
                  f"[{time.perf_counter() - t_proc:.0f} s]", flush=True)
            return profile_families(lambda: fn(mbs[j]), dev, loads, reset)

        prof_h = profiled("HARTS", lambda m: run_harts(m, plan_j))
        # HARTS's share on its own first: a run cut off while profiling the baseline keeps it
        write_results(args.out, "speedup_profile", dict(meta, partial={
            "index": j, "raw": hb.stats["raw_tokens"], "compact": hb.num_rows, "harts_families_s": prof_h[0],
            "harts_device_idle": prof_h[1]}))
        prof_b = profiled("baseline", run_baseline)
        reset()
        profile = profile_record(j, hb.stats["raw_tokens"], hb.num_rows, prof_h, prof_b,
                                 flop_compression=flop_compressions(model, mbs[j], args.capacity, act, hb))
        if args.profile_only:
            report_profile(profile, meta["device"])
            write_results(args.out, "speedup_profile", dict(meta, profile=profile))
            return 0

    records: list[dict] = []
    out_name = "speedup" if nshard == 1 else f"speedup_shard{shard}of{nshard}"
    t_loop, raw_done = time.perf_counter(), 0
    for j in mine:
        trajs = mbs[j]
        raw_j = sum(len(t) for t in trajs)
        if args.time_budget and records:
            now = time.perf_counter() - t_proc
            predicted = (time.perf_counter() - t_loop) / raw_done * raw_j
            if now + predicted > args.time_budget:
                print(f"  time budget {args.time_budget:g} s: {now:.0f} s elapsed, the next microbatch would take "
                      f"~{predicted:.0f} s; {len(records)} of {len(mine)} microbatches timed", flush=True)
                break
        t0 = time.perf_counter()
        plan_j = call_plan(trajs)  # planner time charged to Core only
        t_calls = time.perf_counter() - t0
        # Both paths' host batches of this microbatch laid out once, untimed: the pages pack needs at this size are
        # then mapped, as in training, where every step packs microbatches of similar sizes into kept pages;
        # otherwise the first microbatch timed would pay the first touch of its larger arrays.
        pack(trajs, config=cfg, plan=plan_j)
        for idx in subbatches(trajs, args.capacity):
            pack([trajs[i] for i in idx], config=cfg, prefix_sharing=False)
        graphs = (lambda: compiled.compilations) if compiled is not None else (lambda: 0)
        h = timed_run(lambda: run_harts(trajs, plan_j), reset, sync, loads, repeats=args.repeats, graphs=graphs)
        h_host = dict(host)
        h_peak = peak_gb()
        b = timed_run(lambda: run_baseline(trajs), reset, sync, loads, repeats=args.repeats, graphs=graphs)
        b_peak = peak_gb()
        reset()
        hb = pack(trajs, config=cfg, plan=plan_j)
        rec = {"index": j, "raw": hb.stats["raw_tokens"], "compact": hb.num_rows,
               "replay": hb.stats["replay_tokens"], "mla_kv": hb.stats["mla_kv_rows"], "calls_plan_s": t_calls,
               "flops_harts": batch_forward_flops(model, hb, act)["total"],
               "flops_baseline": baseline_flops(model, trajs, args.capacity, act),
               "harts_peak_gb": h_peak, "baseline_peak_gb": b_peak,
               "harts_pack_s": h_host["pack_s"], "harts_to_device_s": h_host["to_device_s"],
               "harts_pack_page_faults": h_host["pack_page_faults"], "harts_pack_gc_s": h_host["pack_gc_s"]}
        for path, r in (("harts", h), ("baseline", b)):  # harts_s, harts_runs, harts_first_s, ...
            rec.update({f"{path}_{k}": v for k, v in r.items()})
        records.append(rec)
        raw_done += raw_j
        first = "".join(f" ({n} first run {r['first_s']:.2f}s, {r.get('load_s', 0.0):.2f}s of it loading "
                        f"{len(r.get('loaded', []))} kernels; {r['runs']} runs)" for n, r in
                        (("HARTS", h), ("baseline", b)) if "first_s" in r)
        print(f"  microbatch {j}: raw {rec['raw']:,} compact {rec['compact']:,}  HARTS {h['s']:.2f}s baseline "
              f"{b['s']:.2f}s{first}  [{time.perf_counter() - t_proc:.0f} s]", flush=True)
        # the JSON so far after every microbatch (no PNG): a process killed by a device call's time limit
        # still leaves its timed microbatches, which --merge accepts
        write_results(args.out, out_name, summarize(meta, records, profile))
    if not records:
        raise SystemExit("no microbatch timed")
    res = summarize(meta, records, profile)
    report(res)
    write_results(args.out, out_name, res, _plot)
    return 0


def _plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.bar(["compression", "F/B/Grad", "Core"], [res["compression"], res["speedup_fbgrad"], res["speedup_core"]],
          color=["grey", "tab:blue", "tab:orange"])
    a.set_ylabel("x over trajectory-wise")
    a.set_title("HARTS speedup vs non-replay compression")
    if "profile" in res:
        fam = res["profile"]["families"]
        fams = sorted(fam, key=lambda f: -fam[f]["baseline_s"])
        x = range(len(fams))
        b.bar([i - 0.2 for i in x], [fam[f]["ideal_s"] for f in fams], 0.4, label="ideal (baseline / compression)")
        b.bar([i + 0.2 for i in x], [fam[f]["harts_s"] for f in fams], 0.4, label="HARTS")
        b.set_xticks(list(x), fams, rotation=45, ha="right", fontsize=8)
        b.set_ylabel("s (one microbatch)")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
