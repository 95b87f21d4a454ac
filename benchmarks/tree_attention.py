"""MLA tree attention on one realistic microbatch: ``python -m benchmarks.tree_attention [--out DIR]``.

The fullest planned microbatch of the synthetic step (``benchmarks.workload`` presets, Ling-3.0-tiny MLA
heads and head dims) runs fwd+bwd through
1. ``views``: the per-sequence materialised KV views (index_select over ``mla_kv_rows``, V padded to the q/k
   head dim for the flash varlen kernel, index_add backward): the path the flex path replaces;
2. ``split``: the same materialised views, each as dense cuDNN calls merged by log-sum-exp (its ancestors
   unmasked, its own rows causal; ``harts.ops.attention.split``): no V padding; the math pieces on a CPU;
3. ``split_in_place``: the split on the physical rows (``batch.mla_split_plan``, the default view kernel): each
   view's long runs of contiguous ancestor rows are read in place, only the rest is gathered;
4. ``flex``: FlexAttention over all compact rows with the ancestry block mask (keys and values in place);
5. ``baseline``: the trajectory-wise packed varlen attention of the same trajectories (sub-batches of
   ``--capacity`` raw tokens), whose time over the token compression is the ideal HARTS attention time.
Also: the block mask's build time (host counts in ``pack``, BlockMask on the device), its density (visible
pairs over computed pairs), peak memory over the inputs, and the number of graphs compiled.

Prints a table and writes ``tree_attention.json`` to --out. On a CPU (``--device cpu --dtype float32`` at a
small ``--capacity`` and ``--scale``) the flex path runs torch's eager math implementation, which forms the
P x P scores: a smoke run that keeps the code alive, not a measurement.
Legend: P physical rows, H heads, Dqk / Dv head dims.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import add_workload_args, fullest_microbatch, subbatches, time_ms, workload_step
from benchmarks.output import write_results


def _peak_mib(fn, device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def causal_pairs(cu_q: list[int], cu_k: list[int]) -> int:
    """Query-key pairs that bottom-right causal attention computes: a sequence of Lq queries over Lk keys
    sees the Lk - Lq keys before it and its own rows causally, Lq * (Lk - Lq) + Lq (Lq + 1) / 2 pairs.
    Attention FLOPs are proportional to it (4 * (Dqk + Dv) / 2 per pair and head, fwd)."""
    total = 0
    for n in range(len(cu_q) - 1):
        lq, lk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        total += lq * (lk - lq) + lq * (lq + 1) // 2
    return total


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run(args) -> dict:
    from harts.models.ling import LingConfig
    from harts.ops.attention import varlen_attention
    from harts.ops.attention.tree import tree_attention_flex, tree_attention_views
    from harts.planning import plan_microbatches
    from harts.planning.calls import plan_calls
    from harts.planning.layout import build_layout, mla_block_counts
    from harts.runtime import pack
    from harts.runtime.compact import mla_tree_mask

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = LingConfig.preset(args.preset)
    H, Dqk, Dv, B = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim, cfg.kda_chunk_size
    scale = Dqk ** -0.5
    step = workload_step(args)
    trajs = fullest_microbatch(step, plan_microbatches(step, dp_degree=1, capacity=args.capacity))
    t0 = time.perf_counter()
    hb = pack(trajs, config=cfg)
    t_pack = time.perf_counter() - t0
    lay = build_layout(plan_calls([t.tokens for t in trajs], chunk_size=B))
    t0 = time.perf_counter()
    mla_block_counts(lay, hb.mla_block_size)
    t_counts = time.perf_counter() - t0
    hb = hb.to(dev)
    P, raw = hb.num_phys, hb.stats["raw_tokens"]
    views_backend = "fast" if dev.type == "cuda" else "reference"

    g = torch.Generator(device=dev).manual_seed(0)

    def leaves(T):
        return [torch.randn(T, H, d, generator=g, device=dev, dtype=dtype).requires_grad_(True) for d in (Dqk, Dqk, Dv)]

    q, k, v = leaves(P)
    do = torch.randn(P, H, Dv, generator=g, device=dev, dtype=dtype)

    def fwd_bwd(attend, x, grad):
        def f():
            torch.autograd.grad(attend(*x), x, grad)
        return f

    def views(q, k, v):
        return tree_attention_views(q, k, v, hb.mla_q_rows, hb.mla_q_is_identity, hb.mla_kv_rows, hb.cu_seqlens_q,
                                    hb.cu_seqlens_k, scale, backend=views_backend, max_seqlen_q=hb.max_seqlen_q,
                                    max_seqlen_k=hb.max_seqlen_k, kernel="varlen")

    from harts.ops.attention.split import split_attention, split_plan

    cq_host, ck_host = hb.cu_seqlens_q.tolist(), hb.cu_seqlens_k.tolist()
    piece = "cudnn" if dev.type == "cuda" else "math"
    plan, gathered_plan = hb.mla_split_plan, split_plan(cq_host, ck_host)

    def on_rows(attend):
        """``attend`` on the views' queries, its outputs scattered back to their physical rows."""
        def f(q, k, v):
            o = attend(q if hb.mla_q_is_identity else q.index_select(0, hb.mla_q_rows), k, v)
            if hb.mla_q_is_identity and o.shape[0] == q.shape[0]:
                return o
            return torch.zeros((q.shape[0],) + o.shape[1:], dtype=o.dtype, device=o.device).index_copy(
                0, hb.mla_q_rows, o)
        return f

    kv_rows = hb.mla_kv_rows
    split = on_rows(lambda q, k, v: split_attention(q, k.index_select(0, kv_rows), v.index_select(0, kv_rows),
                                                    gathered_plan, scale, piece))
    split_in_place = on_rows(lambda q, k, v: split_attention(q, k, v, plan, scale, piece))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    mask = mla_tree_mask(hb, dev)
    sync()
    t_mask = time.perf_counter() - t0

    def flex(q, k, v):
        return tree_attention_flex(q, k, v, mask, scale)

    graphs0 = _unique_graphs()
    t0 = time.perf_counter()
    fwd_bwd(flex, (q, k, v), do)()  # compiles on CUDA
    sync()
    t_first = time.perf_counter() - t0
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "preset": args.preset, "workload": args.workload, "seed": args.seed, "scale": args.scale,
           "capacity": args.capacity, "dtype": args.dtype, "heads": H, "qk_head_dim": Dqk, "v_head_dim": Dv,
           "phys_rows": P, "raw_tokens": raw, "compression": raw / hb.num_rows,
           "mla_kv_rows": hb.stats["mla_kv_rows"], "kv_expansion": hb.stats["mla_kv_rows"] / hb.num_rows,
           "mask": {"block": mask.block, "partial_blocks": mask.partial_blocks, "full_blocks": mask.full_blocks,
                    "blocks": (mask.num_padded // mask.block) ** 2, "density": mask.density,
                    "host_counts_s": t_counts, "device_build_s": t_mask, "pack_s": t_pack},
           "flex_first_call_s": t_first, "paths": {}}
    res["split_in_place_rows"] = plan.in_place_rows
    for name, attend, x, grad in (("views", views, (q, k, v), do), ("split", split, (q, k, v), do),
                                  ("split_in_place", split_in_place, (q, k, v), do), ("flex", flex, (q, k, v), do)):
        ms = time_ms(fwd_bwd(attend, x, grad), warmup=1, reps=args.reps, device=dev)
        res["paths"][name] = {"fwd_bwd_ms": ms, "peak_extra_mib": _peak_mib(fwd_bwd(attend, x, grad), dev)}
    del q, k, v, do
    base_ms, base_peak = 0.0, 0.0
    for idx in subbatches(trajs, args.capacity):
        lens = torch.tensor([0] + [len(trajs[i]) for i in idx]).cumsum(0).to(dev)
        T = int(lens[-1])
        xb, gb = leaves(T), torch.randn(T, H, Dv, generator=g, device=dev, dtype=dtype)
        mx = int((lens[1:] - lens[:-1]).max())

        def packed(q, k, v, lens=lens, mx=mx):
            return varlen_attention(q, k, v, lens, lens, scale, backend=views_backend, max_seqlen_q=mx,
                                    max_seqlen_k=mx)

        base_ms += time_ms(fwd_bwd(packed, xb, gb), warmup=1, reps=args.reps, device=dev)
        base_peak = max(base_peak, _peak_mib(fwd_bwd(packed, xb, gb), dev) or 0.0)
    res["paths"]["baseline"] = {"fwd_bwd_ms": base_ms, "peak_extra_mib": base_peak if dev.type == "cuda" else None}
    ideal = base_ms / res["compression"]
    res["ideal_ms"] = ideal
    # the attention work itself does not compress like rows: each view's queries still see all their
    # ancestors. At the baseline's time per pair, the views' pairs would take flop_ideal_ms.
    lens = [0] + torch.tensor([len(t) for t in trajs]).cumsum(0).tolist()
    res["pairs_views"], res["pairs_baseline"] = causal_pairs(cq_host, ck_host), causal_pairs(lens, lens)
    res["flop_ideal_ms"] = base_ms * res["pairs_views"] / res["pairs_baseline"]
    for name in ("views", "split", "split_in_place", "flex"):
        p = res["paths"][name]
        p["excess_over_ideal_ms"] = p["fwd_bwd_ms"] - ideal
        p["excess_share"] = (p["fwd_bwd_ms"] - ideal) / p["fwd_bwd_ms"]
        p["excess_over_flop_ideal_share"] = (p["fwd_bwd_ms"] - res["flop_ideal_ms"]) / p["fwd_bwd_ms"]
    res["speedup_flex_over_views"] = res["paths"]["views"]["fwd_bwd_ms"] / res["paths"]["flex"]["fwd_bwd_ms"]
    for name in ("split", "split_in_place"):
        res[f"speedup_{name}_over_views"] = res["paths"]["views"]["fwd_bwd_ms"] / res["paths"][name]["fwd_bwd_ms"]
    res["compiled_graphs"] = _unique_graphs() - graphs0
    return res


