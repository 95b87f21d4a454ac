"""Compare two step-1 gradient-norm dumps (``train.py --debug.dump_grad_norms=PREFIX``) parameter by parameter.

Usage: python scripts/compare_grad_norms.py REF_PREFIX RUN_PREFIX [--top N]

Each prefix names ``PREFIX.rank*.json``. DTensor gradients are full-tensor norms (every rank writes the
same value: rank 0's is used); expert weights (``.mlp.experts.``) that are plain EP-local tensors differ
per rank and are combined as sqrt(sum of squares). Prints the ratio RUN / REF per parameter kind and the
worst parameters, so a layout's excess gradient norm can be placed.
"""
import argparse
import glob
import json
import math
import re
from collections import defaultdict


def load(prefix):
    files = sorted(glob.glob(f"{prefix}.rank*.json"))
    if not files:
        raise SystemExit(f"no files match {prefix}.rank*.json")
    ranks = [json.load(open(f)) for f in files]
    out = dict(ranks[0])
    for name in out:
        vals = [r.get(name, 0.0) for r in ranks]
        if len(set(vals)) > 1 and ".mlp.experts." in name:  # EP-local plain tensors: combine
            out[name] = math.sqrt(sum(v ** 2 for v in vals))
    return out


def kind(name):
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


def main():
    ap = argparse.ArgumentParser(prog="python scripts/compare_grad_norms.py", description=__doc__.split("\n")[0])
    ap.add_argument("ref")
    ap.add_argument("run")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    ref, run = load(a.ref), load(a.run)
    missing = sorted(set(ref) ^ set(run))
    if missing:
        print(f"{len(missing)} parameters in only one dump, e.g. {missing[:5]}")
    common = [n for n in ref if n in run]
    tot_r = math.sqrt(sum(ref[n] ** 2 for n in common))
    tot_x = math.sqrt(sum(run[n] ** 2 for n in common))
    print(f"total norm ref {tot_r:.4f}  run {tot_x:.4f}  ratio {tot_x / tot_r:.4f}")
    groups = defaultdict(list)
    for n in common:
        groups[kind(n)].append(run[n] / ref[n] if ref[n] else float("nan"))
    print(f"{'parameter kind':60s} {'n':>3s} {'min':>7s} {'median':>7s} {'max':>7s}")
    for k, rs in sorted(groups.items()):
        rs = sorted(rs)
        print(f"{k:60s} {len(rs):3d} {rs[0]:7.3f} {rs[len(rs) // 2]:7.3f} {rs[-1]:7.3f}")
    worst = sorted(common, key=lambda n: -abs(math.log(max(run[n], 1e-30) / max(ref[n], 1e-30))))
    print(f"worst {a.top}:")
    for n in worst[: a.top]:
        print(f"  {n:70s} ref {ref[n]:.4e} run {run[n]:.4e} ratio {run[n] / max(ref[n], 1e-30):.3f}")


if __name__ == "__main__":
    main()
