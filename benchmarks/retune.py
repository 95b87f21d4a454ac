"""Re-tune kernels at the model's shape: ``python -m benchmarks.retune --op kda|conv [--record PATH] --out DIR``.

The shipped autotune table (``harts.ops.tuning``) holds one config per kernel and key; fla's keys do not
include the row count, so a winner recorded at a short warm-up step also runs the 65,536-row steps of the
model benchmark. This runs one op of the model forward and backward at Ling-3.0-tiny's shape over 65,536 rows
in 7 trajectories of 5K-15K (the model benchmark's lengths), first with the table, then with the named kernels
autotuned over all their candidates (``harts.ops.tuning.retune``; ``EXTRA_CANDIDATES`` included), and prints
each kernel's device time under both, with the config each ran. ``--record PATH`` merges the new winners into
the table at PATH (``harts.ops.tuning.record``).

- ``kda``: the KDA core (``harts.ops.kda.fast.kda_fast``: gate and safe gate in the kernel, q/k L2 norm before
  it; 16 heads, K = V = 128, chunk 64); default kernels: those with ``EXTRA_CANDIDATES``.
- ``conv``: one short convolution (``harts.ops.conv.fast.short_conv_fast``: fla's causal_conv1d, 2,048 channels,
  width 4, SiLU); default kernels: its forward and backward.

Outputs of the two runs are compared (largest relative difference per output and gradient): a launch config
changes tiling and fp32 accumulation order only.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

LENS = (11628, 8402, 9745, 7204, 15452, 8114, 4991)


CONV_KERNELS = ["fla.modules.causal_conv1d.ops:causal_conv1d_fwd_kernel",
                "fla.modules.causal_conv1d.ops:causal_conv1d_bwd_kernel"]


def _lens_cu(lens):
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long)
    return sum(lens), cu_cpu.cuda(), cu_cpu


def _conv_inputs(C=2048, W=4, lens=LENS, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, cu, cu_cpu = _lens_cu(lens)
    x = dict(x=torch.randn(T, C, device="cuda", generator=g).bfloat16().requires_grad_(),
             w=(torch.randn(C, W, device="cuda", generator=g) * 0.5).requires_grad_())
    dy = torch.randn(T, C, device="cuda", generator=g).bfloat16()

    def op():
        from harts.ops.conv.fast import short_conv_fast

        return short_conv_fast(x["x"], x["w"], cu, "silu", cu_seqlens_cpu=cu_cpu)
    return x, op, dy, T


def _kda_inputs(H=16, K=128, V=128, lens=LENS, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, cu, cu_cpu = _lens_cu(lens)

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", generator=g).bfloat16().requires_grad_()

    x = dict(q=leaf(T, H, K), k=leaf(T, H, K), v=leaf(T, H, V), f=leaf(T, H, K),
             beta=torch.rand(T, H, device="cuda", generator=g).bfloat16().requires_grad_(),
             A_log=torch.zeros(H, device="cuda").requires_grad_(),
             dt_bias=torch.zeros(H * K, device="cuda").requires_grad_())
    do = torch.randn(T, H, V, device="cuda", generator=g).bfloat16()

    def op():
        from harts.ops.kda.fast import kda_fast

        return kda_fast(x["q"], x["k"], x["v"], x["f"], x["beta"], x["A_log"], x["dt_bias"], cu,
                        cu_seqlens_cpu=cu_cpu)[0]
    return x, op, do, T


def _fwd_bwd(x, op, grad):
    """One forward and backward of ``op`` on the leaves ``x`` (their gradients reset first); the output."""
    for t in x.values():
        t.grad = None
    out = op()
    torch.autograd.backward([out], [grad])
    return out.detach()


def _outputs(x, o) -> list[torch.Tensor]:
    return [o.float()] + [t.grad.float() for t in x.values()]


def _kernel_ms(fn) -> tuple[float, dict[str, float]]:
    """Wall ms per call (median, CUDA events) and device ms per kernel name of one profiled call."""
    from benchmarks.common import time_ms
    from benchmarks.kernels import _kernel_times

    return time_ms(fn, reps=5), _kernel_times(fn, top=100)["top"]


def _configs(names) -> dict[str, list]:
    from harts.ops import tuning

    ats = tuning.autotuners()
    return {n: [tuning._config_dict(c) for c in ats[n].cache.values()] for n in names if n in ats}


def run(op: str, kernels: list[str] | None, record: str | None) -> dict:
    from harts.ops import tuning

    if op == "kda":
        x, fwd, grad, rows = _kda_inputs()
        names = kernels or list(tuning.EXTRA_CANDIDATES)
        labels = ["o", "dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias"]
    else:
        x, fwd, grad, rows = _conv_inputs()
        names = kernels or CONV_KERNELS
        labels = ["y", "dx", "dw"]
    fn = lambda: _fwd_bwd(x, fwd, grad)  # noqa: E731
    before = _outputs(x, fn())  # applies the shipped table (harts.ops.tuning.tuned) and compiles
    wall0, k0 = _kernel_ms(fn)
    cfg0 = _configs(names)
    found = tuning.retune(names)
    missing = sorted(set(names) - set(found))
    if missing:
        raise SystemExit(f"retune: no autotuned kernel named {missing}; loaded: {sorted(tuning.autotuners())}")
    after = _outputs(x, fn())  # the named kernels benchmark every candidate here
    wall1, k1 = _kernel_ms(fn)
    cfg1 = _configs(names)
    diff = [((b - a).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in zip(before, after)]
    res = {"op": op, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "lens": list(LENS), "kernels_retuned": names, "config_table": cfg0, "config_retuned": cfg1,
           "fwd_bwd_ms_table": wall0, "fwd_bwd_ms_retuned": wall1, "kernel_ms_table": k0, "kernel_ms_retuned": k1,
           "max_rel_diff_outputs": dict(zip(labels, diff))}
    if record:
        tuning.record(record, command=f"python -m benchmarks.retune --op {op} --record {record}")
        res["recorded"] = record
    return res


def print_table(r: dict) -> None:
    what = "KDA core (kda_fast)" if r["op"] == "kda" else "short convolution (fla causal_conv1d, 2,048 channels)"
    print(f"\n== {what} fwd+bwd, {r['rows']:,} rows in {len(r['lens'])} trajectories, {r['device']} ==")
    print(f"  wall per call: table {r['fwd_bwd_ms_table']:.2f} ms, retuned {r['fwd_bwd_ms_retuned']:.2f} ms "
          f"({', '.join(n.split(':')[1] for n in r['kernels_retuned'])} autotuned over every candidate)")
    names = sorted(set(r["kernel_ms_table"]) | set(r["kernel_ms_retuned"]),
                   key=lambda k: -r["kernel_ms_table"].get(k, 0))
    print(f"  {'kernel':<60} {'table ms':>9} {'retuned ms':>11}")
    for n in names:
        print(f"  {n[:60]:<60} {r['kernel_ms_table'].get(n, 0):9.3f} {r['kernel_ms_retuned'].get(n, 0):11.3f}")
    for n in r["kernels_retuned"]:
        print(f"  {n}: {r['config_table'].get(n)} -> {r['config_retuned'].get(n)}")
    print("  largest relative difference of the outputs: "
          + ", ".join(f"{k} {v:.1e}" for k, v in r["max_rel_diff_outputs"].items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.retune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("kda", "conv"), default="kda")
    p.add_argument("--kernel", action="append", dest="kernels",
                   help="module:kernel to re-tune (repeatable; default: the op's, see above)")
    p.add_argument("--record", help="merge the re-tuned winners into this table (harts/ops/tuned/sm90.json)")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.retune needs a CUDA GPU (it autotunes fla's kernels there)")
    r = run(a.op, a.kernels, a.record)
    print_table(r)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"retune_{a.op}.json")
    with open(path, "w") as f:
        json.dump(r, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
