"""Where the step gradients of HARTS and the trajectory-wise baseline part: shared rows vs own rows.

``python -m benchmarks.gradgap --config configs/ling3_tiny_1gpu.toml [--section.key=value ...] --out DIR``

One-GPU trainer runs of Ling-3.0-tiny can log step-1 gradient norms of HARTS and the baseline that differ
by over 10 % before any update, on four GRPO trajectories of one group whose loss tokens lie mostly in prefixes
all four share. Under zero-mean group advantages those prefix contributions cancel in exact arithmetic:
HARTS evaluates each shared row once and sums the trajectories' coefficients on it, while the baseline
recomputes the prefix once per trajectory in differently shaped bf16 calls, so its copies cancel only up
to their rounding differences. This benchmark tests that explanation on the trainer's own step 1 and
model: it splits the loss by whether a position's row is shared by two or more trajectories of the step
(multiplicity > 1 in the HARTS layout of the whole step) and reports, per part, the norms of both paths'
gradients, the norm of their difference and their cosine. If the explanation holds, the difference
sits in the shared part and the own part agrees. "all" is the trainer's loss with its router terms (its
norm is the trainer's logged step-1 grad norm); the parts are the policy loss only.

Same model and weights for both paths (one trainer, HARTS step data and a baseline StepBuilder on the
same rollouts), the trainer's dtype, autocast and gradient accumulation (fp32 with BF16AdamW). One
path's gradient waits on the host in fp32 (31.6 GB for Ling-3.0-tiny) while the other is computed.
On CPU in float64 both paths agree to rounding in every part (tests/test_bench_gradgap.py).

``--truth``: also the fp32 gradient of the same weights (the bf16 weights upcast exactly; trajectory-wise
layout; the reference attention, MoE and log-probs in fp32, fla's KDA kernels whose dots run in TF32 on the
GPU unless ``--truth-kda reference``; the same recomputation),
and each path's distance to it, which says which of the two bf16 gradients is the more accurate one. It
costs 32 GB more on the GPU and 32 GB more on the host for Ling-3.0-tiny.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import numpy as np
import torch

from benchmarks.output import write_results

log = logging.getLogger("benchmarks.gradgap")

PARTS = ("all", "shared", "own")


def shared_masks(trajs, *, chunk_size: int, conv_width: int) -> list[np.ndarray]:
    """Per trajectory, a bool per predicted position: does its row serve two or more trajectories?"""
    from harts.runtime.batch import pack

    full = pack(list(trajs), chunk_size=chunk_size, prefix_sharing=True, conv_width=conv_width)
    mult = full.multiplicity.numpy()[full.logprob_rows.numpy()]
    off = full.logprob_offsets
    return [mult[off[i]:off[i + 1]] > 1 for i in range(len(trajs))]


def microbatch_mask(mb, plan, masks: list[np.ndarray]) -> torch.Tensor:
    """The part mask of a microbatch's positions (its trajectories in plan order, as the builder packs them)."""
    m = np.concatenate([masks[i] for i in plan.microbatches[mb.index]])
    if m.shape[0] != mb.coeff.shape[0]:
        raise ValueError(f"microbatch {mb.index}: {m.shape[0]} masked positions for {mb.coeff.shape[0]} coefficients")
    return torch.from_numpy(m)


def _param_grads(trainer, model) -> list[torch.Tensor]:
    """Gradients in ``model.named_parameters()`` order: the fp32 accumulators under BF16AdamW, else ``.grad``
    (fp32 or fp64); a parameter without one gets zeros."""
    owner = {}
    if trainer is not None and trainer.bf16_opt:
        for o in trainer.optimizers:
            o.accumulate_grads()
            owner.update({id(p): o for g in o.param_groups for p in g["params"]})
    out = []
    for _, p in model.named_parameters():
        g = owner[id(p)]._grad(p) if id(p) in owner else p.grad
        if g is None:
            g = torch.zeros_like(p, dtype=torch.float32)
        out.append(g if g.dtype == torch.float64 else g.float())
    return out


