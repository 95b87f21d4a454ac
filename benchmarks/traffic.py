"""Memory traffic of the layout's own ops, HARTS against the trajectory-wise baseline:
``python -m benchmarks.traffic [--seed 9002] [--microbatches 4] --out DIR`` (no GPU: runs on the meta device).

Why. Besides the baseline's work on fewer rows, a HARTS step runs ops of its own around the dense kernels:
the MLA split's pads, gathers, query stacking, merge and gradient scatters (``harts.ops.attention.split``) and
the KDA rounds' input gathers, output concatenation and gradient assembly (``harts.runtime.compact.kda_rounds``).
They are memory-bound, so their bytes bound their time from below (bytes / bandwidth) and their count is the
kernel launches they add. The baseline's cores have copies of their own (each trajectory padded to its length
bucket and its outputs concatenated for cuDNN; casts before fla's KDA), so the comparison is per microbatch:
HARTS's bytes against the baseline's divided by the row compression (what HARTS would move if its copies
shrank like its rows), the difference being HARTS's excess.

How. One layer's mixer core runs forward and backward on meta tensors of the model's shapes, on the same
microbatches as ``benchmarks.speedup`` (its plan, the fullest first), with the dense kernels (the cuDNN
attention pieces and calls, the chunked delta rule, fla's L2 norm) replaced by stand-ins that only shape their
outputs, under a dispatch mode that counts every other aten op: one launch each, bytes read + written
(``index_select``: its output rows read and written; ``index_add_``: the source rows read and the target rows
read and written; ``copy_``: the source read and the target written, nothing for a copy onto itself, which ATen
skips; views, allocations and ops on empty tensors: nothing). The cuDNN path's fused merge
(``harts.kernels.attn_merge``) is one launch reading each piece's rows and writing the view's. Per microbatch
the layer counts are multiplied by the layers of each kind and the forward counted twice under full
recomputation (``--ac full``, the speedup bench's default). Nothing is timed: the counts are exact for this
model of traffic and the same on any machine; ``--bandwidth`` turns bytes into a lower bound in milliseconds.

Not counted: the dense kernels (their efficiency is the GPU profile's: ``benchmarks.speedup --profile-only``),
the short convolutions (fla's varlen kernel on both paths) and the row-wise layers (the same per row).
Ling-3.0 presets only (MLA + KDA).

Legend: C compact rows, T a sub-batch's packed tokens, H heads, D q/k head dim, Dv value head dim, K KDA head dim.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import traceback
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import add_workload_args, subbatches
from benchmarks.output import write_results
from harts.models.family import model_config

# ops that move no bytes: views, allocations and metadata
_FREE = {"empty", "empty_like", "new_empty", "empty_strided", "view", "_unsafe_view", "transpose", "unsqueeze",
         "squeeze", "slice", "select", "expand", "as_strided", "t", "detach", "split", "split_with_sizes", "alias",
         "unbind", "permute", "lift_fresh", "unflatten", "flatten", "reshape", "_reshape_alias", "sym_size",
         "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def op_bytes(name: str, args, kwargs, out) -> int | None:
    """Bytes one aten op reads and writes (None: a free op, no launch)."""
    if name in _FREE:
        return None
    if name == "copy_":
        return None if _same_data(args[0], args[1]) else 2 * _nbytes(args[1])
    if name == "index_select":
        return 2 * _nbytes(out)
    if name in ("index_add_", "index_add"):
        return 3 * _nbytes(args[3])
    if name in ("index_copy_", "index_copy"):
        return 2 * _nbytes(args[3])
    if name == "index_fill_":  # writes the indexed rows
        return args[2].numel() * _nbytes(args[0]) // max(1, args[0].shape[args[1]])
    if name in ("zero_", "fill_", "zeros", "zeros_like", "new_zeros", "full", "new_full", "ones", "ones_like"):
        return sum(_nbytes(t) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    return sum(_nbytes(t) for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))


class TrafficCounter(TorchDispatchMode):
    """Launches and bytes (``op_bytes``) of every aten op run under it, by op and by the innermost ``harts``
    function that issued it (``where``)."""

    def __init__(self):
        super().__init__()
        self.launches = collections.Counter()
        self.bytes = collections.Counter()

    def add(self, key, nbytes: int) -> None:
        self.launches[key] += 1
        self.bytes[key] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        b = op_bytes(name, args, kwargs, out)
        if b:  # an op on empty tensors launches no kernel
            self.add((name, _caller()), b)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())


def _caller() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/harts/" in fr.filename.replace("\\", "/") and "/benchmarks/" not in fr.filename.replace("\\", "/"):
            return f"{fr.filename.replace(chr(92), '/').split('/harts/')[-1]}:{fr.name}"
    return "?"


# ------------------------------------------------------------------------------ stand-ins for the dense kernels
_COUNTER: list[TrafficCounter] = []


def _null_piece_fwd(q, k, v, causal, scale):
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32), None


def _null_piece_bwd(do, q, k, v, o, lse, aux, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _merge_traffic(out_LHDv, lse_LH, groups) -> None:
    """The fused merge's traffic: each piece's rows of o and lse read once, the view's o and lse written."""
    L = out_LHDv.shape[0]
    b = _nbytes(out_LHDv) + _nbytes(lse_LH)
    for o, lse, r0 in groups:
        b += _nbytes(o[:, :, r0:r0 + L]) + _nbytes(lse[:, :, r0:r0 + L])
    _COUNTER[-1].add(("attn_merge", "kernels/attn_merge"), b)


