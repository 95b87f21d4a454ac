"""Gated DeltaNet gate-gradient error at fast decays: ``python -m benchmarks.gdn_gate_grad --out DIR``.

The per-token log decay g of a Gated DeltaNet head can be very negative (Qwen3.5's scratch init reaches
about -20 per token). This bench measures, per decay rate, how far each float32 implementation's input
gradients are from a float64 truth (``harts.ops.gdn.gated_delta_rule_reference`` in float64, the per-token
recurrence), for

- ``ref32``: the same per-token recurrence in float32 (is the error float32 itself, or chunking?);
- ``gdn_round``: ``harts.ops.gdn_round.chunk_gdn_round`` (fla's GDN pieces with our scans);
- ``kda_round``: ``harts.ops.kda_round.chunk_kda_round`` with the scalar decay broadcast over K;
- ``fla``: fla's ``chunk_gated_delta_rule`` (``harts.ops.gdn.fast.gated_delta_rule_fla``).

Inputs: two packed sequences, q, k, v standard normal (q, k L2-normalised inside), beta in (0.1, 0.9), and
g = ``log_decay`` x (1 + 0.2 u), u uniform in [-1, 1] (per token and head), against a fixed random output
gradient. For each input gradient x the table gives ``rel``, ||dx - dx_true|| / ||dx_true|| (for dg the worst
value head), and ``rel_all``, ||dx - dx_true|| over the norm of all five true input gradients together:
``rel`` is how wrong the gradient is, ``rel_all`` whether that error is rounding noise at the scale of the
whole backward. ``dg_true`` is the largest per-head ||dg_true|| next to the largest ||dq_true|| etc.

On CUDA (``--device cuda``) the kernels compile; on CPU they run under the Triton interpreter in float32
(TRITON_INTERPRET=1 and fla's interpreter shims from ``tests/conftest.py``: run it through
``tests/test_bench_gdn_gate_grad.py``). The float64 truth always runs on the CPU. Writes ``gdn_gate_grad.json``.

Legend: T packed tokens, H key heads, HV value heads, K/V head dims.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

GRAD_NAMES = ("q", "k", "v", "g", "beta")
IMPLS = ("ref32", "gdn_round", "kda_round", "fla")
DEFAULT_DECAYS = (-0.01, -0.1, -1.0, -3.0, -10.0, -20.0, -40.0)


def make_inputs(T: int, H: int, HV: int, K: int, V: int, log_decay: float, seed: int) -> dict:
    """float64 CPU inputs (see the module docstring) and a fixed output gradient do_THV."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.float64
    u_TH = torch.rand(T, HV, generator=gen, dtype=d) * 2 - 1
    return dict(
        q_THK=torch.randn(T, H, K, generator=gen, dtype=d), k_THK=torch.randn(T, H, K, generator=gen, dtype=d),
        v_THV=torch.randn(T, HV, V, generator=gen, dtype=d), g_TH=log_decay * (1 + 0.2 * u_TH),
        beta_TH=0.1 + 0.8 * torch.rand(T, HV, generator=gen, dtype=d),
        cu_seqlens=torch.tensor([0, T // 2 + 3, T], dtype=torch.long),
        do_THV=torch.randn(T, HV, V, generator=gen, dtype=d))


def run_impl(impl: str, inp: dict, device: torch.device, dtype: torch.dtype, chunk_size: int) -> dict:
    """Input gradients (float64, CPU) of sum(o * do) through ``impl``."""
    from harts.ops.gdn.reference import gated_delta_rule_reference

    xs = {n: inp[f"{n}_{s}"].to(device, dtype).clone().requires_grad_() for n, s in
          zip(GRAD_NAMES, ("THK", "THK", "THV", "TH", "TH"))}
    xs["g"] = inp["g_TH"].to(device, torch.float32 if dtype != torch.float64 else dtype).clone().requires_grad_()
    cu = inp["cu_seqlens"].to(device)
    args = (xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], cu)
    if impl in ("truth", "ref32"):
        o_THV, _ = gated_delta_rule_reference(*args)
    elif impl in ("gdn_round", "kda_round"):
        from harts.ops.gdn.fast import gated_delta_rule_rounds

        o_THV, _ = gated_delta_rule_rounds(*args, chunk_size=chunk_size,
                                           round_impl="fla_pieces" if impl == "gdn_round" else "kda_kernels")
    elif impl == "fla":
        from harts.ops.gdn.fast import gated_delta_rule_fla

        o_THV, _ = gated_delta_rule_fla(*args)
    else:
        raise ValueError(f"gdn_gate_grad: unknown implementation {impl!r}; expected one of {IMPLS}")
    (o_THV.double() * inp["do_THV"].to(device)).sum().backward()
    return {n: x.grad.detach().double().cpu() for n, x in xs.items()}


def errors(grads: dict, truth: dict) -> dict:
    """Per input gradient: ``rel`` (dg: worst value head) and ``rel_all`` (see the module docstring)."""
    all_true = torch.sqrt(sum((t * t).sum() for t in truth.values())).item()
    out = {}
    for n in GRAD_NAMES:
        err = grads[n] - truth[n]
        if n == "g":
            rel = ((err.norm(dim=0) / truth[n].norm(dim=0).clamp_min(1e-300)).max()).item()
        else:
            rel = (err.norm() / truth[n].norm().clamp_min(1e-300)).item()
        out[n] = {"rel": rel, "rel_all": err.norm().item() / all_true}
    return out


def run(args) -> dict:
    device = torch.device(args.device)
    rows = []
    for ld in args.log_decays:
        inp = make_inputs(args.T, args.H, args.HV, args.K, args.V, ld, args.seed)
        truth = run_impl("truth", inp, torch.device("cpu"), torch.float64, args.chunk_size)
        row = {"log_decay": ld, "true_norms": {n: (truth[n].norm(dim=0).max() if n == "g" else truth[n].norm()).item()
                                               for n in GRAD_NAMES}}
        for impl in args.impls:
            t0 = time.perf_counter()
            row[impl] = errors(run_impl(impl, inp, device, torch.float32, args.chunk_size), truth)
            row[impl]["s"] = time.perf_counter() - t0
        rows.append(row)
    return {"device": str(device), "shape": dict(T=args.T, H=args.H, HV=args.HV, K=args.K, V=args.V),
            "chunk_size": args.chunk_size, "seed": args.seed, "impls": list(args.impls), "rows": rows}


def _print(res: dict) -> None:
    impls = res["impls"]
    print(f"gdn gate gradient vs float64 truth, {res['shape']}, chunk {res['chunk_size']}, {res['device']}")
    print("rel = ||err||/||true|| (dg: worst head); rel_all = ||err||/||all true input grads||")
    cols = " ".join(f"{i + ' dg rel':>16} {'rel_all':>8} {'dq,dk,dv,db rel':>16}" for i in impls)
    print(f"{'log g':>7} {'|dg|':>8} {'|dq|':>8} {cols}")
    for r in res["rows"]:
        cells = []
        for i in impls:
            e = r[i]
            other = max(e[n]["rel"] for n in ("q", "k", "v", "beta"))
            cells.append(f"{e['g']['rel']:16.2e} {e['g']['rel_all']:8.1e} {other:16.2e}")
        print(f"{r['log_decay']:7.2f} {r['true_norms']['g']:8.1e} {r['true_norms']['q']:8.1e} " + " ".join(cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gdn_gate_grad", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--T", type=int, default=None, help="packed tokens (default: 4096 on CUDA, 96 on CPU)")
    ap.add_argument("--H", type=int, default=None, help="key heads (default: 16 on CUDA, 2 on CPU)")
    ap.add_argument("--HV", type=int, default=None, help="value heads (default: 32 on CUDA, 4 on CPU)")
    ap.add_argument("--K", type=int, default=None, help="key/value head dim (default: 128 on CUDA, 16 on CPU)")
    ap.add_argument("--V", type=int, default=None)
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="round chunk size (default: 64 on CUDA, 32 on CPU; fla's kernel always uses 64)")
    ap.add_argument("--log-decays", type=float, nargs="+", default=list(DEFAULT_DECAYS))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_gdn_gate_grad")
    args = ap.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gdn_gate_grad: no CUDA GPU here (--device cpu runs under the interpreter)")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("benchmarks.gdn_gate_grad on CPU needs TRITON_INTERPRET=1 (and fla's interpreter shims: "
                         "run it through tests/test_bench_gdn_gate_grad.py)")
    for name, gpu, cpu in (("T", 4096, 96), ("H", 16, 2), ("HV", 32, 4), ("K", 128, 16), ("chunk_size", 64, 32)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    args.V = args.K if args.V is None else args.V
    for name in ("T", "H", "HV", "K", "V"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.HV % args.H:
        raise SystemExit(f"--HV={args.HV} must be a multiple of --H={args.H}")
    if any(ld >= 0 for ld in args.log_decays):
        raise SystemExit(f"--log-decays must be < 0 (log decays), got {args.log_decays}")
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = time.perf_counter() - t0
    _print(res)
    from benchmarks.output import write_results

    write_results(args.out, "gdn_gate_grad", res)
    print(f"\nwrote {os.path.join(args.out, 'gdn_gate_grad.json')} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
