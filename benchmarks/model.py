"""Trajectory-wise training step of the full Ling-3.0-tiny on one GPU: forward + backward, bf16, a packed
microbatch of whole trajectories (varlen, no padding), under an activation checkpointing policy.

    python -m benchmarks.model [--tokens 65536] [--lens uniform:4096:16384] [--iters 3] [--compile]
                                [--ac {none,selective,full}] [--out DIR]

``--ac`` (default full, the paper's setting): the model's ``checkpoint_policy`` (harts.models.ling.model);
``--no-recompute`` is ``--ac none``.

Prints a table and writes DIR/model_bench.json. ``--device cpu --dtype float32`` with a debug preset is a
smoke run of the same code (wall-clock timing, no memory figures, no profile), not a measurement. Numbers:
- tokens/s over timed iterations (CUDA events, after warm-up that includes Triton autotuning);
- MFU = model FLOPs / (time * peak), model FLOPs = 3 x forward FLOPs (fwd + 2x for bwd), counted
  honestly: 2 x active matmul parameters per token (routed experts at top-k only, shared expert, router,
  all projections, LM head; no embedding lookup), causal MLA attention 2*H*(Dqk+Dv)*L(L+1)/2 per
  sequence, the KDA chunked core per token per head 4CK + 3CV + 6KV (intra-chunk A_qk/A_kk, WY products,
  state update, output; C chunk) and the short convolutions. HFU adds the recomputed forward under
  ``--ac full`` (4x fwd); ``selective`` recomputes no matrix product, attention or KDA core (3x fwd);
- peak allocated memory; a torch.profiler breakdown of GPU kernel time by op family, and the device's idle
  time in that step with the host ops it waited on (``benchmarks.trace_summary.device_idle``), and the kernel
  time by the autograd node and op that launched it (``benchmarks.trace_summary.launchers``);
- with ``--saved-census``: what autograd keeps for backward in one more step, per layer kind and tensor shape
  (``benchmarks.saved``; complete under ``--compile --ac selective`` and ``--ac none``);
- with ``--compile``: the model compiled by ``harts.models.ling.compile_model`` (what the trainer's
  [compile] section runs), its first step's time (tracing + code generation + autotuning), the seconds
  spent in the compile backend, and the number of compilations over all steps run.
The loss is -mean log p(next token) through ``token_logprobs``, the trainer's log-prob path (the fused
``compact_logprobs`` on the fast backend): no T x V fp32 tensor is ever materialised.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import logging
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import build_model, family
from benchmarks.trace_summary import device_idle, launchers
from harts.models.common.stack import AC_POLICIES
from harts.models.ling import LingConfig, LingForCausalLM
from harts.ops import kernel_choices
from harts.train.parallelize import apply_ac

H200_BF16_DENSE_PEAK = 989.4e12  # FLOP/s, dense bf16 tensor core (H100/H200 SXM)

def trajectory_lengths(total: int, spec: str, seed: int) -> list[int]:
    kind, lo, hi = spec.split(":")
    lo, hi = int(lo), int(hi)
    if kind != "uniform":
        raise ValueError(f"--lens {spec!r}: only 'uniform:LO:HI'")
    g = torch.Generator().manual_seed(seed)
    lens, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=g)))
        lens.append(n)
        left -= n
    return lens


def forward_flops_per_step(cfg: LingConfig, model: LingForCausalLM, lens: list[int]) -> dict[str, float]:
    """Forward FLOPs of one packed step of whole trajectories (benchmarks.flops, one causal view each)."""
    from benchmarks.flops import active_matmul_params, forward_flops

    act = active_matmul_params(model)
    T = sum(lens)
    out = forward_flops(model, rows=T, kda_positions=T, views=[(L, L) for L in lens], active_params=act)
    out.pop("total")
    out["active_matmul_params"] = act
    return out


def train_step(model, ids, pos, cu, max_len, z_coef=2.9e-6):
    h = model(ids, pos, cu, max_seqlen=max_len)
    tgt = torch.roll(ids, -1)  # the last token of each trajectory predicts garbage; fine for a benchmark
    loss = -model.token_logprobs(h, tgt).mean()
    loss = loss + z_coef * sum(s.z_loss for s in model.router_stats())
    loss.backward()
    return loss.detach()


def saved_census(model, ids, pos, cu, max_len, top: int = 12) -> dict:
    """One step with ``benchmarks.saved.SavedCensus`` around its forward: saved-for-backward GiB per layer kind
    ("kda+moe", ...; "outside layers": the LM head and log-probs) and the largest saved tensor kinds."""
    from benchmarks.saved import SavedCensus

    layers = {layer.layer_idx: layer for layer in model.decoder_layers()}
    kind = {i: "+".join(layer.region_kind) for i, layer in layers.items()}
    group = lambda i: "outside layers" if i is None else kind[i]  # noqa: E731
    model.zero_grad(set_to_none=True)
    with SavedCensus(layers, model) as census:
        h = model(ids, pos, cu, max_seqlen=max_len)
        loss = -model.token_logprobs(h, torch.roll(ids, -1)).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    gib = 2.0 ** -30
    n_of = collections.Counter(group(i) for i in layers)
    per = dict.fromkeys(n_of, 0) | {"outside layers": 0}
    for i, nbytes in census.by_layer().items():
        per[group(i)] += nbytes
    return {
        "total_gib": census.total_bytes * gib,
        "by_kind": {g: {"layers": n_of.get(g, 0), "gib": b * gib,
                        "gib_per_layer": b * gib / n_of[g] if n_of.get(g) else None}
                    for g, b in sorted(per.items(), key=lambda kv: -kv[1])},
        "top": [{"kind": g, "shape": list(s), "dtype": d, "count": c, "gib": b * gib,
                 "per_layer": c / n_of[g] if n_of.get(g) else c}
                for g, s, d, c, b in census.by_shape(group)[:top]],
    }


def _sync(dev: str) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def run(args, overrides: dict) -> dict:
    dev = args.device
    cuda = torch.device(dev).type == "cuda"
    dtype = getattr(torch, args.dtype)
    cfg = LingConfig.preset(args.preset, **overrides)
    lens = trajectory_lengths(args.tokens, args.lens, args.seed)
    T = sum(lens)
    torch.manual_seed(args.seed)
    model = build_model(cfg, dev, dtype, recompute=False)
    apply_ac(model, args.ac)
    if args.compile:
        from harts.models.ling import compile_model

        compile_model(model, backend=args.compile_backend, dynamic=True)
    ids = torch.randint(0, cfg.vocab_size, (T,), device=dev)
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
    max_len = max(lens)
    params_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30

    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # as train.py (training.gc_freq): no automatic collection inside a step; collected between steps
    try:
        t0 = time.time()
        first_s = None
        for _ in range(args.warmup):
            model.zero_grad(set_to_none=True)
            train_step(model, ids, pos, cu, max_len)
            if first_s is None:
                _sync(dev)
                first_s = time.time() - t0
        _sync(dev)
        warm_s = time.time() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.iters):
            model.zero_grad(set_to_none=True)
            gc.collect(1)
            _sync(dev)
            t0 = time.perf_counter()
            loss = train_step(model, ids, pos, cu, max_len)
            _sync(dev)
            times.append(time.perf_counter() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    step_s = sorted(times)[len(times) // 2]
    fl = forward_flops_per_step(cfg, model, lens)
    fwd = fl["matmul"] + fl["attention"] + fl["kda"] + fl["conv"]
    model_flops = 3 * fwd
    hw_flops = 4 * fwd if args.ac == "full" else 3 * fwd
    res = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "kernel_choices": dataclasses.asdict(kernel_choices()),
        "preset": args.preset, "overrides": overrides, "activation_checkpoint": args.ac,
        "recompute": args.ac == "full", "dtype": args.dtype,
        "garbage_collection": "automatic collection off, a generation-1 collection before each step (untimed)",
        "tokens": T, "num_trajectories": len(lens), "max_len": max_len, "lens_spec": args.lens,
        "params_total": model.num_params(), "params_active": model.num_params(active=True),
        "params_gib": params_gb, "warmup_s": warm_s, "step_times_s": times, "step_s_median": step_s,
        "tokens_per_s": T / step_s, "loss": float(loss),
        "fwd_flops": {k: v for k, v in fl.items()}, "model_flops_per_step": model_flops,
        "mfu": model_flops / step_s / H200_BF16_DENSE_PEAK, "hfu": hw_flops / step_s / H200_BF16_DENSE_PEAK,
        "peak_mem_gib": peak, "peak_flops_assumed": H200_BF16_DENSE_PEAK, "compile": None,
    }
    if model.compile_report is not None:
        rep = model.compile_report
        res["compile"] = {"backend": rep.backend, "dynamic": rep.dynamic, "compilations": rep.compilations,
                          "by_region": dict(rep.by_region), "steps": args.warmup + args.iters,
                          "backend_s": rep.compile_seconds, "first_step_s": first_s}
    if args.saved_census:
        res["saved_census"] = saved_census(model, ids, pos, cu, max_len)
    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile

        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train_step(model, ids, pos, cu, max_len)
            torch.cuda.synchronize()
        fams: dict[str, float] = {}
        kernels = []
        for e in prof.key_averages():
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
            if us <= 0:
                continue
            fams[family(e.key)] = fams.get(family(e.key), 0.0) + us / 1e3
            kernels.append((e.key[:120], us / 1e3, e.count))
        total = sum(fams.values()) or 1.0
        res["profile_ms_by_family"] = dict(sorted(fams.items(), key=lambda kv: -kv[1]))
        res["profile_share_by_family"] = {k: v / total for k, v in res["profile_ms_by_family"].items()}
        res["profile_top_kernels"] = [{"name": n, "ms": ms, "count": c}
                                      for n, ms, c in sorted(kernels, key=lambda x: -x[1])[:40]]
        res["profile_kernel_ms_total"] = total
        # the step's wall time not spent in kernels: where the device waits, on which host op (the profiler's
        # own host overhead is included, so this bounds the idle time of an unprofiled step from above)
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            with open(f"{tmp}/trace.json") as f:
                events = json.load(f)["traceEvents"]
            res["profile_device_idle"] = device_idle(events)
            res["profile_launchers"] = launchers(events, top=40)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return res


def print_table(r: dict) -> None:
    print(f"\n== {r['preset']} trajectory-wise fwd+bwd, activation checkpointing {r['activation_checkpoint']}, on "
          f"{r['device']} (torch {r['torch']}) ==")
    rows = [
        ("backends", json.dumps(r["overrides"]) if r["overrides"] else "auto (all fast)"),
        ("tokens / trajectories / max len", f"{r['tokens']} / {r['num_trajectories']} / {r['max_len']}"),
        ("params total / active", f"{r['params_total'] / 1e9:.3f}B / {r['params_active'] / 1e9:.3f}B"),
        ("step time (median)",
         f"{r['step_s_median']:.3f} s  (all: {', '.join(f'{t:.3f}' for t in r['step_times_s'])})"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f}"),
        ("model TFLOP/step (3x fwd)", f"{r['model_flops_per_step'] / 1e12:.1f}"),
        ("fwd TFLOP: matmul/attn/kda/conv", "/".join(f"{r['fwd_flops'][k] / 1e12:.2f}" for k in
                                                     ("matmul", "attention", "kda", "conv"))),
        ("activation checkpointing", r["activation_checkpoint"]),
        ("kernel choices", " ".join(f"{k}={v}" for k, v in r.get("kernel_choices", {}).items())),
        ("MFU / HFU (peak 989 TF bf16)", f"{100 * r['mfu']:.1f}% / {100 * r['hfu']:.1f}%"),
        ("peak memory", "n/a on CPU" if r["peak_mem_gib"] is None else
         f"{r['peak_mem_gib']:.1f} GiB (params {r['params_gib']:.1f} GiB)"),
        ("warm-up (incl. autotune)", f"{r['warmup_s']:.1f} s"),
    ]
    c = r.get("compile")
    rows.append(("torch.compile", "off" if c is None else
                 f"{c['backend']}: {c['compilations']} compilations over {c['steps']} steps, first step "
                 f"{c['first_step_s']:.1f} s, {c['backend_s']:.1f} s in the backend"))
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")
    if "profile_ms_by_family" in r:
        print(f"  -- GPU kernel time by op family (one step, {r['profile_kernel_ms_total']:.0f} ms) --")
        for k, v in r["profile_ms_by_family"].items():
            print(f"  {k:<{w}}  {v:8.1f} ms  {100 * r['profile_share_by_family'][k]:5.1f}%")
        print("  -- longest kernels (one step; all 40 in the JSON) --")
        for t in r["profile_top_kernels"][:15]:
            print(f"  {t['ms']:8.1f} ms  x{t['count']:<5} [{family(t['name'])}] {t['name'][:90]}")
    if r.get("profile_launchers"):
        print("  -- kernel time by the host code that launched it (autograd node > op; all 40 in the JSON) --")
        for t in r["profile_launchers"][:15]:
            print(f"  {t['ms']:8.1f} ms  x{t['count']:<5} [{t['family']}] {t['node']} > {t['op']}")
    sc = r.get("saved_census")
    if sc:
        print(f"  -- saved for backward (one step's forward, {sc['total_gib']:.2f} GiB) --")
        for g, v in sc["by_kind"].items():
            each = "" if v["gib_per_layer"] is None else f"  ({v['layers']} layers, {v['gib_per_layer']:.3f} GiB each)"
            print(f"  {g:<{w}}  {v['gib']:8.3f} GiB{each}")
        for t in sc["top"]:
            print(f"  {t['kind']:<{w}}  {str(tuple(t['shape'])):>22} {t['dtype']:<9} x{t['per_layer']:g} per layer  "
                  f"{t['gib']:8.3f} GiB")
    idle = r.get("profile_device_idle")
    if idle:
        ops = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in list(idle["idle_by_host_op_s"].items())[:5])
        print(f"  device idle (profiled step)  {1e3 * idle['idle_s']:.1f} ms of a {1e3 * idle['span_s']:.0f} ms "
              f"span in {idle.get('gaps_count', 0)} gaps; by host op: {ops}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="ling3-tiny")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--lens", default="uniform:4096:16384", help="trajectory lengths: uniform:LO:HI")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ac", choices=AC_POLICIES, default="full",
                   help="activation checkpointing policy (LingModel.checkpoint_policy); full is the paper's")
    p.add_argument("--no-recompute", dest="ac", action="store_const", const="none", help="same as --ac none")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--saved-census", action="store_true",
                   help="one more step counting what autograd saves for backward, per layer kind (benchmarks.saved)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--backend", default=None, choices=("auto", "reference", "fast"),
                   help="LingConfig.backend for every op (default: the preset's, i.e. auto)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layers (harts.models.ling.compile_model, as the trainer does)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    p.add_argument("--out", default="out/bench_model")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before the first CUDA alloc
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("benchmarks.model: no CUDA GPU here (--device cpu runs a smoke run)")
        return 2
    # If a fast backend fails on this machine, say so and measure with that op on the reference path.
    base = {"backend": args.backend} if args.backend else {}
    attempts = [base, {**base, "moe_backend": "reference"},
                {**base, "moe_backend": "reference", "attention_backend": "reference"}]
    results, errors = None, []
    for ov in attempts:
        try:
            results = run(args, ov)
            break
        except Exception as e:
            errors.append({"overrides": ov, "traceback": traceback.format_exc()[-3000:]})
            print(f"[bench] attempt with overrides {ov} failed:\n{errors[-1]['traceback']}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
            if isinstance(e, torch.OutOfMemoryError):
                break  # a reference path would need more memory, not less
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"result": results, "failed_attempts": errors}
    (out / "model_bench.json").write_text(json.dumps(payload, indent=2) + "\n")
    if results is None:
        print("[bench] all attempts failed")
        return 1
    print_table(results)
    print(f"\nwrote {out / 'model_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
