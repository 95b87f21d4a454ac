"""Trainer-level speedup (paper Table 4 at the trainer, any parallel layout, e.g. FSDP2 + EP2 on two GPUs).

``python -m harts.bench.train_speedup --harts RUN_A/metrics.jsonl --baseline RUN_B/metrics.jsonl --out DIR``

Compares two runs of ``train.py`` with the same config and data except ``--harts.enabled`` (use
``data.fixed_step = true`` so every step trains the same rollouts). Per run, over the steps after
``--skip`` warm-up steps (compilation, autotuning, allocator growth): mean F/B/Grad seconds (plan ready to
gradients, optimizer excluded), mean step seconds (optimizer included), raw tokens, compact rows, peak
memory and MFU. The speedups are the baseline's time over HARTS's; "of compression" divides by the
non-replay compression raw / compact. Writes ``train_speedup.json`` and ``train_speedup.png``.

The single-device ``harts.bench.speedup`` also charges planner time (Core) and profiles where HARTS
loses; this one measures what a user of ``train.py`` gets, with the communication of the layout.
"""
from __future__ import annotations

import argparse
import json
import statistics

from harts.bench.output import write_results


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

    return {"path": path, "harts": bool(kept[0]["harts"]), "steps": [r["step"] for r in kept],
            "world": kept[0].get("world"), "dp": kept[0].get("dp"), "ep": kept[0].get("ep"),
            "step_s": mean("step_s"), "step_s_min": min(r["step_s"] for r in kept),
            "fbgrad_s": mean("fbgrad_s"), "raw_tokens": mean("raw_tokens"),
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
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.bench.train_speedup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--harts", required=True, help="metrics.jsonl of the harts.enabled = true run")
    ap.add_argument("--baseline", required=True, help="metrics.jsonl of the harts.enabled = false run")
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the means")
    ap.add_argument("--out", default="out/bench_train_speedup")
    args = ap.parse_args(argv)
    h = summarize(load_metrics(args.harts), args.skip, args.harts)
    b = summarize(load_metrics(args.baseline), args.skip, args.baseline)
    res = {"args": vars(args), "harts": h, "baseline": b, **compare(h, b)}
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"world {h['world']} (dp {h['dp']}, ep {h['ep']}), steps {h['steps'][0]}..{h['steps'][-1]} "
          f"(first {args.skip} skipped), raw tokens/step {h['raw_tokens']:,.0f}, compact rows/step "
          f"{h['compact_rows']:,.0f}, compression {res['compression']:.3f}x")
    print("| run | F/B/Grad s | step s | peak GiB | MFU |\n|---|---|---|---|---|")
    for name, r in (("baseline", b), ("HARTS", h)):
        print(f"| {name} | {fmt(r['fbgrad_s'], '.3f')} | {r['step_s']:.3f} | {r['peak_mem_gib']:.1f} | "
              f"{fmt(r['mfu'], '.3f')} |")
    print(f"speedup: F/B/Grad {fmt(res.get('speedup_fbgrad'), '.3f')}x "
          f"({fmt(res.get('fbgrad_over_compression'), '.3f')} of compression), step {res['speedup_step']:.3f}x "
          f"({res['step_over_compression']:.3f} of compression)")
    write_results(args.out, "train_speedup", res, _plot)
    return 0


def _plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["compression", "F/B/Grad", "step"]
    vals = [res["compression"], res.get("speedup_fbgrad") or 0.0, res["speedup_step"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(names, vals, color=["grey", "tab:blue", "tab:orange"])
    ax.set_ylabel("x over trajectory-wise")
    ax.set_title(f"train.py, world {res['harts']['world']} (dp {res['harts']['dp']}, ep {res['harts']['ep']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