class _NullSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.shapes = q.shape, k.shape, v.shape
        return q.new_empty(*q.shape[:3], v.shape[-1])

    @staticmethod
    def backward(ctx, do):
        return tuple(do.new_empty(s) for s in ctx.shapes)


class _NullRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, init, out=None, grad_out=None):
        ctx.shapes = [t.shape if t is not None else None for t in (q, k, v, g, beta, init)]
        ctx.grad_out = grad_out
        return v.new_empty(v.shape) if out is None else out[0]

    @staticmethod
    def backward(ctx, do):
        grads = [None if s is None else do.new_empty(s) for s in ctx.shapes]
        if ctx.grad_out is not None:  # q's and k's written where the caller wants them, as the Triton round does
            grads[:2] = [f().view(s) for f, s in zip(ctx.grad_out, ctx.shapes)]
        return (*grads, None, None)


def _null_round(q, k, v, g, beta, cu_seqlens, *, initial_state=None, state_seq=None, out=None, grad_out=None,
                **kw):
    """The round's shapes, its output and its q and k gradients written where the Triton round writes them."""
    o = _NullRound.apply(q, k, v, g, beta, initial_state, None if out is None else (out.unsqueeze(0),), grad_out)
    M = 0 if state_seq is None else int(state_seq.shape[0])
    states = q.new_empty(M, v.shape[2], q.shape[-1], v.shape[-1], dtype=torch.float32) if M else None
    return o, None, states


def _null_chunk_kda(q, k, v, g, beta, **kw):
    return _NullRound.apply(q, k, v, g, beta, None), None


@contextlib.contextmanager
def dense_stand_ins():
    """The dense kernels replaced by shape-only stand-ins (module docstring), for the duration."""
    import harts.ops.attention.split as split
    from harts.ops.attention import fast

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(split.PIECES, {"null": (_null_piece_fwd, _null_piece_bwd)}))
        stack.enter_context(mock.patch.dict(split.MERGES, {"null": _merge_traffic}))
        # the backward of unmasked pieces as the cuDNN path runs it (its copies are traffic too)
        stack.enter_context(mock.patch.dict(split.UNMASKED_BWD_AS_CAUSAL,
                                            {"null": split.UNMASKED_BWD_AS_CAUSAL["cudnn"]}))
        stack.enter_context(mock.patch.object(fast.F, "scaled_dot_product_attention",
                                              lambda q, k, v, **kw: _NullSDPA.apply(q, k, v)))
        stack.enter_context(mock.patch("harts.runtime.compact._round_fn", lambda *a, **k: (_null_round, True)))
        stack.enter_context(mock.patch("harts.ops._fla.chunk_kda", _null_chunk_kda))
        stack.enter_context(mock.patch("harts.ops.norm.fast.l2_norm_fast", lambda x, eps=1e-6: x))
        yield


def count(fn) -> tuple[TrafficCounter, TrafficCounter]:
    """(forward, backward) traffic of ``fn()`` (returning one tensor) and of its backward with a dense gradient."""
    fwd, bwd = TrafficCounter(), TrafficCounter()
    _COUNTER.append(fwd)
    try:
        with fwd:
            out = fn()
        _COUNTER[-1] = bwd
        with bwd:
            out.backward(torch.empty_like(out))
    finally:
        _COUNTER.pop()
    return fwd, bwd


