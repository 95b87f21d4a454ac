"""Training-speed benchmark (paper Table 4 analogue): ``python -m harts.bench.speedup --out DIR``.

On the same microbatches (the microbatch planner's plan of a SWE-like step at ``--capacity``, DP 1), with
full-layer activation recomputation on both paths:

- F/B/Grad: from a ready plan to parameter gradients, optimizer excluded. HARTS: ``pack`` (layout to
  device) + forward + mapped log-probs + policy loss + backward per microbatch. Baseline: the same
  trajectories packed trajectory-wise into sub-batches of at most ``--capacity`` raw tokens.
- Core: F/B/Grad plus all HARTS planner time (microbatch planning and per-microbatch call planning).
- Non-replay compression (raw rows / compact rows), both speedups and their ratio to compression, MFU of
  both paths (model FLOPs of the rows each path must process: raw tokens for the baseline, compact rows
  for HARTS, so equal MFU means equal efficiency per useful row), peak memory, replay rows, MLA KV view
  expansion, and a torch.profiler breakdown by op family of one microbatch of each path: for each family
  the HARTS time against the ideal (baseline time / compression) says where HARTS loses.

Writes ``speedup.json`` and ``speedup.png``.
"""
from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch

from harts.bench.common import add_workload_args, build_model, family, subbatches, workload_step
from harts.bench.output import write_results

def flops_per_row(model) -> float:
    """Forward matmul FLOPs per row: 2 x active parameters (routed experts counted top-k, LM head included)."""
    return 2.0 * model.num_params(active=True)


def profile_families(fn, device) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0.0) if device.type == "cuda" else e.self_cpu_time_total
        if t:
            out[family(e.key)] += t / 1e6
    return dict(out)


def planned_microbatches(args):
    """The step's fullest ``args.microbatches`` planned microbatches (trajectory lists) and the plan time."""
    from harts.planning import plan_microbatches

    step = workload_step(args)
    t0 = time.perf_counter()
    plan = plan_microbatches(step, dp_degree=1, capacity=args.capacity)
    t_mb = time.perf_counter() - t0
    order = sorted(range(len(plan.microbatches)), key=lambda j: -plan.work[j])[: args.microbatches]
    return [[step[i] for i in plan.microbatches[j]] for j in order], plan, t_mb


def baseline_flops(model, trajs, capacity: int, act: int) -> float:
    """Forward FLOPs of the trajectory-wise baseline's sub-batches of one microbatch."""
    from harts.bench.flops import batch_forward_flops
    from harts.runtime import pack

    B = model.config.kda_chunk_size
    return sum(batch_forward_flops(model, pack([trajs[i] for i in idx], chunk_size=B, prefix_sharing=False),
                                   act)["total"] for idx in subbatches(trajs, capacity))


