"""The MLA split's dense pieces one by one against the baseline's per-trajectory calls:
``python -m benchmarks.split_pieces --seed 9002 --microbatch smallest --out DIR``.

For one planned microbatch (``benchmarks.speedup``'s choice of microbatches), every cuDNN call of one MLA layer of
the split (``harts.ops.attention.split``: the shared in-place pieces, each view's causal and gathered pieces) and
of the trajectory-wise baseline (one causal call per trajectory, padded to its length bucket) runs on random
inputs at Ling-3.0-tiny's heads and head dims; forward and backward are timed apart (CUDA events, median of
``--repeats`` after a warm-up call that builds cuDNN's plans). Each call's rate is its computed pairs' FLOPs
(2 (Dqk + Dv) per pair and head forward, 2.5x that backward) over its time, so a piece class that runs slower
per FLOP than the baseline's calls shows where the split loses. The unmasked pieces' backward is timed both
ways ``split._bwd_unmasked`` runs it: one unmasked call, and causal calls over key chunks (the split's way
where ``split.UNMASKED_BWD_AS_CAUSAL``).

Writes ``split_pieces.json`` (a row per call) and prints a table per piece class. On a CPU (``--device cpu``, a
debug preset and a small workload) the math pieces run the same plumbing: a smoke run, not a measurement.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import add_workload_args, subbatches, time_ms
from benchmarks.output import write_results


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
    piece = "cudnn" if cuda else "math"  # math: a CPU smoke run of the plumbing, no measurement
    fwd, bwd = split.PIECES[piece]
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)

    rows = []

    def run(kind: str, Lq: int, S: int, causal: bool, pairs: int):
        q, k, v = rand(Lq, H, D), rand(S, H, D), rand(S, H, Dv)
        fB = 1 if causal else split.key_chunks(Lq, S, H)
        ops = split._chunked(q, k, v, fB)
        fwd_ms = time_ms(lambda: fwd(*ops, causal, scale), warmup=1, reps=args.repeats, device=dev)
        o, lse, aux = fwd(*split._chunked(q, k, v, 1), causal, scale)
        do = rand(1, H, Lq, Dv)
        flops = 2 * (D + Dv) * H * pairs
        row = {"kind": kind, "queries": Lq, "keys": S, "causal": causal, "pairs": pairs, "fwd_chunks": fB,
               "fwd_ms": fwd_ms, "fwd_tflops": flops / fwd_ms / 1e9}
        if causal:
            ways = {"causal": lambda: bwd(do, *split._chunked(q, k, v, 1), o, lse, aux, True, scale)}
        else:
            B = split.causal_key_chunks(Lq, S, min_query_rows=0)  # timed on every piece, picked on some
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # the gradients add into the key rows, as in the split
            ways = {way: (lambda b=b: split._bwd_unmasked(bwd, b, do, split._heads_first(q), k, v, o, lse, aux, scale,
                                                          dk, dv, slice(0, S)))
                    for way, b in (("unmasked", 0), ("as_causal", B)) if way == "unmasked" or B}
            row["bwd_key_chunks"] = B
        for way, call in ways.items():
            ms = time_ms(call, warmup=1, reps=args.repeats, device=dev)
            row[f"bwd_ms_{way}"] = ms
            row[f"bwd_tflops_{way}"] = 2.5 * flops / ms / 1e9
        picked = "causal" if causal else (
            "as_causal" if split.UNMASKED_BWD_AS_CAUSAL[piece] and split.causal_key_chunks(Lq, S) else "unmasked")
        row["bwd_ms"], row["bwd_picked"] = row[f"bwd_ms_{picked}"], picked
        rows.append(row)
        print(f"  {kind:8s} {Lq:>7,} x {S:>7,} {'causal' if causal else 'full':6s} fwd {fwd_ms:7.2f} ms "
              f"{row['fwd_tflops']:4.0f} TF/s  bwd " + "  ".join(
                  f"{way} {row[f'bwd_ms_{way}']:7.2f} ms {row[f'bwd_tflops_{way}']:4.0f} TF/s" for way in ways),
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

    summary = {}
    for name, kinds in (("split", ("shared", "causal", "gathered")), ("baseline", ("baseline",))):
        mine = [r for r in rows if r["kind"] in kinds]
        summary[name] = {"pairs": sum(r["pairs"] for r in mine), "fwd_ms": sum(r["fwd_ms"] for r in mine),
                         "bwd_ms_unmasked": sum(r.get("bwd_ms_unmasked", r["bwd_ms"]) for r in mine),
                         "bwd_ms": sum(r["bwd_ms"] for r in mine)}
    print(f"\n{'':10s} {'pairs':>14s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'bwd ms':>8s} {'bwd TF/s':>9s} "
          f"{'bwd ms, unmasked pieces unmasked':>33s}")
    for k, s in summary.items():
        f = 2 * (D + Dv) * H * s["pairs"]
        print(f"{k:10s} {s['pairs']:14,} {s['fwd_ms']:8.1f} {f / s['fwd_ms'] / 1e9:9.0f} {s['bwd_ms']:8.1f} "
              f"{2.5 * f / s['bwd_ms'] / 1e9:9.0f} {s['bwd_ms_unmasked']:33.1f}")
    res = {"args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version() if cuda else None, "smoke": not cuda,
           "microbatch": pick, "raw": raws[pick], "heads": H,
           "qk_head_dim": D, "v_head_dim": Dv, "summary": summary, "calls": rows}
    write_results(args.out, "split_pieces", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
