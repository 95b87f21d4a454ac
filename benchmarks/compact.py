"""HARTS vs the trajectory-wise baseline on the same microbatch: time, memory and logit fidelity.

``python -m benchmarks.compact --preset ling3-tiny --scale 0.1 --capacity 65536 --out DIR``

Generates a SWE-like step, plans microbatches at ``capacity`` (DP 1) and takes the first microbatch.
HARTS runs it as one compact batch; the baseline runs the same trajectories trajectory-wise, in the
trainer's baseline sub-batches of at most ``capacity`` raw tokens (``benchmarks.common.subbatches``; the
trajectories are taken in sub-batch order, so each sub-batch is a contiguous run of positions). Both use
full-layer activation recomputation and the same fast backends. Reports forward+backward time, peak memory,
compression, replay rows, MLA view size, and the mean token cosine of full-vocabulary logits and max
|delta log-prob| between the two paths (paper Eq. 27).
Writes ``compact.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import add_workload_args, build_model, fullest_microbatch, in_subbatch_order, workload_step
from benchmarks.output import write_results


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _logit_agreement(ha_ND, hb_ND, w_VD, tgt_N, block: int = 2048, per_token: bool = False):
    """Per-token cosine of full-vocabulary logits and |delta log-prob| of the target, in blocks (the
    logits in w's dtype)."""
    cos, dlp = [], []
    for s in range(0, ha_ND.shape[0], block):
        za = (ha_ND[s:s + block].to(w_VD.dtype) @ w_VD.T).float()
        zb = (hb_ND[s:s + block].to(w_VD.dtype) @ w_VD.T).float()
        cos.append(torch.nn.functional.cosine_similarity(za, zb, dim=-1).double().cpu())
        t = tgt_N[s:s + block, None]
        dlp.append((za.log_softmax(-1).gather(1, t) - zb.log_softmax(-1).gather(1, t)).abs().double().cpu())
    c, d = torch.cat(cos), torch.cat(dlp)
    out = {"tokens": int(c.numel()), "mean_cosine": c.mean().item(), "cosine_p1": c.quantile(0.01).item(),
           "cosine_p50": c.median().item(), "cosine_min": c.min().item(), "max_abs_dlogprob": d.max().item(),
           "mean_abs_dlogprob": d.mean().item()}
    return (out, c) if per_token else out


def _routing(model, run, rows_of):
    """Top-k expert sets [positions, K] of every MoE layer while ``run()`` executes, at the rows
    ``rows_of(call)`` of each call (one call per batch, in order). The router is re-evaluated on the
    layer's input in a pre-hook (the same function the layer calls), so nothing in the model changes."""
    from harts.ops.moe import route

    layers = model.moe_layers()
    seen = [[] for _ in layers]
    calls = [0] * len(layers)

    def hook(i):
        def pre(mod, args):
            c = mod.cfg
            idx = route(args[0], mod.gate.weight, mod.gate.expert_bias, n_group=c.n_group, topk_group=c.topk_group,
                        top_k=c.num_experts_per_tok, routed_scaling_factor=c.routed_scaling_factor,
                        norm_topk_prob=c.norm_topk_prob)[2]
            seen[i].append(idx[rows_of(calls[i])].to(torch.int16))
            calls[i] += 1
        return pre

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(layers)]
    try:
        result = run()
    finally:
        for h in handles:
            h.remove()
    return result, [torch.cat(s) for s in seen]