# ------------------------------------------------------------------------------ one layer of each mixer
def _leaf(rows: int, *shape, dtype=torch.bfloat16):
    return torch.empty(rows, *shape, device="meta", dtype=dtype, requires_grad=True)


def mla_harts(batch, cfg):
    from harts.ops.attention.split import split_attention

    plan = batch.mla_split_plan
    H, D, Dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    q, k, v = _leaf(plan.num_queries, H, D), _leaf(plan.num_keys, H, D), _leaf(plan.num_keys, H, Dv)
    return count(lambda: split_attention(q, k, v, plan, 1.0, piece="null"))


def mla_baseline(batch, cfg):
    from harts.ops.attention.fast import _cudnn_per_sequence

    H, D, Dv, T = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim, batch.num_rows
    q, k, v = _leaf(T, H, D), _leaf(T, H, D), _leaf(T, H, Dv)
    cu = batch.cu_seqlens.to("meta")
    return count(lambda: _cudnn_per_sequence(q, k, v, cu, 1.0, cu_cpu=batch.cu_seqlens_cpu))


def kda_harts(batch, cfg):
    from harts.runtime.compact import kda_rounds

    H, K, P = cfg.num_attention_heads, cfg.head_dim, batch.num_phys
    mb = batch.to("meta")
    q, k, v, f = (_leaf(P, H, K) for _ in range(4))
    beta = _leaf(P, H, dtype=torch.float32)
    A_log, dt_bias = torch.zeros(H, device="meta"), torch.zeros(H * K, device="meta")
    return count(lambda: kda_rounds(q, k, v, f, beta, mb, chunk_size=cfg.kda_chunk_size, backend="fast",
                                    A_log=A_log, dt_bias=dt_bias, lower_bound=cfg.kda_lower_bound))


def kda_baseline(batch, cfg):
    from harts.ops.kda.fast import kda_fast

    H, K, T = cfg.num_attention_heads, cfg.head_dim, batch.num_rows
    q, k, v, f = (_leaf(T, H, K) for _ in range(4))
    beta = _leaf(T, H, dtype=torch.float32)
    A_log, dt_bias = torch.zeros(H, device="meta"), torch.zeros(H * K, device="meta")
    return count(lambda: kda_fast(q, k, v, f, beta, A_log, dt_bias, batch.cu_seqlens.to("meta"),
                                  lower_bound=cfg.kda_lower_bound, chunk_size=cfg.kda_chunk_size,
                                  cu_seqlens_cpu=batch.cu_seqlens_cpu)[0])


def _add(acc: dict, key: str, counters, times: tuple) -> None:
    for c, n in zip(counters, times):
        acc[key + "_bytes"] += n * c.total_bytes
        acc[key + "_launches"] += n * c.total_launches


def microbatch_traffic(trajs, cfg, capacity: int, ac: str) -> dict:
    """Per-layer and whole-microbatch traffic of both paths' MLA and KDA cores (module docstring)."""
    from benchmarks.flops import mixer_geometry
    from harts.runtime import pack

    geo = mixer_geometry(cfg)
    passes = (2 if ac == "full" else 1, 1)  # forward (and its recomputation), backward
    hb = pack(trajs, config=cfg)
    res = {"raw": hb.stats["raw_tokens"], "compact": hb.num_rows, "views": len(hb.mla_split_plan.views),
           "rounds": len(hb.rounds)}
    with dense_stand_ins():
        mla_h, kda_h = mla_harts(hb, cfg), kda_harts(hb, cfg)
        mla_b, kda_b = [], []  # (fwd, bwd) counters of each sub-batch
        for idx in subbatches(trajs, capacity):
            bb = pack([trajs[i] for i in idx], config=cfg, prefix_sharing=False)
            mla_b.append(mla_baseline(bb, cfg))
            kda_b.append(kda_baseline(bb, cfg))
    layer, total = collections.defaultdict(int), collections.defaultdict(int)
    n_mla = tuple(geo["attention_layers"] * p for p in passes)
    n_kda = tuple(geo["linear_layers"] * p for p in passes)
    _add(layer, "mla_harts", mla_h, (1, 1))
    _add(layer, "kda_harts", kda_h, (1, 1))
    _add(total, "harts", mla_h, n_mla)
    _add(total, "harts", kda_h, n_kda)
    for m, k in zip(mla_b, kda_b):
        _add(layer, "mla_baseline", m, (1, 1))
        _add(layer, "kda_baseline", k, (1, 1))
        _add(total, "baseline", m, n_mla)
        _add(total, "baseline", k, n_kda)
    res["per_layer_fwd_bwd"] = dict(layer)
    c0 = res["raw"] / res["compact"]
    total["excess_bytes"] = total["harts_bytes"] - total["baseline_bytes"] / c0
    res["microbatch"] = dict(total)
    res["top"] = [{"op": op, "where": where, "launches": n, "bytes": b}
                  for (op, where), n, b in _top(mla_h + kda_h, 12)]
    return res


