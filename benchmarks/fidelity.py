"""Training-engine fidelity (paper 5.4, Table 5, Figure 4): ``python -m benchmarks.fidelity --out DIR``.

Fixed weights (``--checkpoint`` HF folder, or a seeded init) and one fixed SWE-like microbatch. Four runs:

- Baseline A: trajectory-wise, trajectories packed in planned order (the common reference);
- Baseline B: trajectory-wise rerun with the trajectories packed in reverse order inside each sub-batch
  (a different but equally valid packing: what rerunning a conventional trainer changes; it measures
  the numerical noise floor of the baseline itself);
- Baseline C: trajectory-wise with one trajectory per call (what a conventional trainer with a smaller
  microbatch computes). On the H200 B reproduces A exactly (the kernels are deterministic and per-row
  results do not depend on order within a call), so B's floor is 0; C changes the call shapes, and any
  kernel whose rounding depends on them flips near-tied top-k choices of random-init routers. C is the
  floor that says how far two valid bf16 executions of the same model drift when only the call shapes
  change;
- Baseline D: trajectory-wise as A with packed self-attention on the other fused kernel
  (kernel choice ``packed_attention="varlen"``: one packed flash call instead of cuDNN per sequence), what a
  conventional trainer with flash attention computes. Where the kernels are batch-invariant and the
  routers' logits exact (bf16 products in fp32), C can come close to A, and D is then the floor that
  includes a change of attention kernel: HARTS's views run their attention as pieces merged by
  log-sum-exp, so past a fork they differ from A by the rounding of a different kernel, not by call
  shapes. On CPU (reference attention) D equals A;
- HARTS with replay (the planned rounds);
- HARTS without replay (``pack(..., replay=False)``: branches start at the fork from the parent's exact
  final state, chunk phase not restored).

For every nonterminal semantic position, against Baseline A: token cosine of full-vocabulary logits
(Eq. 27; reported with and without activation recomputation), symmetric KL (Eq. 25) and |delta NLL|
(Eq. 26) binned by state-handoff depth d (how many boundary-state handoffs the HARTS-with-replay plan
makes on the way to the position's row; 5 means >= 5), plus the scalar loss difference. Writes
``fidelity.json`` and ``fidelity.png`` (Figure 4 layout).
"""
from __future__ import annotations

import argparse
import logging
import os

import numpy as np
import torch

from benchmarks.common import (
    add_workload_args,
    build_model,
    fullest_microbatch,
    in_subbatch_order,
    load_model,
    workload_step,
)
from benchmarks.output import write_results
from harts.ops import use_kernel_choices


def handoff_depth_of_rows(batch) -> np.ndarray:
    """[P] number of boundary-state handoffs on the path to each physical row (replay plan)."""
    depth_of_state = []
    row_depth = np.zeros(batch.num_phys, dtype=np.int64)
    for r in batch.rounds:
        cu = r.cu_seqlens_cpu.numpy()
        init = r.init_source.cpu().numpy()
        seq_depth = np.array([0 if s < 0 else depth_of_state[s] + 1 for s in init], dtype=np.int64)
        out = r.output_positions.cpu().numpy()
        seq_of_pos = np.searchsorted(cu, out, side="right") - 1
        if r.phys_end > r.phys_start:
            rows = np.arange(r.phys_start, r.phys_start + out.shape[0])
        else:
            rows = r.gather.cpu().numpy()[out]
        row_depth[rows] = seq_depth[seq_of_pos]
        depth_of_state.extend(seq_depth[r.emit_seq.numpy()].tolist())
    return row_depth


