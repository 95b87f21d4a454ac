"""HARTS vs the trajectory-wise baseline on the same microbatch: time, memory and logit fidelity.

``python -m harts.bench.compact --preset ling3-tiny --scale 0.1 --capacity 65536 --out DIR``

Generates a SWE-like step, plans microbatches at ``capacity`` (DP 1) and takes the first microbatch.
HARTS runs it as one compact batch; the baseline runs the same trajectories trajectory-wise, packed
greedily into sub-batches of at most ``capacity`` raw tokens (what a conventional trainer with the same
capacity does). Both use full-layer activation recomputation and the same fast backends. Reports
forward+backward time, peak memory, compression, replay rows, MLA view size, and the mean token
cosine of full-vocabulary logits and max |delta log-prob| between the two paths (paper Eq. 27).
Writes ``compact.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _subbatches(trajs, capacity):
    out, cur, n = [], [], 0
    for i, t in enumerate(trajs):
        if cur and n + len(t) > capacity:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += len(t)
    out.append(cur)
    return out


def build_model(preset: str, device, dtype, seed: int = 0, recompute: bool = True):
    from harts.models.ling import LingConfig, LingForCausalLM

    cfg = LingConfig.preset(preset, recompute=recompute)
    with torch.device("meta"):
        model = LingForCausalLM(cfg)
    model = model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights(seed)
    return model.cast_(dtype)


def loss_fn(lp, adv):
    return -(adv * lp).mean()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.bench.compact", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ling3-tiny")
    ap.add_argument("--workload", default="swe-step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="out/bench_compact")
    args = ap.parse_args(argv)

    from harts.data.synthetic import generate
    from harts.planning import plan_microbatches
    from harts.runtime import pack

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    step = generate(args.workload, seed=args.seed, scale=args.scale, metadata=False)
    t0 = time.perf_counter()
    plan = plan_microbatches(step, dp_degree=1, capacity=args.capacity)
    t_mb = time.perf_counter() - t0
    mb = max(range(len(plan.microbatches)), key=lambda j: plan.work[j])  # the fullest microbatch
    trajs = [step[i] for i in plan.microbatches[mb]]
    model = build_model(args.preset, dev, dtype, args.seed)
    B = model.config.kda_chunk_size
    t0 = time.perf_counter()
    hb = pack(trajs, chunk_size=B)
    t_pack = time.perf_counter() - t0
    hb = hb.to(dev)
    subs = [pack([trajs[i] for i in idx], chunk_size=B, prefix_sharing=False).to(dev)
            for idx in _subbatches(trajs, args.capacity)]
    print(f"microbatch {mb}: {len(trajs)} trajectories, raw {hb.stats['raw_tokens']:,}, compact "
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

    # Fidelity: full-vocabulary logits of every nonterminal semantic position, both paths.
    with torch.no_grad():
        from harts.runtime import hidden_states

        hh = hidden_states(model, hb)
        W = model.lm_head.weight
        cos_sum, n_tok, max_dlp = 0.0, 0, 0.0
        o = 0
        for b in subs:
            hbase = hidden_states(model, b)
            rows_b = b.logprob_rows
            rows_h = hb.logprob_rows[o:o + rows_b.shape[0]]
            for s in range(0, rows_b.shape[0], 2048):
                zb = (hbase[rows_b[s:s + 2048]] @ W.T).float()
                zh = (hh[rows_h[s:s + 2048]] @ W.T).float()
                cos_sum += torch.nn.functional.cosine_similarity(zb, zh, dim=-1).double().sum().item()
                tg = b.logprob_targets[s:s + 2048]
                lpb = zb.log_softmax(-1).gather(1, tg[:, None])
                lph = zh.log_softmax(-1).gather(1, tg[:, None])
                max_dlp = max(max_dlp, (lpb - lph).abs().max().item())
                n_tok += zb.shape[0]
            o += rows_b.shape[0]
        res["mean_token_cosine"] = cos_sum / n_tok
        res["max_abs_dlogprob"] = max_dlp
    print(f"speedup {res['speedup']:.2f}x at compression {hb.stats['raw_tokens'] / hb.num_rows:.2f}x; "
          f"mean token cosine {res['mean_token_cosine']:.6f}; max |dlogp| {max_dlp:.4f}", flush=True)
    with open(os.path.join(args.out, "compact.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