def flops_only(args) -> int:
    from harts.bench.flops import active_matmul_params, batch_forward_flops
    from harts.models.ling import LingConfig, LingForCausalLM
    from harts.runtime import pack

    mbs, _, _ = planned_microbatches(args)
    with torch.device("meta"):
        model = LingForCausalLM(LingConfig.preset(args.preset))
    B, act = model.config.kda_chunk_size, active_matmul_params(model)
    raw = compact = replay = 0
    fh = fb = 0.0
    for n, trajs in enumerate(mbs, 1):
        hb = pack(trajs, chunk_size=B)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.bench.speedup", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, scale=0.2)
    ap.add_argument("--microbatches", type=int, default=16, help="how many planned microbatches to time")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200: 989)")
    ap.add_argument("--out", default="out/bench_speedup")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds of timed microbatches after which no new one starts (0 = time all); the "
                         "report says how many were timed. For device calls with a hard time limit")
    ap.add_argument("--flops-only", action="store_true",
                    help="no timing: plan and pack the same microbatches, count forward FLOPs of both paths on a "
                         "meta-device model and print the ceiling speedup / compression = FLOP compression / row "
                         "compression that a HARTS running every op at the baseline's efficiency would reach")
    args = ap.parse_args(argv)
    if args.flops_only:
        return flops_only(args)

    from harts.runtime import pack

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    os.makedirs(args.out, exist_ok=True)
    mbs, plan, t_mb = planned_microbatches(args)
    model = build_model(args.preset, dev, dtype, args.seed, recompute=True)
    B = model.config.kda_chunk_size

    def loss_of(lp):
        return -(lp * torch.linspace(-1, 1, lp.shape[0], device=lp.device, dtype=lp.dtype)).mean()

    # Warm-up (kernel compilation / autotuning) on the smallest microbatch, both paths, not timed.
    small = min(mbs, key=lambda m: sum(len(t) for t in m))
    for ps in (True, False):
        for idx in ([list(range(len(small)))] if ps else subbatches(small, args.capacity)):
            b = pack([small[i] for i in idx], chunk_size=B, prefix_sharing=ps).to(dev)
            loss_of(model.logprobs(b)).backward()
    model.zero_grad(set_to_none=True)

    res = {"args": vars(args), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "microbatch_plan_s": t_mb, "microbatches": len(mbs)}
    from harts.bench.flops import active_matmul_params, batch_forward_flops

    act = active_matmul_params(model)
    raw = compact = replay = kv = 0
    flops_h = flops_b = 0.0
    t_calls = t_h = t_b = 0.0
    t_start, timed = time.perf_counter(), 0
    for trajs in mbs:
        if args.time_budget and timed and time.perf_counter() - t_start > args.time_budget:
            print(f"  time budget {args.time_budget:g} s reached: {timed} of {len(mbs)} microbatches timed",
                  flush=True)
            break
        timed += 1
        t0 = time.perf_counter()
        from harts.planning.calls import plan_calls

        plan_calls([t.tokens for t in trajs], chunk_size=B)  # planner time charged to Core
        t_calls += time.perf_counter() - t0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        hb = pack(trajs, chunk_size=B).to(dev, non_blocking=True)
        loss_of(model.logprobs(hb)).backward()
        sync()
        t_h += time.perf_counter() - t0
        res.setdefault("harts_peak_gb", 0.0)
        if dev.type == "cuda":
            res["harts_peak_gb"] = max(res["harts_peak_gb"], torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        flops_h += batch_forward_flops(model, hb, act)["total"]
        raw += hb.stats["raw_tokens"]
        compact += hb.num_rows
        replay += hb.stats["replay_tokens"]
        kv += hb.stats["mla_kv_rows"]
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        for idx in subbatches(trajs, args.capacity):
            bb = pack([trajs[i] for i in idx], chunk_size=B, prefix_sharing=False).to(dev, non_blocking=True)
            loss_of(model.logprobs(bb)).backward()
        sync()
        t_b += time.perf_counter() - t0
        flops_b += baseline_flops(model, trajs, args.capacity, act)
        res.setdefault("baseline_peak_gb", 0.0)
        if dev.type == "cuda":
            res["baseline_peak_gb"] = max(res["baseline_peak_gb"], torch.cuda.max_memory_allocated() / 2**30)
        model.zero_grad(set_to_none=True)
        print(f"  microbatch: raw {hb.stats['raw_tokens']:,} compact {hb.num_rows:,}  cumulative HARTS {t_h:.2f}s "
              f"baseline {t_b:.2f}s", flush=True)
    comp = raw / compact
    t_plan = t_mb * timed / len(plan.microbatches) + t_calls
    fpr = flops_per_row(model)
    res.update({
        "microbatches_timed": timed,
        "raw_rows": raw, "compact_rows": compact, "compression": comp, "replay_rows": replay,
        "mla_kv_rows": kv, "mla_view_expansion": kv / compact,
        "fbgrad_harts_s": t_h, "fbgrad_baseline_s": t_b, "plan_s": t_plan,
        "speedup_fbgrad": t_b / t_h, "speedup_core": t_b / (t_h + t_plan),
        # training FLOPs = 3 x forward (recomputation not counted, as MFU conventions do)
        "mfu_baseline": 3 * fpr * raw / t_b / (args.peak_tflops * 1e12),
        "mfu_harts_useful": 3 * fpr * compact / t_h / (args.peak_tflops * 1e12),
    })
    res["fbgrad_over_compression"] = res["speedup_fbgrad"] / comp
    # FLOP compression (harts.bench.flops): what a HARTS running every op at the baseline's efficiency would
    # reach; speedup / FLOP compression is then the implementation's share of the gap to row compression.
    res.update({"forward_flops_harts": flops_h, "forward_flops_baseline": flops_b,
                "flop_compression": flops_b / flops_h, "fbgrad_over_flop_compression": res["speedup_fbgrad"] / (flops_b / flops_h),
                "mfu_baseline_flops": 3 * flops_b / t_b / (args.peak_tflops * 1e12),
                "mfu_harts_flops": 3 * flops_h / t_h / (args.peak_tflops * 1e12)})
    res["core_over_compression"] = res["speedup_core"] / comp
    # Where the time goes: one microbatch of each path under the profiler.
    trajs = mbs[0]
    hb = pack(trajs, chunk_size=B).to(dev)
    fam_h = profile_families(lambda: loss_of(model.logprobs(hb)).backward(), dev)
    model.zero_grad(set_to_none=True)

    def base():
        for idx in subbatches(trajs, args.capacity):
            bb = pack([trajs[i] for i in idx], chunk_size=B, prefix_sharing=False).to(dev)
            loss_of(model.logprobs(bb)).backward()

    fam_b = profile_families(base, dev)
    model.zero_grad(set_to_none=True)
    c0 = hb.stats["raw_tokens"] / hb.num_rows
    res["profile"] = {f: {"harts_s": fam_h.get(f, 0.0), "baseline_s": fam_b.get(f, 0.0),
                          "ideal_s": fam_b.get(f, 0.0) / c0,
                          "excess_s": fam_h.get(f, 0.0) - fam_b.get(f, 0.0) / c0}
                      for f in sorted(set(fam_h) | set(fam_b))}
    print(f"\nmicrobatches {timed} timed of {len(mbs)}  raw {raw:,}  compact {compact:,}  compression {comp:.3f}x  replay {replay:,}  "
          f"MLA KV expansion {kv / compact:.2f}x")
    print(f"F/B/Grad: baseline {t_b:.2f}s  HARTS {t_h:.2f}s  speedup {res['speedup_fbgrad']:.3f}x "
          f"({res['fbgrad_over_compression']:.3f} of compression)")
    print(f"FLOPs:    compression {res['flop_compression']:.3f}x (row compression {comp:.3f}x); F/B/Grad speedup is "
          f"{res['fbgrad_over_flop_compression']:.3f} of it; MFU by counted FLOPs: baseline {res['mfu_baseline_flops']:.3f}  "
          f"HARTS {res['mfu_harts_flops']:.3f}")
    print(f"Core:     planner {t_plan:.3f}s  speedup {res['speedup_core']:.3f}x ({res['core_over_compression']:.3f} of compression)")
    print(f"MFU: baseline {res['mfu_baseline']:.3f}  HARTS (useful rows) {res['mfu_harts_useful']:.3f}; "
          f"peak memory GB: baseline {res['baseline_peak_gb']:.1f}  HARTS {res['harts_peak_gb']:.1f}")
    print(f"\n{'family':20s} {'baseline s':>11s} {'ideal s':>9s} {'HARTS s':>9s} {'excess s':>9s}")
    for f, v in sorted(res["profile"].items(), key=lambda kv_: -kv_[1]["excess_s"]):
        print(f"{f:20s} {v['baseline_s']:11.4f} {v['ideal_s']:9.4f} {v['harts_s']:9.4f} {v['excess_s']:9.4f}")
    write_results(args.out, "speedup", res, _plot)
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
    fams = sorted(res["profile"], key=lambda f: -res["profile"][f]["baseline_s"])
    x = range(len(fams))
    b.bar([i - 0.2 for i in x], [res["profile"][f]["ideal_s"] for f in fams], 0.4, label="ideal (baseline / compression)")
    b.bar([i + 0.2 for i in x], [res["profile"][f]["harts_s"] for f in fams], 0.4, label="HARTS")
    b.set_xticks(list(x), fams, rotation=45, ha="right", fontsize=8)
    b.set_ylabel("s (one microbatch)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