class KernelLog(logging.Handler):
    """The attention-kernel choices ``harts.ops.backend`` logs (each the first time it is made), by the run
    that made it, so the record says which kernels each compared run used first."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.run, self.by_run = None, {}

    def emit(self, record):
        msg = record.getMessage()
        if "attention kernel" in msg:
            self.by_run.setdefault(self.run, []).append(msg.replace("harts ", "", 1))


def _metrics(zx, za, tgt):
    lpx, lpa = zx.log_softmax(-1), za.log_softmax(-1)
    cos = torch.nn.functional.cosine_similarity(zx, za, dim=-1)
    px, pa = lpx.exp(), lpa.exp()
    symkl = 0.5 * ((pa * (lpa - lpx)).sum(-1) + (px * (lpx - lpa)).sum(-1))
    dnll = (lpx.gather(1, tgt[:, None]) - lpa.gather(1, tgt[:, None])).abs().squeeze(1)
    return cos, symkl, dnll, lpx.gather(1, tgt[:, None]).squeeze(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, scale=0.05)
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint folder, Ling-3.0 or Qwen3.5-MoE (its "
                    "config.json decides; --preset is then not used); default: the preset, seeded init")
    ap.add_argument("--block", type=int, default=1024, help="positions per logits block")
    ap.add_argument("--out", default="out/bench_fidelity")
    args = ap.parse_args(argv)

    from harts.planning import plan_microbatches
    from harts.runtime import hidden_states, pack

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    if args.checkpoint:
        model = load_model(args.checkpoint, dev, dtype, recompute=False)
    else:
        model = build_model(args.preset, dev, dtype, args.seed, recompute=False)
    cfg = model.config
    step = workload_step(args, vocab_size=cfg.vocab_size)
    # in the baseline's sub-batch order, so that both paths' positions come in the same order
    plan = plan_microbatches(step, dp_degree=1, capacity=args.capacity)
    trajs, groups = in_subbatch_order(fullest_microbatch(step, plan), args.capacity)
    harts_r = pack(trajs, config=cfg).to(dev)
    harts_n = pack(trajs, config=cfg, replay=False).to(dev)
    depth_rows = torch.as_tensor(handoff_depth_of_rows(harts_r))
    W = model.lm_head.weight

    def base_hidden(reverse=False, alone=False):
        """Per-position hidden states of the baseline, in HARTS's log-prob order: planned sub-batches, the
        same reversed, or one trajectory per call."""
        out = []
        for idx in groups:
            calls = [[i] for i in idx] if alone else [idx[::-1] if reverse else idx]
            for order in calls:
                b = pack([trajs[i] for i in order], config=cfg, prefix_sharing=False).to(dev)
                parts = b.split(hidden_states(model, b)[b.logprob_rows])
                out.extend(parts[::-1] if reverse else parts)
        return torch.cat(out)

    def other_kernel_hidden():
        """Baseline D: ``base_hidden()`` with packed self-attention on the varlen kernel."""
        with use_kernel_choices(packed_attention="varlen"):
            return base_hidden()

    res = {"args": vars(args), "model": type(model).__name__, "stats": harts_r.stats,
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    D = 6
    names = ["baseline_B", "baseline_C", "baseline_D", "harts_replay", "harts_no_replay"]
    runs = {"baseline_A": lambda: base_hidden(False), "baseline_B": lambda: base_hidden(reverse=True),
            "baseline_C": lambda: base_hidden(alone=True), "baseline_D": other_kernel_hidden,
            "harts_replay": lambda: hidden_states(model, harts_r)[harts_r.logprob_rows],
            "harts_no_replay": lambda: hidden_states(model, harts_n)[harts_n.logprob_rows]}
    kernels, backend_log = KernelLog(), logging.getLogger("harts.ops.backend")
    level = backend_log.level
    backend_log.addHandler(kernels)
    backend_log.setLevel(logging.INFO)
    try:
        with torch.no_grad():
            hs = {}
            for n, run in runs.items():
                kernels.run = n
                hs[n] = run()
    finally:
        backend_log.removeHandler(kernels)
        backend_log.setLevel(level)
    hA = hs.pop("baseline_A")
    res["attention_kernels_first_used"] = kernels.by_run
    for n, msgs in kernels.by_run.items():
        print(f"{n}: " + "; ".join(msgs))
    with torch.no_grad():
        # "With recomputation": the same forward run under activation checkpointing (it must not change
        # the logits; measured rather than assumed).
        # (The model reads its per-layer checkpointing switch at forward time; config.recompute only sets
        # its initial value.)
        model.model.checkpoint_layers = True
        with torch.enable_grad():
            hs_rc = hidden_states(model, harts_r)[harts_r.logprob_rows].detach()
        model.model.checkpoint_layers = False
        tgt = harts_r.logprob_targets
        dep = depth_rows.to(dev)[harts_r.logprob_rows].clamp_max(D - 1)
        acc = {n: {"cos": 0.0, "symkl": torch.zeros(D, dtype=torch.float64),
                   "dnll": torch.zeros(D, dtype=torch.float64)}
               for n in names}
        acc["harts_replay_recompute"] = {"cos": 0.0}
        count = torch.zeros(D, dtype=torch.float64)
        loss = {n: 0.0 for n in names + ["baseline_A"]}
        S = tgt.shape[0]
        for s in range(0, S, args.block):
            sl = slice(s, s + args.block)
            za = (hA[sl] @ W.T).float()
            d = dep[sl].cpu()
            count += torch.bincount(d, minlength=D).double()
            loss["baseline_A"] += za.log_softmax(-1).gather(1, tgt[sl, None]).sum().item()
            for n in names:
                cos, symkl, dnll, lp = _metrics((hs[n][sl] @ W.T).float(), za, tgt[sl])
                acc[n]["cos"] += cos.double().sum().item()
                acc[n]["symkl"] += torch.zeros(D, dtype=torch.float64).index_add_(0, d, symkl.double().cpu())
                acc[n]["dnll"] += torch.zeros(D, dtype=torch.float64).index_add_(0, d, dnll.double().cpu())
                loss[n] += lp.sum().item()
            zrc = (hs_rc[sl] @ W.T).float()
            cos_rc = torch.nn.functional.cosine_similarity(zrc, za, dim=-1)
            acc["harts_replay_recompute"]["cos"] += cos_rc.double().sum().item()
    res["tokens_by_depth"] = count.tolist()
    res["mean_token_cosine"] = {n: acc[n]["cos"] / S for n in acc}
    res["mean_nll"] = {n: -v / S for n, v in loss.items()}
    res["abs_loss_diff_vs_A"] = {n: abs(loss[n] - loss["baseline_A"]) / S for n in names}
    res["symkl_by_depth"] = {n: (acc[n]["symkl"] / count.clamp_min(1)).tolist() for n in names}
    res["abs_dnll_by_depth"] = {n: (acc[n]["dnll"] / count.clamp_min(1)).tolist() for n in names}
    print(f"positions {S:,}, tokens by handoff depth {[int(c) for c in count.tolist()]}")
    print(f"{'run':24s} {'mean cosine':>12s} {'|dloss|':>10s}")
    for n in names + ["harts_replay_recompute"]:
        dl = res["abs_loss_diff_vs_A"].get(n)
        print(f"{n:24s} {res['mean_token_cosine'][n]:12.7f} {'-' if dl is None else f'{dl:.2e}':>10s}")
    print(f"{'depth':>5s} " + " ".join(f"{n + ' symKL':>22s} {n + ' |dNLL|':>24s}" for n in names))
    for k in range(D):
        print(f"{k:>5d} " + " ".join(f"{res['symkl_by_depth'][n][k]:22.3e} {res['abs_dnll_by_depth'][n][k]:24.3e}"
                                     for n in names))
    write_results(args.out, "fidelity", res, _plot)
    return 0


def _plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    d = np.arange(len(res["tokens_by_depth"]))
    for ax, key, title in ((axes[0], "symkl_by_depth", "SymKL (Eq. 25)"),
                           (axes[1], "abs_dnll_by_depth", "|dNLL| (Eq. 26)")):
        for n, lab in (("baseline_B", "Baseline B (rerun)"), ("baseline_C", "Baseline C (one trajectory per call)"),
                       ("baseline_D", "Baseline D (other attention kernel)"),
                       ("harts_replay", "Replay"), ("harts_no_replay", "No-replay")):
            ax.plot(d, res[key][n], marker="o", label=lab)
        ax2 = ax.twinx()  # against the largest floor (B is exactly 0 where the kernels are deterministic)
        floor = np.max([res[key][n] for n in ("baseline_B", "baseline_C", "baseline_D")], axis=0)
        nr = np.array(res[key]["harts_no_replay"])
        ax2.plot(d, (nr / np.maximum(floor, 1e-30) - 1) * 100, "--", color="orange", label="No-replay excess %")
        ax2.set_ylabel("No-replay over the largest baseline floor (%)")
        ax.set_xticks(d, [f"{k}{'+' if k == d[-1] else ''}\n{int(c):,}" for k, c in zip(d, res["tokens_by_depth"])])
        ax.set_xlabel("state-handoff depth (tokens)")
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
