"""Fidelity of two trainer runs at step 1 (paper Table 5 under any parallel layout).

``python -m benchmarks.layout_fidelity A B [--out DIR]``

A and B are the ``--debug.dump_hidden`` prefixes of two ``train.py`` runs of the same config, data and initial
weights (e.g. HARTS and the trajectory-wise baseline of one layout, or the baseline twice for its self-rerun
floor). Each run wrote step 1's final hidden states (the LM head's input, before any update) at every
predicted position, keyed by (trajectory, position), from every rank, and the LM head weight.

Per position, with full-vocabulary logits z = h W^T computed here in float32 from each run's own hidden
state and weight: the logit cosine (Eq. 27), the symmetric KL (Eq. 25) and |delta NLL| of the target
(Eq. 26). Prints and writes their means (``layout_fidelity.json``), with how many positions have
bit-identical hidden states (a float32 cosine of identical vectors is within ~1e-7 of 1, not 1). The
positions must match exactly: a position computed by only one run, or two ranks of one run disagreeing on
a position they both hold (TP ranks hold the same rows), is an error, not a silent drop.
"""
from __future__ import annotations

import argparse
import glob

import torch

from benchmarks.output import write_results


def load_run(prefix: str) -> dict:
    """Merge one run's per-rank dumps: keys [S, 2] sorted, hidden [S, D], targets [S], weight [V, D]."""
    files = sorted(glob.glob(f"{prefix}.rank*.pt"))
    if not files:
        raise FileNotFoundError(f"no dumps match {prefix}.rank*.pt (run train.py with --debug.dump_hidden={prefix})")
    parts = [torch.load(f, map_location="cpu") for f in files]
    keys = torch.cat([p["keys"] for p in parts])
    hidden = torch.cat([p["hidden"] for p in parts if p["keys"].shape[0]])
    targets = torch.cat([p["targets"] for p in parts])
    if keys.shape[0] == 0:
        raise ValueError(f"{prefix}: the dumps hold no positions")
    code = keys[:, 0] * (int(keys[:, 1].max()) + 1) + keys[:, 1]
    order = torch.argsort(code, stable=True)
    keys, hidden, targets, code = keys[order], hidden[order], targets[order], code[order]
    dup = torch.zeros_like(code, dtype=torch.bool)
    dup[1:] = code[1:] == code[:-1]
    if dup.any():  # the same position from several ranks (TP replicas): they must agree exactly
        first = torch.nonzero(~dup).squeeze(1)
        src = first[torch.cumsum((~dup).long(), 0)[dup] - 1]
        bad = (hidden[dup] != hidden[src]).any(1) | (targets[dup] != targets[src])
        if bad.any():
            t, p = keys[dup][bad][0].tolist()
            raise ValueError(f"{prefix}: ranks disagree on trajectory {t} position {p} ({int(bad.sum())} positions)")
        keys, hidden, targets = keys[~dup], hidden[~dup], targets[~dup]
    try:
        weight = torch.load(f"{prefix}.lm_head.pt", map_location="cpu")
    except FileNotFoundError:
        raise FileNotFoundError(f"{prefix}.lm_head.pt is missing (written by the rank holding the LM head)") from None
    return {"keys": keys, "hidden": hidden, "targets": targets, "weight": weight,
            "harts": parts[0]["harts"], "stride": parts[0]["stride"], "ranks": len(files)}


def position_metrics(ha, wa, hb, wb, targets, chunk: int = 2048, device=None) -> dict:
    """Sums over positions of cosine(z_a, z_b), symmetric KL and |delta NLL|, z = h W^T in float32."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.float64 if ha.dtype == torch.float64 else torch.float32
    wa, wb = wa.to(device, dt), wb.to(device, dt)
    sums = {"cos": 0.0, "symkl": 0.0, "dnll": 0.0, "cos_min": 1.0}
    for i in range(0, ha.shape[0], chunk):
        za = ha[i:i + chunk].to(device, dt) @ wa.T
        zb = hb[i:i + chunk].to(device, dt) @ wb.T
        t = targets[i:i + chunk].to(device)
        cos = torch.nn.functional.cosine_similarity(za, zb, dim=-1)
        la, lb = za.log_softmax(-1), zb.log_softmax(-1)
        symkl = 0.5 * ((la.exp() * (la - lb)).sum(-1) + (lb.exp() * (lb - la)).sum(-1))
        dnll = (la.gather(1, t[:, None]) - lb.gather(1, t[:, None])).abs()
        sums["cos"] += float(cos.double().sum())
        sums["symkl"] += float(symkl.double().sum())
        sums["dnll"] += float(dnll.double().sum())
        sums["cos_min"] = min(sums["cos_min"], float(cos.min()))
    return sums


def compare(a: dict, b: dict, chunk: int = 2048, device=None) -> dict:
    if a["keys"].shape != b["keys"].shape or not torch.equal(a["keys"], b["keys"]):
        ka, kb = {tuple(k) for k in a["keys"].tolist()}, {tuple(k) for k in b["keys"].tolist()}
        only = sorted(ka ^ kb)
        raise ValueError(f"the runs hold different positions: {len(ka - kb)} only in A, {len(kb - ka)} only in B, "
                         f"e.g. (trajectory, position) {only[:3]} (same config, data and debug.dump_hidden_stride?)")
    if not torch.equal(a["targets"], b["targets"]):
        raise ValueError("the runs predict different targets at the same positions (different data?)")
    if a["weight"].shape != b["weight"].shape or not torch.equal(a["weight"], b["weight"]):
        raise ValueError("the runs' LM head weights differ: they did not start from the same weights")
    s = position_metrics(a["hidden"], a["weight"], b["hidden"], b["weight"], a["targets"], chunk, device)
    n = a["keys"].shape[0]
    same = (a["hidden"] == b["hidden"]).all(1)  # bit-identical final hidden states (then the logits are too)
    return {"positions": n, "mean_cos": s["cos"] / n, "min_cos": s["cos_min"], "mean_symkl": s["symkl"] / n,
            "mean_abs_dnll": s["dnll"] / n, "identical_positions": int(same.sum()),
            "max_abs_dhidden": float((a["hidden"].double() - b["hidden"].double()).abs().max()),
            "a_harts": a["harts"], "b_harts": b["harts"], "ranks": (a["ranks"], b["ranks"]), "stride": a["stride"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layout_fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="debug.dump_hidden prefix of run A (e.g. the baseline)")
    ap.add_argument("b", help="debug.dump_hidden prefix of run B (e.g. HARTS)")
    ap.add_argument("--out", default="out/bench_layout_fidelity")
    ap.add_argument("--chunk", type=int, default=2048, help="positions per logits chunk (chunk x vocab x 4 B x 4)")
    args = ap.parse_args(argv)
    a, b = load_run(args.a), load_run(args.b)
    print(f"A: {args.a} ({'HARTS' if a['harts'] else 'baseline'}, {a['ranks']} ranks), "
          f"B: {args.b} ({'HARTS' if b['harts'] else 'baseline'}, {b['ranks']} ranks), "
          f"{a['keys'].shape[0]:,} positions (stride {a['stride']})", flush=True)
    res = {"args": vars(args), **compare(a, b, args.chunk)}
    print(f"mean logit cosine {res['mean_cos']:.8f} (min {res['min_cos']:.6f}), mean symmetric KL "
          f"{res['mean_symkl']:.3e}, mean |delta NLL| {res['mean_abs_dnll']:.3e}; bit-identical hidden states at "
          f"{res['identical_positions']:,} positions, max |delta h| {res['max_abs_dhidden']:.3e}")
    write_results(args.out, "layout_fidelity", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