def step_gradient(trainer, data, masks, part: str, model=None) -> list[torch.Tensor]:
    """The gradient of one part of the step's loss, accumulated over the microbatches as the trainer does
    (its microbatch loss; fp32 under BF16AdamW); ``model`` (the fp32 truth) runs in place of the trainer's,
    without autocast."""
    own_model = model is None
    model = trainer.model if own_model else model
    if own_model and trainer.bf16_opt:
        for o in trainer.optimizers:
            o.zero_grad()
    model.zero_grad(set_to_none=True)
    router = trainer._router_inputs(data) if part == "all" else None
    meta_dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    for mb in data.microbatches:
        if part != "all":
            keep = microbatch_mask(mb, data.plan, masks)
            mb = dataclasses.replace(mb, coeff=mb.coeff * (keep if part == "shared" else ~keep))
        loss = trainer.microbatch_loss(mb.to(trainer.device, meta_dtype), router, model=None if own_model else model)[0]
        loss.backward()
        if own_model:
            trainer.accumulate_grads()
    return _param_grads(trainer if own_model else None, model)


def build_truth(trainer, kda_backend: str = "auto"):
    """An fp32 copy of the trainer's model (fp64 for an fp64 trainer): its weights and buffers upcast
    exactly, its recomputation. Its log-probs use the torch reference (fp32 matmuls; the fused kernel's dots
    may run in TF32); attention and MoE resolve to the references in fp32 anyway. ``kda_backend``: fla's
    fp32 KDA kernels run their dots in TF32 on the GPU (|dlogp| up to 4e-3 against the
    reference), "reference" is exact fp32 and much slower."""
    from harts.train import parallelize as par
    from harts.train.model import build_policy

    dtype = torch.float64 if trainer.dtype == torch.float64 else torch.float32
    cfg = dataclasses.replace(trainer.model_cfg, logprobs_backend="reference",
                              kda_backend=None if kda_backend == "auto" else kda_backend)
    truth = build_policy(cfg, device=trainer.device, dtype=dtype, seed=0, on_meta=True)
    truth.to_empty(device=trainer.device)
    src = dict(trainer.model.named_parameters())
    src.update(dict(trainer.model.named_buffers()))
    with torch.no_grad():
        for name, t in list(truth.named_parameters()) + list(truth.named_buffers()):
            t.copy_(src[name])
    par.apply_ac(truth, trainer.cfg.activation_checkpoint.mode)
    return truth


def param_groups(model) -> list[str]:
    """A coarse group per parameter, in ``named_parameters()`` order: where two gradients differ says why
    (routing flips move the routed experts' and the router's gradients; a mixer kernel would show in its
    mixer group)."""
    kinds = {layer.layer_idx: layer.kind.upper() for layer in model.decoder_layers()}
    out = []
    for name, _ in model.named_parameters():
        if ".mlp.experts." in name:
            g = "routed experts"
        elif ".mlp.gate." in name:
            g = "router"
        elif ".mlp." in name:
            g = "shared experts, dense MLPs"
        elif "layernorm" in name or name.endswith("o_norm.weight") or name == "model.norm.weight":
            g = "norms"
        elif ".attention." in name:
            g = f"{kinds[int(name.split('.layers.')[1].split('.')[0])]} mixers"
        elif "word_embeddings" in name or name.startswith("lm_head"):
            g = "embeddings, LM head"
        else:
            g = "other"
        out.append(g)
    return out


