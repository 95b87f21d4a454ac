"""Trainer-level speedup (paper Table 4 at the trainer, any parallel layout, e.g. FSDP2 + EP2 on two GPUs).

``python -m benchmarks.train_speedup --harts RUN_A/metrics.jsonl --baseline RUN_B/metrics.jsonl --out DIR``

Compares two runs of ``train.py`` with the same config and data except ``--harts.enabled`` (use
``data.fixed_step = true`` so every step trains the same rollouts). Per run, over the steps after
``--skip`` warm-up steps (compilation, autotuning, allocator growth): mean F/B/Grad seconds (plan ready to
gradients, optimizer excluded), Core seconds (F/B/Grad plus the step's planning and packing, which the
trainer's data worker overlaps with the previous step: the paper's Core charges them), mean step seconds
(optimizer included), raw tokens, compact rows, peak memory and MFU. The speedups are the baseline's time
over HARTS's; "of compression" divides by the non-replay compression raw / compact. Writes
``train_speedup.json`` and ``train_speedup.png``.

``--config X.toml [--section.key=value ...]`` (the runs' config and overrides) also counts the step's
forward FLOPs of both paths on a meta-device model (benchmarks.flops; the trainer's planners, the DP
degree of the runs) and reports the speedups against the FLOP compression too: causal attention over long
branch paths does not compress like rows, so FLOP compression / row compression is the most a HARTS that
matched the baseline's per-FLOP efficiency could reach.

The single-device ``benchmarks.speedup`` also charges planner time (Core) and profiles where HARTS
loses; this one measures what a user of ``train.py`` gets, with the communication of the layout.
"""
from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.output import write_results


def load_metrics(path: str) -> list[dict]:
    recs = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e})") from None
    if not recs:
        raise ValueError(f"{path}: no metrics records")
    return recs


def summarize(recs: list[dict], skip: int, path: str) -> dict:
    kept = [r for r in recs if r.get("step", 0) > skip]
    if not kept:
        raise ValueError(f"{path}: no steps after the {skip} warm-up steps (last step {recs[-1].get('step')}); "
                         "lower --skip or train longer")
    missing = [k for k in ("step_s", "raw_tokens", "compact_rows", "harts") if k not in kept[0]]
    if missing:
        raise ValueError(f"{path}: records lack {missing}; is this a train.py metrics.jsonl?")

    def mean(k):
        vals = [r[k] for r in kept if r.get(k) is not None]
        return statistics.fmean(vals) if vals else None

    cores = [r["fbgrad_s"] + r["plan_s"] + r["pack_s"] for r in kept
             if all(r.get(k) is not None for k in ("fbgrad_s", "plan_s", "pack_s"))]
    return {"path": path, "harts": bool(kept[0]["harts"]), "steps": [r["step"] for r in kept],
            **{k: kept[0].get(k) for k in ("world", "dp", "tp", "pp", "cp", "ep")},
            "step_s": mean("step_s"), "step_s_min": min(r["step_s"] for r in kept),
            "fbgrad_s": mean("fbgrad_s"), "plan_s": mean("plan_s"), "pack_s": mean("pack_s"),
            "core_s": statistics.fmean(cores) if len(cores) == len(kept) else None,
            "raw_tokens": mean("raw_tokens"),
            "compact_rows": mean("compact_rows"), "peak_mem_gib": max(r.get("peak_mem_gib") or 0.0 for r in kept),
            "mfu": mean("mfu"), "microbatches": mean("microbatches"), "loss": [r.get("loss") for r in kept]}


def compare(h: dict, b: dict) -> dict:
    if not h["harts"] or b["harts"]:
        raise ValueError(f"expected a HARTS run and a baseline run, got harts={h['harts']} ({h['path']}) and "
                         f"harts={b['harts']} ({b['path']})")
    if h["raw_tokens"] != b["raw_tokens"]:
        raise ValueError(f"the runs trained different rollouts: mean raw tokens per step {h['raw_tokens']:.0f} vs "
                         f"{b['raw_tokens']:.0f} (same config and data.fixed_step = true expected)")
    comp = h["raw_tokens"] / h["compact_rows"]
    out = {"compression": comp, "speedup_step": b["step_s"] / h["step_s"]}
    out["step_over_compression"] = out["speedup_step"] / comp
    if h["fbgrad_s"] and b["fbgrad_s"]:
        out["speedup_fbgrad"] = b["fbgrad_s"] / h["fbgrad_s"]
        out["fbgrad_over_compression"] = out["speedup_fbgrad"] / comp
    if h["core_s"] and b["core_s"]:
        out["speedup_core"] = b["core_s"] / h["core_s"]
        out["core_over_compression"] = out["speedup_core"] / comp
    return out