def _top(counters, n: int):
    b, k = collections.Counter(), collections.Counter()
    for c in counters:
        b.update(c.bytes)
        k.update(c.launches)
    return [(key, k[key], val) for key, val in b.most_common(n)]


def main(argv=None) -> int:
    from benchmarks.speedup import planned_microbatches

    ap = argparse.ArgumentParser(prog="python -m benchmarks.traffic", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, scale=0.2)
    ap.add_argument("--microbatches", type=int, default=4, help="how many of the plan's fullest microbatches")
    ap.add_argument("--ac", choices=("full", "selective", "none"), default="full",
                    help="full: the forward runs again in backward (counted twice)")
    ap.add_argument("--bandwidth", type=float, default=4.8, help="TB/s for the lower bound in ms (H200 HBM3e: 4.8)")
    ap.add_argument("--out", default="out/bench_traffic")
    args = ap.parse_args(argv)
    cfg = model_config(args.preset)
    if not hasattr(cfg, "qk_head_dim"):
        ap.error(f"--preset {args.preset}: the traffic count covers Ling-3.0's MLA split and KDA rounds only")
    mbs, _, _ = planned_microbatches(args)
    rows = []
    for n, trajs in enumerate(mbs):
        r = microbatch_traffic(trajs, cfg, args.capacity, args.ac)
        rows.append(r)
        lay, mb = r["per_layer_fwd_bwd"], r["microbatch"]
        print(f"microbatch {n + 1}/{len(mbs)}: raw {r['raw']:,} compact {r['compact']:,} ({r['views']} views, "
              f"{r['rounds']} rounds)\n  per layer, fwd+bwd: MLA HARTS {lay['mla_harts_bytes'] / 1e9:.2f} GB in "
              f"{lay['mla_harts_launches']} launches, baseline {lay['mla_baseline_bytes'] / 1e9:.2f} GB in "
              f"{lay['mla_baseline_launches']}; KDA HARTS {lay['kda_harts_bytes'] / 1e9:.2f} GB in "
              f"{lay['kda_harts_launches']}, baseline {lay['kda_baseline_bytes'] / 1e9:.2f} GB in "
              f"{lay['kda_baseline_launches']}\n  microbatch: HARTS {mb['harts_bytes'] / 1e9:.1f} GB, baseline "
              f"{mb['baseline_bytes'] / 1e9:.1f} GB; HARTS's excess over baseline / compression "
              f"{mb['excess_bytes'] / 1e9:.1f} GB (>= {mb['excess_bytes'] / args.bandwidth / 1e9:.1f} ms at "
              f"{args.bandwidth} TB/s)", flush=True)
    tot = {k: sum(r["microbatch"][k] for r in rows) for k in rows[0]["microbatch"]}
    res = {"args": vars(args), "microbatches": rows, "total": tot,
           "excess_ms_lower_bound": tot["excess_bytes"] / args.bandwidth / 1e9}
    print(f"\n{len(rows)} microbatches: HARTS {tot['harts_bytes'] / 1e9:.1f} GB in {tot['harts_launches']:,} launches, "
          f"baseline {tot['baseline_bytes'] / 1e9:.1f} GB in {tot['baseline_launches']:,}; HARTS's excess "
          f"{tot['excess_bytes'] / 1e9:.1f} GB, at least {res['excess_ms_lower_bound']:.0f} ms at "
          f"{args.bandwidth} TB/s")
    print("largest HARTS sources (first microbatch, one layer of each kind, fwd+bwd):")
    for t in rows[0]["top"]:
        print(f"  {t['op']:16s} {t['where']:52s} {t['launches']:5d} launches {t['bytes'] / 1e9:7.2f} GB")
    write_results(args.out, "traffic", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