def compare(vectors: dict[str, list[torch.Tensor]], pairs, groups: list[str] | None = None) -> dict:
    """Norms of every vector and, per pair, the norm of the difference and the cosine; float64, one tensor
    at a time on the device of the first vector's tensor. With ``groups`` (a name per tensor) the same
    figures per group under ``"groups"``."""
    labels = list(vectors)
    shapes = {k: [tuple(t.shape) for t in v] for k, v in vectors.items()}
    if any(s != shapes[labels[0]] for s in shapes.values()):
        raise ValueError(f"the gradients do not line up: {[len(v) for v in vectors.values()]} tensors")
    count = len(vectors[labels[0]])
    groups = groups if groups is not None else ["all"] * count
    if len(groups) != count:
        raise ValueError(f"{len(groups)} group names for {count} gradient tensors")
    acc = {g: {"sq": dict.fromkeys(labels, 0.0), "dot": dict.fromkeys(pairs, 0.0), "dd": dict.fromkeys(pairs, 0.0)}
           for g in dict.fromkeys(groups)}
    for i in range(count):
        dev = vectors[labels[0]][i].device
        x = {k: vectors[k][i].to(dev, torch.float64) for k in labels}
        a_g = acc[groups[i]]
        for k in labels:
            a_g["sq"][k] += float((x[k] * x[k]).sum())
        for a, b in pairs:
            a_g["dot"][(a, b)] += float((x[a] * x[b]).sum())
            a_g["dd"][(a, b)] += float(((x[a] - x[b]) ** 2).sum())

    def figures(sq, dot, dd) -> dict:
        out = {f"norm_{k}": sq[k] ** 0.5 for k in labels}
        for a, b in pairs:
            na, nb = sq[a] ** 0.5, sq[b] ** 0.5
            out[f"diff_{a}_{b}"] = dd[(a, b)] ** 0.5
            out[f"rel_{a}_{b}"] = dd[(a, b)] ** 0.5 / max(nb, 1e-300)  # relative to the second (the reference)
            out[f"cos_{a}_{b}"] = dot[(a, b)] / max(na * nb, 1e-300)
            out[f"proj_{a}_{b}"] = dot[(a, b)] / max(nb, 1e-300)  # a's length along b's direction
        return out

    total = {"sq": {k: sum(v["sq"][k] for v in acc.values()) for k in labels},
             "dot": {p: sum(v["dot"][p] for v in acc.values()) for p in pairs},
             "dd": {p: sum(v["dd"][p] for v in acc.values()) for p in pairs}}
    out = figures(**total)
    if len(acc) > 1 or "all" not in acc:
        out["groups"] = {g: figures(**v) for g, v in acc.items()}
    return out