def step_flops(cfg, dp: int, pp: int = 1) -> dict:
    """Forward FLOPs of one training step, HARTS and baseline, as the trainer plans and packs it (all DP
    replicas' microbatches); needs ``data.fixed_step`` (every step trains the same rollouts)."""
    import dataclasses

    import torch

    from benchmarks.flops import active_matmul_params, batch_forward_flops
    from harts.models.family import model_class
    from harts.runtime import pack
    from harts.train.data import StepBuilder
    from harts.train.model import model_config

    if not cfg.data.fixed_step:
        raise ValueError("--config: FLOPs are counted for one step, so the runs need data.fixed_step = true")
    with torch.device("meta"):
        mc = model_config(cfg.model)
        model = model_class(mc)(mc)
    (B, W), act = mc.layout_geometry, active_matmul_params(model)
    out, trajs = {}, None
    for name, enabled in (("harts", True), ("baseline", False)):
        run_cfg = dataclasses.replace(cfg, harts=dataclasses.replace(cfg.harts, enabled=enabled))
        builder = StepBuilder(run_cfg, dp_degree=dp, dp_rank=0, vocab_size=mc.vocab_size, chunk_size=B, conv_width=W,
                              min_slots=pp if cfg.harts.fill_pipeline else 1)  # as the trainer plans it
        trajs = builder.load(1) if trajs is None else trajs
        out[name] = sum(batch_forward_flops(model, pack([trajs[i] for i in mb], chunk_size=B, conv_width=W,
                                                        prefix_sharing=enabled), act)["total"]
                        for mb in builder.plan(trajs).microbatches)
    out["raw_tokens"] = int(sum(len(t) for t in trajs))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_speedup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--harts", required=True, help="metrics.jsonl of the harts.enabled = true run")
    ap.add_argument("--baseline", required=True, help="metrics.jsonl of the harts.enabled = false run")
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the means")
    ap.add_argument("--out", default="out/bench_train_speedup")
    ap.add_argument("--config", help="the runs' TOML config (then its --section.key=value overrides): also count the "
                                     "step's FLOPs and report the speedups against the FLOP compression")
    args, rest = ap.parse_known_args(argv)
    if rest and not args.config:
        ap.error(f"unrecognized arguments: {' '.join(rest)} (config overrides need --config)")
    h = summarize(load_metrics(args.harts), args.skip, args.harts)
    b = summarize(load_metrics(args.baseline), args.skip, args.baseline)
    res = {"args": vars(args), "harts": h, "baseline": b, **compare(h, b)}
    if args.config:
        from harts.train.config import parse_args

        f = step_flops(parse_args(["--config", args.config, *rest]), dp=h["dp"] or 1, pp=h["pp"] or 1)
        if f["raw_tokens"] != round(h["raw_tokens"]):
            raise ValueError(f"--config {args.config}: its step has {f['raw_tokens']:,} raw tokens, the runs trained "
                             f"{h['raw_tokens']:,.0f} per step; pass the runs' overrides too")
        res.update(forward_flops_harts=f["harts"], forward_flops_baseline=f["baseline"],
                   flop_compression=f["baseline"] / f["harts"])
        for k in ("step", "fbgrad", "core"):
            if res.get(f"speedup_{k}"):
                res[f"{k}_over_flop_compression"] = res[f"speedup_{k}"] / res["flop_compression"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"world {h['world']} (dp {h['dp']}, tp {h['tp']}, pp {h['pp']}, cp {h['cp']}, ep {h['ep']}), "
          f"steps {h['steps'][0]}..{h['steps'][-1]} "
          f"(first {args.skip} skipped), raw tokens/step {h['raw_tokens']:,.0f}, compact rows/step "
          f"{h['compact_rows']:,.0f}, compression {res['compression']:.3f}x")
    print("| run | F/B/Grad s | plan + pack s | Core s | step s | peak GiB | MFU |\n|---|---|---|---|---|---|---|")
    for name, r in (("baseline", b), ("HARTS", h)):
        pl = None if r["plan_s"] is None or r["pack_s"] is None else r["plan_s"] + r["pack_s"]
        print(f"| {name} | {fmt(r['fbgrad_s'], '.3f')} | {fmt(pl, '.3f')} | {fmt(r['core_s'], '.3f')} | "
              f"{r['step_s']:.3f} | {r['peak_mem_gib']:.1f} | {fmt(r['mfu'], '.3f')} |")
    print(f"speedup: F/B/Grad {fmt(res.get('speedup_fbgrad'), '.3f')}x "
          f"({fmt(res.get('fbgrad_over_compression'), '.3f')} of compression), Core "
          f"{fmt(res.get('speedup_core'), '.3f')}x ({fmt(res.get('core_over_compression'), '.3f')}), step "
          f"{res['speedup_step']:.3f}x ({res['step_over_compression']:.3f} of compression)")
    if "flop_compression" in res:
        print(f"FLOP compression {res['flop_compression']:.3f}x (row {res['compression']:.3f}x): F/B/Grad "
              f"{fmt(res.get('fbgrad_over_flop_compression'), '.3f')}, Core "
              f"{fmt(res.get('core_over_flop_compression'), '.3f')}, "
              f"step {res['step_over_flop_compression']:.3f} of it")
    write_results(args.out, "train_speedup", res, _plot)
    return 0


def _plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["compression", "F/B/Grad", "Core", "step"]
    vals = [res["compression"], res.get("speedup_fbgrad") or 0.0, res.get("speedup_core") or 0.0, res["speedup_step"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.bar(names, vals, color=["grey", "tab:blue", "tab:green", "tab:orange"])
    ax.set_ylabel("x over trajectory-wise")
    h = res["harts"]
    ax.set_title(f"train.py, world {h['world']} (dp {h['dp']}, tp {h['tp']}, pp {h['pp']}, ep {h['ep']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