def _timing(res, model, hb, subs, run_harts, run_base, args, dev):
    """Forward+backward time and peak memory of both paths, and the FLOPs the method permits."""
    for name, fn in (("harts", run_harts), ("baseline", run_base)):
        times = []
        for _ in range(args.repeats + 1):  # first run warms up kernels (autotune)
            model.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        res[name] = {"fwd_bwd_s": min(times[1:]) if len(times) > 1 else times[0], "all_s": times,
                     "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None}
        print(f"{name:9s} fwd+bwd {res[name]['fwd_bwd_s']:.3f}s (runs {[round(t, 3) for t in times]}), "
              f"peak {res[name]['peak_mem_gb']}", flush=True)
    model.zero_grad(set_to_none=True)
    res["speedup"] = res["baseline"]["fwd_bwd_s"] / res["harts"]["fwd_bwd_s"]
    write_results(args.out, "compact", res)
    # What the method allows: attention of shared-prefix suffixes still spans the prefix (benchmarks.flops)
    from benchmarks.flops import batch_forward_flops

    f_h = batch_forward_flops(model, hb)
    f_b = {k: sum(batch_forward_flops(model, b)[k] for b in subs) for k in f_h}
    res["forward_flops"] = {"harts": f_h, "baseline": f_b}
    res["flop_compression"] = f_b["total"] / f_h["total"]
    print(f"forward FLOPs: baseline {f_b['total']:.3e} (attention {f_b['attention'] / f_b['total']:.1%}), HARTS "
          f"{f_h['total']:.3e} (attention {f_h['attention'] / f_h['total']:.1%}); FLOP compression "
          f"{res['flop_compression']:.2f}x vs row compression {hb.stats['raw_tokens'] / hb.num_rows:.2f}x; speedup / "
          f"FLOP compression {res['speedup'] / res['flop_compression']:.3f}", flush=True)


def loss_fn(lp, adv):
    return -(adv * lp).mean()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compact", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, scale=0.1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--truth", choices=("none", "float32", "float64"), default="none",
                    help="also run the baseline in this precision (same weights, reference KDA/conv kernels: no "
                         "new Triton compiles) and report both bf16 paths against it")
    ap.add_argument("--truth-subbatches", type=int, default=1,
                    help="run the truth on this many of the baseline's sub-batches (a prefix of the positions)")
    ap.add_argument("--no-timing", dest="timing", action="store_false",
                    help="skip the forward+backward timing (and FLOP count): fidelity parts only")
    ap.add_argument("--out", default="out/bench_compact")
    args = ap.parse_args(argv)

    from harts.planning import plan_microbatches
    from harts.runtime import pack

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    step = workload_step(args)
    t0 = time.perf_counter()
    plan = plan_microbatches(step, dp_degree=1, capacity=args.capacity)
    t_mb = time.perf_counter() - t0
    trajs, groups = in_subbatch_order(fullest_microbatch(step, plan), args.capacity)  # sub-batches contiguous
    model = build_model(args.preset, dev, dtype, args.seed)
    t0 = time.perf_counter()
    hb = pack(trajs, config=model.config)
    t_pack = time.perf_counter() - t0
    hb = hb.to(dev)
    subs = [pack([trajs[i] for i in idx], config=model.config, prefix_sharing=False).to(dev)
            for idx in groups]
    print(f"fullest microbatch: {len(trajs)} trajectories, raw {hb.stats['raw_tokens']:,}, compact "
          f"{hb.num_rows:,} (x{hb.stats['raw_tokens'] / hb.num_rows:.2f}), KDA calls {hb.stats['kda_calls']}, "
          f"replay {hb.stats['replay_tokens']:,}, MLA KV rows {hb.stats['mla_kv_rows']:,}; baseline "
          f"{len(subs)} sub-batches; planning {t_mb:.2f}s + pack {t_pack:.2f}s", flush=True)
    g = torch.Generator(device="cpu").manual_seed(1)
    adv_h = torch.randn(hb.logprob_rows.shape[0], generator=g).to(dev)

    def run_harts():
        lp = model.logprobs(hb)
        loss_fn(lp, adv_h).backward()

    def run_base():
        o = 0
        for b in subs:
            n = b.logprob_rows.shape[0]
            lp = model.logprobs(b)
            loss_fn(lp, adv_h[o:o + n]).backward()
            o += n

    res = {"args": vars(args), "raw_tokens": hb.stats["raw_tokens"], "compact_rows": hb.num_rows,
           "stats": hb.stats, "plan_s": t_mb, "pack_s": t_pack, "device": torch.cuda.get_device_name()
           if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    if args.timing:
        _timing(res, model, hb, subs, run_harts, run_base, args, dev)
    # written again as the fidelity parts finish: a cut-off run keeps what it measured
    write_results(args.out, "compact", res)

    # Fidelity: full-vocabulary logits of every nonterminal semantic position, both paths. The control
    # ("floor") runs the trajectory-wise baseline a second time, one trajectory per sub-batch in reverse
    # order: same math, other matmul shapes and reduction orders. In bf16 a randomly initialised MoE
    # model is sensitive to such rounding (router top-k flips), so HARTS-vs-baseline must be read
    # against baseline-vs-baseline, not only against an absolute threshold.
    with torch.no_grad():
        from harts.runtime import hidden_states

        W = model.lm_head.weight
        h_harts, r_harts = _routing(model, lambda: hidden_states(model, hb)[hb.logprob_rows],
                                    lambda call: hb.logprob_rows)
        h_base, r_base = _routing(model, lambda: torch.cat([hidden_states(model, b)[b.logprob_rows] for b in subs]),
                                  lambda call: subs[call].logprob_rows)
        alt = [pack([t], config=model.config, prefix_sharing=False).to(dev) for t in reversed(trajs)]
        h_alt = torch.cat([hidden_states(model, b)[b.logprob_rows] for b in alt][::-1])  # back to trajectory order
        tgt = torch.cat([b.logprob_targets for b in subs])
        res["fidelity"] = {"baseline_vs_baseline_floor": _logit_agreement(h_alt, h_base, W, tgt)}
        res["fidelity"]["harts_vs_baseline"], cos_hb = _logit_agreement(h_harts, h_base, W, tgt, per_token=True)
        # Does rounding flip experts? Per MoE layer, the share of positions whose top-k set differs between
        # the two paths; and the logit cosine of positions routed identically in every layer vs the rest.
        same_LN = torch.stack([(a == b).all(-1) for a, b in zip(r_harts, r_base)]).cpu()
        all_same = same_LN.all(0)
        res["routing"] = {
            "moe_layers": int(same_LN.shape[0]),
            "topk_differs_per_layer": (1 - same_LN.double().mean(1)).tolist(),
            "positions_routed_identically_everywhere": all_same.double().mean().item(),
            "mean_cosine_identical_routing": cos_hb[all_same].mean().item() if all_same.any() else None,
            "mean_cosine_some_flip": cos_hb[~all_same].mean().item() if (~all_same).any() else None,
        }
        del r_harts, r_base
        res["mean_token_cosine"] = res["fidelity"]["harts_vs_baseline"]["mean_cosine"]
        res["max_abs_dlogprob"] = res["fidelity"]["harts_vs_baseline"]["max_abs_dlogprob"]
        write_results(args.out, "compact", res)
        if args.truth != "none":
            # Which path is closer to exact arithmetic? Same (rounded) weights in higher precision.
            tdt = getattr(torch, args.truth)
            f = res["fidelity"]["harts_vs_baseline"]
            print(f"harts vs baseline mean cosine {f['mean_cosine']:.6f} (floor "
                  f"{res['fidelity']['baseline_vs_baseline_floor']['mean_cosine']:.6f}); {args.truth} truth run "
                  "(reference KDA/conv kernels) ...", flush=True)
            model.zero_grad(set_to_none=True)
            mt = build_model(args.preset, dev, tdt, args.seed, kda_backend="reference", conv_backend="reference")
            for pt, pb in zip(list(mt.parameters()) + list(mt.buffers()),
                              list(model.parameters()) + list(model.buffers())):
                pt.copy_(pb)
            # the first --truth-subbatches sub-batches only: the reference kernels are slow at this size
            # (positions are in trajectory order and sub-batches are contiguous, so they are a prefix)
            h_true = torch.cat([hidden_states(mt, b)[b.logprob_rows] for b in subs[:args.truth_subbatches]])
            n = h_true.shape[0]
            Wt = mt.lm_head.weight
            res["fidelity"][f"harts_vs_{args.truth}_truth"] = _logit_agreement(h_harts[:n], h_true, Wt, tgt[:n])
            res["fidelity"][f"baseline_vs_{args.truth}_truth"] = _logit_agreement(h_base[:n], h_true, Wt, tgt[:n])
            res["fidelity"]["harts_vs_baseline_on_truth_positions"] = _logit_agreement(h_harts[:n], h_base[:n], W,
                                                                                       tgt[:n])
            del mt, h_true
        rt = res["routing"]
        print(f"routing: top-k set differs at {100 * max(rt['topk_differs_per_layer']):.2f}% of positions in the worst "
              f"MoE layer (first {100 * rt['topk_differs_per_layer'][0]:.3f}%, last "
              f"{100 * rt['topk_differs_per_layer'][-1]:.2f}%); "
              f"{100 * rt['positions_routed_identically_everywhere']:.1f}% "
              f"of positions routed identically in every layer, mean cosine there "
              f"{rt['mean_cosine_identical_routing']}, elsewhere {rt['mean_cosine_some_flip']}", flush=True)
        for name, f in res["fidelity"].items():
            print(f"{name:27s} mean cosine {f['mean_cosine']:.6f}  cosine P1 {f['cosine_p1']:.6f} "
                  f"P50 {f['cosine_p50']:.6f}  min {f['cosine_min']:.6f}  max |dlogp| {f['max_abs_dlogprob']:.4f}",
                  flush=True)
    max_dlp = res["max_abs_dlogprob"]
    speed = f"speedup {res['speedup']:.2f}x" if "speedup" in res else "no timing"
    print(f"{speed} at compression {hb.stats['raw_tokens'] / hb.num_rows:.2f}x; "
          f"mean token cosine {res['mean_token_cosine']:.6f}; max |dlogp| {max_dlp:.4f}", flush=True)
    write_results(args.out, "compact", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
