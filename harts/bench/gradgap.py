"""Where the step gradients of HARTS and the trajectory-wise baseline part: shared rows vs own rows.

``python -m harts.bench.gradgap --config configs/ling3_tiny_1gpu.toml [--section.key=value ...] --out DIR``

Session 4's one-GPU run (docs/results.md) logged step-1 gradient norms 13 % apart (HARTS 5.83, baseline
6.60) before any update, on four GRPO trajectories of one group whose loss tokens lie mostly in prefixes
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
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import numpy as np
import torch

from harts.bench.output import write_results

log = logging.getLogger("harts.bench.gradgap")

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


def step_gradient(trainer, data, masks, part: str) -> list[torch.Tensor]:
    """The gradient of one part of the step's loss, as the trainer accumulates it (fp32 under BF16AdamW)."""
    from harts.rl.losses import token_losses

    model = trainer.model
    for o in trainer.optimizers if trainer.bf16_opt else ():
        o.zero_grad()
    model.zero_grad(set_to_none=True)
    router = trainer._router_inputs(data) if part == "all" else None
    meta_dtype = torch.float64 if trainer.dtype == torch.float64 else torch.float32
    for mb in data.microbatches:
        keep = None if part == "all" else microbatch_mask(mb, data.plan, masks)
        if keep is not None and part == "own":
            keep = ~keep
        mb = mb.to(trainer.device, meta_dtype)
        with trainer.amp:
            logp = mb.select(model(mb.batch, router))
            loss_S, *_ = token_losses(logp, mb.adv, trainer.loss_cfg, old_logp_S=mb.old_logp,
                                      ref_logp_S=mb.ref_logp)
            c = mb.coeff.to(loss_S.dtype)
            if keep is not None:
                c = c * keep.to(c.device, c.dtype)
            loss = (c * loss_S).sum()
        loss.backward()
        if trainer.bf16_opt:
            for o in trainer.optimizers:
                o.accumulate_grads()
    trainer._sync_replicated_grads()
    return [g if g.dtype == torch.float64 else g.float() for g in trainer._grads(local=False)]


def compare(g_a: list[torch.Tensor], g_b: list[torch.Tensor]) -> dict:
    """Norms, difference norm and cosine, in float64, one tensor at a time."""
    if len(g_a) != len(g_b) or any(a.shape != b.shape for a, b in zip(g_a, g_b)):
        raise ValueError(f"the two paths' gradients do not line up: {len(g_a)} vs {len(g_b)} tensors")
    aa = bb = ab = dd = 0.0
    for a, b in zip(g_a, g_b):
        a, b = a.to(torch.float64), b.to(a.device, torch.float64)
        aa += float((a * a).sum())
        bb += float((b * b).sum())
        ab += float((a * b).sum())
        dd += float(((a - b) ** 2).sum())
    na, nb = aa ** 0.5, bb ** 0.5
    return {"norm_harts": na, "norm_baseline": nb, "norm_diff": dd ** 0.5,
            "rel_diff": dd ** 0.5 / max(na, 1e-300), "cosine": ab / max(na * nb, 1e-300)}


def run(cfg, parts=PARTS) -> dict:
    from harts.train.data import StepBuilder
    from harts.train.trainer import Trainer

    if not cfg.harts.enabled:
        raise ValueError("gradgap compares HARTS with the baseline: run it with harts.enabled = true")
    trainer = Trainer(cfg)
    if trainer.world_size > 1 or trainer.dims.pp > 1:
        raise ValueError("gradgap runs on one device (world size 1)")
    try:
        mc = trainer.model_cfg
        data_h = trainer.builder.build(1)
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
        log.info("step 1: %d trajectories, %d predicted positions, %d (%.1f %%) on shared rows; HARTS %d microbatch(es), "
                 "baseline %d", len(trajs), n_pos, n_shared, 100 * n_shared / max(n_pos, 1),
                 len(data_h.microbatches), len(data_b.microbatches))
        for part in parts:
            t0 = time.perf_counter()
            # the baseline's gradient waits on the host while HARTS's is computed
            g_b = [g.to("cpu", copy=True) for g in step_gradient(trainer, data_b, masks, part)]
            t1 = time.perf_counter()
            g_h = step_gradient(trainer, data_h, masks, part)
            t2 = time.perf_counter()
            r = compare(g_h, g_b)
            r.update(baseline_s=t1 - t0, harts_s=t2 - t1)
            res["parts"][part] = r
            log.info("%-6s |g| HARTS %.4e baseline %.4e  |diff| %.4e (%.3e of HARTS)  cosine %.6f  (%.0f s + %.0f s)",
                     part, r["norm_harts"], r["norm_baseline"], r["norm_diff"], r["rel_diff"], r["cosine"],
                     t1 - t0, t2 - t1)
            del g_b, g_h
    finally:
        trainer.optimizers.zero_grad()
        trainer.loader.close()
        trainer.close()
    return res


def table(res: dict) -> str:
    lines = [f"{res['trajectories']} trajectories, {res['positions']:,} predicted positions, "
             f"{res['shared_positions']:,} on shared rows; {res['raw_tokens']:,} raw tokens, "
             f"{res['compact_rows']:,} compact rows ({res['dtype']} on {res['device']})",
             "| part | HARTS norm | baseline norm | diff norm | diff / HARTS | cosine |", "|---|---|---|---|---|---|"]
    for part, r in res["parts"].items():
        lines.append(f"| {part} | {r['norm_harts']:.4e} | {r['norm_baseline']:.4e} | {r['norm_diff']:.4e} | "
                     f"{r['rel_diff']:.3e} | {r['cosine']:.6f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/gradgap")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {PARTS}")
    from harts.train.config import parse_args

    cfg = parse_args(rest + ["--training.steps=1", "--profile.enable=false", "--checkpoint.enable=false",
                             "--data.prefetch=1"])
    res = run(cfg, parts)
    print(table(res))
    write_results(args.out, "gradgap", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