def _print(res: dict) -> None:
    m = res["mask"]
    print(f"{res['device']}, torch {res['torch']}, {res['preset']} MLA: H={res['heads']}, Dqk={res['qk_head_dim']}, "
          f"Dv={res['v_head_dim']}, {res['dtype']}")
    print(f"microbatch: P={res['phys_rows']:,} rows, {res['raw_tokens']:,} raw tokens (compression "
          f"{res['compression']:.2f}x), view KV rows {res['mla_kv_rows']:,} ({res['kv_expansion']:.2f}x)")
    print(f"block mask: {m['partial_blocks']:,} partial + {m['full_blocks']:,} full of {m['blocks']:,} blocks, "
          f"density {m['density']:.3f}; host counts {m['host_counts_s'] * 1e3:.1f} ms (pack {m['pack_s']:.2f} s), "
          f"device build {m['device_build_s'] * 1e3:.1f} ms; flex first call (compile) "
          f"{res['flex_first_call_s']:.1f} s, graphs compiled {res['compiled_graphs']}")
    print(f"{'path':<15} {'fwd+bwd ms':>11} {'peak MiB':>9} {'excess/ideal ms':>16} {'excess share':>13}")
    for name in ("views", "split", "split_in_place", "flex", "baseline"):
        p = res["paths"][name]
        peak = "-" if p["peak_extra_mib"] is None else f"{p['peak_extra_mib']:,.0f}"
        ex = (f"{p['excess_over_ideal_ms']:>16.2f} {p['excess_share']:>13.1%}" if "excess_share" in p
              else f"{'':>16} {'':>13}")
        print(f"{name:<15} {p['fwd_bwd_ms']:>11.2f} {peak:>9} {ex}")
    print(f"attention pairs: views {res['pairs_views']:,}, baseline {res['pairs_baseline']:,} (attention compresses "
          f"{res['pairs_baseline'] / res['pairs_views']:.2f}x); at the baseline's time per pair the views take "
          f"{res['flop_ideal_ms']:.2f} ms: split in place "
          f"{res['paths']['split_in_place']['excess_over_flop_ideal_share']:.1%}, split "
          f"{res['paths']['split']['excess_over_flop_ideal_share']:.1%}, views "
          f"{res['paths']['views']['excess_over_flop_ideal_share']:.1%} above it")
    print(f"ideal (baseline / compression): {res['ideal_ms']:.2f} ms; speed over the view path: split in place "
          f"{res['speedup_split_in_place_over_views']:.2f}x ({res['split_in_place_rows']:,} of "
          f"{res['mla_kv_rows']:,} view key rows read in place), split {res['speedup_split_over_views']:.2f}x, flex "
          f"{res['speedup_flex_over_views']:.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tree_attention", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, scale=0.2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="folder for tree_attention.json")
    args = ap.parse_args(argv)
    res = run(args)
    _print(res)
    if args.out:
        write_results(args.out, "tree_attention", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
