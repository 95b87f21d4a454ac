"""The MLA split's dense pieces one by one against the baseline's per-trajectory calls:
``python -m benchmarks.split_pieces --seed 9002 --microbatch smallest --out DIR``.

For one planned microbatch (``benchmarks.speedup``'s choice of microbatches), every cuDNN call of one MLA layer of
the split (``harts.ops.attention.split``: the shared in-place pieces, each view's causal and gathered pieces) and
of the trajectory-wise baseline (one causal call per trajectory, padded to its length bucket) runs on random
inputs at Ling-3.0-tiny's heads and head dims; forward and backward are timed apart (CUDA events, median of
``--repeats`` after a warm-up call that builds cuDNN's plans). Each call's rate is its computed pairs' FLOPs
(4 (Dqk + Dv) per pair and head forward, 2.5x that backward) over its time, so a piece class that runs slower
per FLOP than the baseline's calls shows where the split loses. The unmasked pieces' backward is timed at
every key-chunk count of ``--bwd-chunks`` (``split._bwd_chunked``) beside the count the split picks.

Writes ``split_pieces.json`` (a row per call) and prints a table per piece class. On a CPU (``--device cpu``, a
debug preset and a small workload) the math pieces run the same plumbing: a smoke run, not a measurement.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import add_workload_args, subbatches
from benchmarks.output import write_results


def _time_ms(fn, repeats: int, cuda: bool) -> float:
    fn()  # cuDNN plans, allocator
    times = []
    for _ in range(repeats):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> int:
    from benchmarks.speedup import planned_microbatches
    from harts.models.family import model_config
    from harts.ops.attention import split
    from harts.ops.attention.fast import _bucket
    from harts.runtime import pack

    ap = argparse.ArgumentParser(prog="python -m benchmarks.split_pieces", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, scale=0.2)
    ap.add_argument("--microbatches", type=int, default=4, help="as benchmarks.speedup: the fullest N planned")
    ap.add_argument("--microbatch", choices=("smallest", "largest"), default="smallest",
                    help="which of them by raw rows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bwd-chunks", default="1,2,4,8,16", help="key-chunk counts timed for unmasked backward calls")
    ap.add_argument("--out", default="out/bench_split_pieces")
    args = ap.parse_args(argv)
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    cuda = dev.type == "cuda"
    cfg = model_config(args.preset)
    H, D, Dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    scale = D ** -0.5
    mbs, _, _ = planned_microbatches(args)
    raws = [sum(len(t) for t in m) for m in mbs]
    pick = (min if args.microbatch == "smallest" else max)(range(len(mbs)), key=raws.__getitem__)
    trajs = mbs[pick]
    plan = pack(trajs, config=cfg).mla_split_plan
    fwd, bwd = split.PIECES["cudnn" if cuda else "math"]  # math: a CPU smoke run of the plumbing, no measurement
    chunk_counts = [int(b) for b in args.bwd_chunks.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)

    rows = []

    def run(kind: str, Lq: int, S: int, causal: bool, pairs: int):
        q, k, v = rand(Lq, H, D), rand(S, H, D), rand(S, H, Dv)
        fB = 1 if causal else split.key_chunks(Lq, S, H)
        ops = split._chunked(q, k, v, fB)
        fwd_ms = _time_ms(lambda: fwd(*ops, causal, scale), args.repeats, cuda)
        o, lse, aux = fwd(*split._chunked(q, k, v, 1), causal, scale)
        do = rand(1, H, Lq, Dv)
        flops = 4 * (D + Dv) * H * pairs
        row = {"kind": kind, "queries": Lq, "keys": S, "causal": causal, "pairs": pairs, "fwd_chunks": fB,
               "fwd_ms": fwd_ms, "fwd_tflops": flops / fwd_ms / 1e9}
        counts = [1] if causal else [b for b in chunk_counts if b == 1 or split.bwd_key_chunks(Lq, S, b) == b]
        for b in counts:
            if causal:
                call = lambda: bwd(do, *split._chunked(q, k, v, 1), o, lse, aux, True, scale)  # noqa: E731
            else:
                call = lambda b=b: split._bwd_chunked(bwd, do, split._heads_first(q), k, v, o, lse, aux, scale, b)  # noqa: E731
            ms = _time_ms(call, args.repeats, cuda)
            row[f"bwd_ms_B{b}"] = ms
            row[f"bwd_tflops_B{b}"] = 2.5 * flops / ms / 1e9
        row["bwd_chunks_picked"] = 1 if causal else split.bwd_key_chunks(Lq, S)
        rows.append(row)
        print(f"  {kind:8s} {Lq:>7,} x {S:>7,} {'causal' if causal else 'full':6s} fwd {fwd_ms:7.2f} ms "
              f"{row['fwd_tflops']:5.0f} TF/s  bwd " + "  ".join(
                  f"B{b} {row[f'bwd_ms_B{b}']:7.2f} ms {row[f'bwd_tflops_B{b}']:4.0f} TF/s" for b in counts),
              flush=True)

    print(f"microbatch {pick} of {len(mbs)} (raw {raws[pick]:,}): {len(plan.shared)} shared, {len(plan.views)} views")
    for sp in plan.shared:
        run("shared", sp.query_rows, sp.keys, False, sp.query_rows * sp.keys)
    for view in plan.views:
        n = view.own_rows
        run("causal", n, n, True, n * (n + 1) // 2)
        if view.gather[1]:
            run("gathered", view.anc_rows, view.gather[1], False, view.anc_rows * view.gather[1])
    for sb in subbatches(trajs, args.capacity):
        for i in sb:
            n = _bucket(len(trajs[i]))
            run("baseline", n, n, True, n * (n + 1) // 2)

    def total(kinds, key):
        return sum(r.get(key, r["bwd_ms_B1"]) for r in rows if r["kind"] in kinds)

    summary = {}
    for name, kinds in (("split", ("shared", "causal", "gathered")), ("baseline", ("baseline",))):
        pairs = sum(r["pairs"] for r in rows if r["kind"] in kinds)
        s = {"pairs": pairs, "fwd_ms": total(kinds, "fwd_ms"), "bwd_ms_B1": total(kinds, "bwd_ms_B1")}
        s["bwd_ms_picked"] = sum(r.get(f"bwd_ms_B{r['bwd_chunks_picked']}", r["bwd_ms_B1"])
                                 for r in rows if r["kind"] in kinds)
        for b in chunk_counts[1:]:
            s[f"bwd_ms_B{b}_where_admissible"] = total(kinds, f"bwd_ms_B{b}")
        summary[name] = s
    flops = {k: 4 * (D + Dv) * H * v["pairs"] for k, v in summary.items()}
    print(f"\n{'':10s} {'pairs':>14s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'bwd ms B1':>10s} {'bwd TF/s':>9s} "
          f"{'bwd ms picked':>14s} {'TF/s':>6s}")
    for k, s in summary.items():
        print(f"{k:10s} {s['pairs']:14,} {s['fwd_ms']:8.1f} {flops[k] / s['fwd_ms'] / 1e9:9.0f} {s['bwd_ms_B1']:10.1f} "
              f"{2.5 * flops[k] / s['bwd_ms_B1'] / 1e9:9.0f} {s['bwd_ms_picked']:14.1f} "
              f"{2.5 * flops[k] / s['bwd_ms_picked'] / 1e9:6.0f}")
    res = {"args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version() if cuda else None, "smoke": not cuda,
           "microbatch": pick, "raw": raws[pick], "heads": H,
           "qk_head_dim": D, "v_head_dim": Dv, "summary": summary, "calls": rows}
    write_results(args.out, "split_pieces", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