def run(cfg, parts=PARTS, with_truth: bool = False, truth_kda: str = "auto") -> dict:
    from harts.train.data import StepBuilder
    from harts.train.trainer import Trainer

    if not cfg.harts.enabled:
        raise ValueError("gradgap compares HARTS with the baseline: run it with harts.enabled = true")
    trainer = Trainer(cfg)
    if trainer.world_size > 1 or trainer.dims.pp > 1:
        raise ValueError("gradgap runs on one device (world size 1)")
    try:
        mc = trainer.model_cfg
        data_h, _ = trainer.loader.get()  # step 1, as the trainer's worker built it
        base_cfg = dataclasses.replace(cfg, harts=dataclasses.replace(cfg.harts, enabled=False))
        data_b = StepBuilder(base_cfg, dp_degree=1, dp_rank=0, vocab_size=mc.vocab_size, chunk_size=mc.kda_chunk_size,
                             conv_width=mc.short_conv_kernel_size).build(1)
        trajs = trainer.builder.load(1)
        masks = shared_masks(trajs, chunk_size=mc.kda_chunk_size, conv_width=mc.short_conv_kernel_size)
        n_pos = sum(len(m) for m in masks)
        n_shared = int(sum(m.sum() for m in masks))
        res = {"config": cfg.job.description, "device": str(trainer.device), "dtype": str(trainer.dtype),
               "trajectories": len(trajs), "positions": n_pos, "shared_positions": n_shared,
               "raw_tokens": data_h.stats["raw_tokens"], "compact_rows": data_h.stats["compact_rows"],
               "microbatches_harts": len(data_h.microbatches), "microbatches_baseline": len(data_b.microbatches),
               "parts": {}}
        log.info("step 1: %d trajectories, %d predicted positions, %d (%.1f %%) on shared rows; "
                 "HARTS %d microbatch(es), baseline %d", len(trajs), n_pos, n_shared, 100 * n_shared / max(n_pos, 1),
                 len(data_h.microbatches), len(data_b.microbatches))
        truth = build_truth(trainer, truth_kda) if with_truth else None
        if truth is not None:
            res["truth"] = {"dtype": str(next(truth.parameters()).dtype), "kda_backend": truth_kda,
                            "logprobs_backend": "reference"}
            log.info("truth: a copy of the model in %s (weights upcast), trajectory-wise layout, KDA backend %s",
                     next(truth.parameters()).dtype, truth_kda)
        groups = param_groups(trainer.model)
        pairs = [("harts", "baseline")] + ([("harts", "truth"), ("baseline", "truth")] if truth is not None else [])
        for part in parts:
            vec, secs = {}, {}
            if truth is not None:
                t0 = time.perf_counter()
                vec["truth"] = [g.to("cpu", copy=True) for g in step_gradient(trainer, data_b, masks, part, truth)]
                truth.zero_grad(set_to_none=True)
                secs["truth_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            # the baseline's gradient waits on the host while HARTS's is computed
            vec["baseline"] = [g.to("cpu", copy=True) for g in step_gradient(trainer, data_b, masks, part)]
            t1 = time.perf_counter()
            vec["harts"] = step_gradient(trainer, data_h, masks, part)
            t2 = time.perf_counter()
            r = compare({k: vec[k] for k in ("harts", "baseline", "truth") if k in vec}, pairs, groups)
            r.update(baseline_s=t1 - t0, harts_s=t2 - t1, **secs)
            res["parts"][part] = r
            log.info("%-6s |g| HARTS %.4e baseline %.4e  |diff| %.4e (%.3e of baseline)  cosine %.6f  "
                     "(%.0f s + %.0f s)",
                     part, r["norm_harts"], r["norm_baseline"], r["diff_harts_baseline"], r["rel_harts_baseline"],
                     r["cos_harts_baseline"], t1 - t0, t2 - t1)
            if truth is not None:
                log.info("%-6s |truth| %.4e  HARTS vs truth %.3e (cos %.6f, length along truth %.4e)  baseline vs "
                         "truth %.3e (cos %.6f, length along truth %.4e)", part, r["norm_truth"], r["rel_harts_truth"],
                         r["cos_harts_truth"], r["proj_harts_truth"], r["rel_baseline_truth"], r["cos_baseline_truth"],
                         r["proj_baseline_truth"])
            del vec
            if trainer.bf16_opt:  # room for the next part's truth
                for o in trainer.optimizers:
                    o.free_grad_buffers()
    finally:
        trainer.optimizers.zero_grad()
        trainer.loader.close()
        trainer.close()
    return res


def _row(label: str, q: dict, truth: bool) -> str:
    row = (f"| {label} | {q['norm_harts']:.4e} | {q['norm_baseline']:.4e} | {q['diff_harts_baseline']:.4e} "
           f"({q['rel_harts_baseline']:.3e}) | {q['cos_harts_baseline']:.6f} |")
    if truth:
        row += (f" {q['norm_truth']:.4e} | {q['rel_harts_truth']:.3e}, {q['cos_harts_truth']:.6f} | "
                f"{q['rel_baseline_truth']:.3e}, {q['cos_baseline_truth']:.6f} |")
    return row


def table(res: dict) -> str:
    truth = any("norm_truth" in r for r in res["parts"].values())
    head = " HARTS norm | baseline norm | HARTS - baseline | cosine |"
    if truth:
        head += " truth norm | HARTS vs truth (rel, cos) | baseline vs truth (rel, cos) |"
    rule = "|---" * (head.count("|") + 1) + "|"
    lines = [f"{res['trajectories']} trajectories, {res['positions']:,} predicted positions, "
             f"{res['shared_positions']:,} on shared rows; {res['raw_tokens']:,} raw tokens, "
             f"{res['compact_rows']:,} compact rows ({res['dtype']} on {res['device']}); difference norms relative "
             "to the second vector", "| part |" + head, rule]
    lines += [_row(part, r, truth) for part, r in res["parts"].items()]
    for part, r in res["parts"].items():
        if "groups" in r:
            lines += ["", f"{part}: by parameter group", "| group |" + head, rule]
            lines += [_row(g, q, truth) for g, q in sorted(r["groups"].items(), key=lambda kv: -kv[1]["norm_baseline"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gradgap", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/gradgap")
    ap.add_argument("--truth", action="store_true", help="also the fp32 gradient of the same weights")
    ap.add_argument("--truth-kda", default="auto", choices=("auto", "reference"),
                    help="the truth's KDA backend: auto = fla's kernels (TF32 dots on the GPU), reference = exact "
                         "fp32, slow")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {PARTS}")
    from harts.train.config import parse_args

    cfg = parse_args(rest + ["--training.steps=1", "--profile.enable=false", "--checkpoint.enable=false",
                             "--data.prefetch=1"])
    res = run(cfg, parts, with_truth=args.truth, truth_kda=args.truth_kda)
    print(table(res))
    write_results(args.out, "gradgap", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
