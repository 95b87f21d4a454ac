"""How far a bf16 GRPO gradient is from the fp32 one, for HARTS and the baseline, as the model gets deeper.

``python -m benchmarks.bf16_depth [--layers 4 8 12 24] [--experts 128 --top-k 8] [--length 400] --out DIR``

The bf16 step-1 gradients of HARTS and the baseline can be far apart (``benchmarks.gradgap`` on one
GPU: cosine 0.62; 0.75 on positions that share nothing), on the full 24-layer Ling-3.0-tiny at random
initialisation. This asks whether that is a property of bf16 at that depth, common to both layouts, rather
than of HARTS: a Ling debug model (hidden 64, the real layer pattern and MoE routing) is built at each
depth with random weights, rounded to bf16; four trajectories share the first ``--shared`` of their
``--length`` tokens under GRPO-like advantages (+1, -1, +0.5, -0.5), so shared-prefix contributions cancel
as in the trainer's step. Per depth: the gradient of sum(adv * logp) in bf16 through the HARTS layout and
the trajectory-wise one, and in fp32 (the same bf16-rounded weights upcast, trajectory-wise), all with the
reference kernels on the CPU; reported as the relative distances between the three, overall and by
parameter group (benchmarks.gradgap). In float64 the HARTS and baseline gradients agree to ~1e-15
(tests/test_bench_gradgap.py), so what this shows is rounding, amplified by depth.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from benchmarks.gradgap import compare, param_groups
from benchmarks.output import write_results

PAIRS = [("harts", "baseline"), ("harts", "truth"), ("baseline", "truth"), ("baseline_split", "truth")]


def shared_prefix_trajectories(rng, vocab: int, length: int, shared: float, n: int = 4) -> list[list[int]]:
    root = rng.integers(0, vocab, length).tolist()
    p = int(shared * length)
    return [root[:p] + rng.integers(0, vocab, length - p).tolist() for _ in range(n)]


def gradients_at_depth(layers: int, experts: int, top_k: int, length: int, shared: float, seed: int = 0,
                       low: torch.dtype = torch.bfloat16, high: torch.dtype = torch.float32) -> dict:
    """``low``: the compared computations' dtype; ``high``: the truth's (float64/float64 in the tests: all
    four must then agree)."""
    from harts.models.ling import LingConfig, LingForCausalLM
    from harts.runtime import pack

    cfg = LingConfig.preset("ling3-tiny-debug", num_hidden_layers=layers, num_experts=experts,
                            num_experts_per_tok=top_k, backend="reference")
    torch.manual_seed(seed)
    bf = LingForCausalLM(cfg).cast_(low)
    truth = LingForCausalLM(cfg).to(high)
    with torch.no_grad():
        for t, b in zip(list(truth.parameters()) + list(truth.buffers()), list(bf.parameters()) + list(bf.buffers())):
            t.copy_(b)
    trajs = shared_prefix_trajectories(np.random.default_rng(seed + 1), cfg.vocab_size, length, shared)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    hb = pack(trajs, chunk_size=cfg.kda_chunk_size)
    bb = pack(trajs, chunk_size=cfg.kda_chunk_size, prefix_sharing=False)
    acc_dtype = torch.promote_types(high, torch.float32)  # gradients compared in fp32 at least

    def grads(m, batch, adv=adv):
        m.zero_grad(set_to_none=True)
        lp = m.logprobs(batch)
        dt = torch.promote_types(lp.dtype, torch.float32)  # the loss in fp32 at least, as in the trainer
        coef = torch.cat([a.expand(len(x)) for a, x in zip(adv, batch.split(lp))])
        (coef.to(dt) * lp.to(dt)).sum().backward()
        return [p.grad.to(acc_dtype) if p.grad is not None else torch.zeros_like(p, dtype=acc_dtype)
                for p in m.parameters()]

    def grads_split(m):
        """The trainer's one-GPU baseline: one trajectory per microbatch, each backward's bf16 parameter
        gradient summed in fp32 (BF16AdamW's accumulation), so each trajectory's gradient is rounded to
        bf16 before the advantages' cancellation across trajectories."""
        acc = [torch.zeros_like(p, dtype=acc_dtype) for p in m.parameters()]
        for a, t in zip(adv, trajs):
            for x, g in zip(acc, grads(m, pack([t], chunk_size=cfg.kda_chunk_size, prefix_sharing=False), [a])):
                x += g
        return acc

    vec = {"harts": grads(bf, hb), "baseline": grads(bf, bb), "baseline_split": grads_split(bf),
           "truth": grads(truth, bb)}
    return compare(vec, PAIRS, param_groups(bf))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bf16_depth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12, 24])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--length", type=int, default=400, help="tokens per trajectory")
    ap.add_argument("--shared", type=float, default=0.85, help="share of each trajectory in the common prefix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_bf16_depth")
    args = ap.parse_args(argv)
    res = {"args": vars(args), "torch": torch.__version__, "depths": {}}
    print("| layers | HARTS vs baseline | HARTS vs fp32 | baseline vs fp32 | baseline, one trajectory per backward, "
          "vs fp32 | cos(HARTS, baseline) | s |")
    print("|---|---|---|---|---|---|---|")
    for L in args.layers:
        t0 = time.perf_counter()
        r = gradients_at_depth(L, args.experts, args.top_k, args.length, args.shared, args.seed)
        r["seconds"] = time.perf_counter() - t0
        res["depths"][L] = r
        print(f"| {L} | {r['rel_harts_baseline']:.3e} | {r['rel_harts_truth']:.3e} | {r['rel_baseline_truth']:.3e} | "
              f"{r['rel_baseline_split_truth']:.3e} | {r['cos_harts_baseline']:.4f} | {r['seconds']:.0f} |", flush=True)
    write_results(args.out, "bf16_depth", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
