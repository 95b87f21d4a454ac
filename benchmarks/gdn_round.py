"""Gated DeltaNet rounds against fla's GDN kernel: ``python -m benchmarks.gdn_round --out DIR``.

Qwen3.5's GDN core runs on a compact batch as ``harts.runtime.compact.kda_rounds``, in one of two round
implementations (the model's ``gdn_round_impl``): ``kda_kernels``, the KDA round kernels
(``harts.ops.kda_round.chunk_kda_round``) with q, k repeated to the value heads and the per-head scalar decay
broadcast over K; or ``fla_pieces``, fla's Gated DeltaNet pieces with our boundary-state scans
(``harts.ops.gdn_round.chunk_gdn_round``: scalar gate, q, k at the key heads). This bench prices both on one
realistic microbatch: the trajectories of the fullest
planned microbatch of a synthetic step (``--workload``, ``--capacity``; GDN shapes of ``--preset``, by default
qwen3.5-8l: 16 key / 32 value heads of 128, chunk 64), packed trajectory-wise as one sequence each. Forward +
backward (CUDA events, warm-up first, median over ``--rounds`` interleaved rounds of ``--reps`` calls) of

- ``fla``: fla's ``chunk_gated_delta_rule`` on the packed trajectories with grouped value attention (q, k at
  the 16 key heads; each serves 2 value heads), the public GDN kernel; ``fla_rep``: the same with q, k
  repeated to the value heads, as the round kernels get them;
- ``round``: ``chunk_kda_round`` on the same rows as one round without states (q, k repeated and the decay
  broadcast inside the timed call, as the model does, so the copies and their backward are counted);
- ``round_states``: the same, also emitting the boundary states a HARTS plan would request on these paths
  (the chunk of every fork position on each trajectory: where another trajectory of the microbatch leaves
  it), with an incoming gradient on each state;
- ``round_fla_pieces`` and ``round_fla_pieces_states``: the same two calls on ``chunk_gdn_round`` (no repeat,
  no broadcast);
- ``rounds``: the whole ``kda_rounds`` over the real HARTS plan of the same trajectories (compact rows plus
  replay, gathers, state handoffs between rounds), against ``round`` over the same trajectories' raw rows
  (the model's trajectory-wise GDN path, ``harts.ops.gdn``, is that kernel): its speedup, next to the row
  compression that bounds it; ``rounds_fla_pieces``: the same with the scalar gate, against
  ``round_fla_pieces``.

The table gives each round variant over fla (the issue's bound: <= 1.05x on the H200), and the same for
forwards alone (``*_fwd``). fla 0.6.0 refuses its GDN backward on Hopper with Triton >= 3.4 and < 3.7.1
unless tilelang is installed (``fla_backward_refusal``); the bench then records fla's message and times fla's
forward + backward with that refusal lifted (``_guard_lifted``: the time is what the issue's ratio needs, the
gradients are reported but never used as a reference). Numerics: on a slice of the rows (``--check-tokens``),
fla's and both round implementations' outputs and input gradients are compared with a float64 CPU truth
(``harts.ops.gdn.gated_delta_rule_reference``); a round implementation passes when its error is within
``--noise-factor`` x fla's (floored at the dtype's epsilon): both are then equally close to exact arithmetic.
Where fla's backward is refused, the gradients are judged against the other round implementation's errors
instead (``grad_floor_from``), so a miscompiled backward piece (fla #640, #984) still fails the check.
Writes ``gdn_round.json``.

On CPU, ``--backend reference`` runs every variant on the pure-torch paths with the same contracts (seconds
at the debug preset's shapes: a check of the bench's plumbing, not a measurement). The Triton kernels also
run on CPU under the interpreter (``--device cpu --dtype float32``, a chunk size of 32, fla's interpreter
shims from ``tests/conftest.py`` loaded), but take about a minute per call even at tiny shapes.

Legend: T packed rows (raw tokens), P compact rows, N sequences, Hk key heads, HV value heads, K/V head dims,
M requested boundary states, C chunk size.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from benchmarks.common import add_workload_args, fullest_microbatch, time_ms, workload_step
from benchmarks.output import write_results
from harts.models.family import model_config
from harts.ops import set_kernel_choices

GRAD_NAMES = ("q", "k", "v", "g", "beta")


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def fork_requests(arrays: list[np.ndarray], chunk: int) -> tuple[list[int], list[int]]:
    """Boundary-state requests (sequence, chunk) on trajectory-wise packed rows, one sequence per trajectory:
    for every position p where another trajectory leaves trajectory n's path (their common prefix length,
    both continuing past it), the chunk p // C that a HARTS plan restores the branch's grid from; chunk 0
    (the zero initial state) is never requested. In lexicographic order the common prefix of two
    trajectories is the minimum of the adjacent ones between them, so no pair is compared twice."""
    n = len(arrays)
    order = sorted(range(n), key=lambda i: tuple(arrays[i].tolist()))
    adj = [_lcp(arrays[order[j]], arrays[order[j + 1]]) for j in range(n - 1)]
    seq, chk = [], []
    for j, i in enumerate(order):
        li, forks = arrays[i].shape[0], set()
        for step in (-1, 1):
            m, o = li, j
            while 0 <= o + step < n:
                m = min(m, adj[min(o, o + step)])
                o += step
                if m == 0:
                    break
                if m < li and m < arrays[order[o]].shape[0]:
                    forks.add(m // chunk)
        for c in sorted(forks - {0}):
            seq.append(i)
            chk.append(c)
    return seq, chk


def _leaves(T: int, Hk: int, HV: int, K: int, V: int, device, dtype, seed: int) -> dict[str, torch.Tensor]:
    """Core inputs as the model makes them: q, k [T, Hk, K] and v [T, HV, V] in ``dtype``; the log decay
    g = -exp(A_log) * softplus(x + 1) [T, HV] with A_log = log U(1, 16) per head, and beta = sigmoid(x), both
    fp32+ (the model's gate dtypes)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    gdt = torch.promote_types(dtype, torch.float32)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=gdt).to(dt)

    A_log = torch.empty(HV, device=device, dtype=gdt).uniform_(1.0, 16.0, generator=gen).log()
    g = -A_log.exp() * torch.nn.functional.softplus(randn(T, HV, dt=gdt) + 1.0)
    x = {"q": randn(T, Hk, K), "k": randn(T, Hk, K), "v": randn(T, HV, V), "g": g,
         "beta": torch.sigmoid(randn(T, HV, dt=gdt))}
    return {n: t.contiguous().requires_grad_(True) for n, t in x.items()}


def core_fla(x: dict, cu: torch.Tensor, cu_cpu: torch.Tensor, repeat: bool = False,
             backend: str = "fast") -> torch.Tensor:
    """fla's chunk_gated_delta_rule on packed rows (q, k L2-normed in the kernel, scale K^-0.5) -> o [T, HV, V];
    grouped value attention, or q, k repeated to the value heads with ``repeat``. ``backend="reference"``: the
    per-token recurrence with the same contract (harts.ops.gdn.gated_delta_rule_reference)."""
    q, k, v = x["q"], x["k"], x["v"]
    if repeat:
        rep = v.shape[1] // q.shape[1]
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    if backend == "reference":
        from harts.ops.gdn import gated_delta_rule_reference

        return gated_delta_rule_reference(q, k, v, x["g"], x["beta"], cu_cpu)[0]
    from harts.ops._fla import chunk_gated_delta_rule

    o, _ = chunk_gated_delta_rule(q[None], k[None], v[None], x["g"][None], x["beta"][None].to(q.dtype),
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    return o[0]


def _as_round(x: dict):
    """The model's GDN-on-rounds inputs: q, k repeated to the value heads, g broadcast over K [T, HV, K]."""
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    rep = v.shape[1] // q.shape[1]
    return (q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1), v,
            g[..., None].expand(*g.shape, q.shape[-1]), x["beta"].to(q.dtype))


def core_round(x: dict, cu: torch.Tensor, cu_cpu: torch.Tensor, chunk: int, seq=None, chk=None,
               backend: str = "fast"):
    """chunk_kda_round on packed rows as one round -> (o [T, HV, V], boundary states [M, HV, K, V] or None);
    ``backend="reference"``: chunk_kda_round_reference, the same contract in pure torch."""
    from harts.ops.kda_round import chunk_kda_round, chunk_kda_round_reference

    fn = chunk_kda_round_reference if backend == "reference" else chunk_kda_round
    q, k, v, g, beta = _as_round(x)
    o, _, states = fn(q[None], k[None], v[None], g[None], beta[None], cu, state_seq=seq or None,
                                   state_chunk=chk or None, use_qk_l2norm_in_kernel=True, chunk_size=chunk,
                                   cu_seqlens_cpu=cu_cpu)
    return o[0], states


def core_round_fla_pieces(x: dict, cu: torch.Tensor, cu_cpu: torch.Tensor, chunk: int, seq=None, chk=None,
                          backend: str = "fast"):
    """chunk_gdn_round (fla's GDN pieces + our boundary-state scans; q, k at the key heads, scalar gate) on
    packed rows as one round -> (o [T, HV, V], boundary states [M, HV, K, V] or None); ``backend="reference"``:
    chunk_gdn_round_reference."""
    from harts.ops import gdn_round

    fn = gdn_round.chunk_gdn_round_reference if backend == "reference" else gdn_round.chunk_gdn_round
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"].to(x["q"].dtype)
    o, _, states = fn(q[None], k[None], v[None], g[None], beta[None], cu, state_seq=seq or None,
                      state_chunk=chk or None, use_qk_l2norm_in_kernel=True, chunk_size=chunk, cu_seqlens_cpu=cu_cpu)
    return o[0], states


def _errors(got: list[torch.Tensor], truth: list[torch.Tensor]) -> list[float]:
    """max |got - truth| / max |truth| per tensor (float64 on the CPU)."""
    out = []
    for a, b in zip(got, truth):
        a = a.detach().to("cpu", torch.float64)
        out.append(float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)))
    return out


def check_numerics(x: dict, lens: list[int], chunk: int, check_tokens: int, noise_factor: float, dtype,
                   backend: str = "fast") -> dict:
    """fla and both round implementations against a float64 CPU truth on a slice of about ``check_tokens`` rows
    (the first rows of the first four sequences): output and every input gradient, relative max errors."""
    from harts.ops.gdn import gated_delta_rule_reference

    # up to 4 sequences (varlen boundaries inside the slice), each its trajectory's first rows
    per = max(check_tokens // 4, 1)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    pieces = [(int(st), min(ln, per)) for st, ln in zip(starts[:4], lens[:4])]
    cut = np.concatenate([[0], np.cumsum([n for _, n in pieces])]).tolist()
    T = cut[-1]
    dev = x["q"].device
    cu_cpu = torch.tensor(cut, dtype=torch.long)
    cu = cu_cpu.to(dev)
    idx = torch.from_numpy(np.concatenate([np.arange(st, st + n) for st, n in pieces])).to(dev)
    base = {k: t.detach().index_select(0, idx) for k, t in x.items()}
    gen = torch.Generator(device=dev).manual_seed(1)
    # in the inputs' dtype, so that the truth sees exactly the upstream gradient both cores get
    do = torch.randn(T, *x["v"].shape[1:], generator=gen, device=dev, dtype=torch.float32).to(x["v"].dtype)
    exact = {k: t.to("cpu", torch.float64).requires_grad_(True) for k, t in base.items()}
    o64, _ = gated_delta_rule_reference(*(exact[k] for k in GRAD_NAMES), cu_cpu)
    truth = [o64.detach()] + list(torch.autograd.grad(o64, [exact[k] for k in GRAD_NAMES],
                                                      do.to("cpu", torch.float64)))
    res = {"rows": T, "sequences": len(cut) - 1, "tensors": ["o"] + [f"d{k}" for k in GRAD_NAMES]}
    res["fla_grads"] = True
    for name, fn in (("fla", lambda y: core_fla(y, cu, cu_cpu, backend=backend)),
                     ("round", lambda y: core_round(y, cu, cu_cpu, chunk, backend=backend)[0]),
                     ("round_fla_pieces", lambda y: core_round_fla_pieces(y, cu, cu_cpu, chunk, backend=backend)[0])):
        y = {k: t.clone().requires_grad_(True) for k, t in base.items()}
        o = fn(y)
        try:
            grads = list(torch.autograd.grad(o, [y[k] for k in GRAD_NAMES], do, retain_graph=name == "fla"))
        except RuntimeError as e:  # fla's refused backward (see fla_backward_refusal)
            if name != "fla" or "chunk_bwd_dqkwg" not in str(e):
                raise
            grads, res["fla_grads"] = [], False
            lifted = _guard_lifted(lambda: torch.autograd.grad(o, [y[k] for k in GRAD_NAMES], do))()
            res["fla_guard_lifted"] = _errors([o] + list(lifted), truth)  # reported, never a floor
        res[name] = _errors([o] + grads, truth) + [None] * (len(truth) - 1 - len(grads))
    eps = float(torch.finfo(dtype).eps)
    res["floor"] = [None if e is None else max(e, eps) for e in res["fla"]]
    res["within_noise"] = [None if f is None else r <= noise_factor * f for r, f in zip(res["round"], res["floor"])]
    # fla_pieces: gradients judged against fla's where it has them, else against the KDA-kernel round's
    res["grad_floor_from"] = "fla" if res["fla_grads"] else "round"
    floor_p = res["floor"] if res["fla_grads"] else res["floor"][:1] + [max(e, eps) for e in res["round"][1:]]
    res["floor_fla_pieces"] = floor_p
    res["within_noise_fla_pieces"] = [r <= noise_factor * f for r, f in zip(res["round_fla_pieces"], floor_p)]
    res["ok_round"] = all(w for w in res["within_noise"] if w is not None)
    res["ok_fla_pieces"] = all(res["within_noise_fla_pieces"])
    res["ok"] = res["ok_round"] and res["ok_fla_pieces"]
    return res


def run(args) -> dict:
    from harts.planning import plan_microbatches
    from harts.runtime import pack
    from harts.runtime.compact import kda_rounds

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = model_config(args.preset, **({"gdn_chunk_size": args.chunk_size} if args.chunk_size else {}))
    if not hasattr(cfg, "linear_num_value_heads"):
        raise ValueError(f"--preset {args.preset!r} is not a Qwen3.5 preset (GDN shapes); use qwen3.5-8l, "
                         "qwen3.5-35b-a3b or qwen3.5-debug")
    Hk, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V, C = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gdn_chunk_size
    step = workload_step(args, vocab_size=cfg.vocab_size)
    trajs = fullest_microbatch(step, plan_microbatches(step, dp_degree=1, capacity=args.capacity))
    if args.max_tokens:  # the first trajectories (at least one) within the cap
        keep, n = [], 0
        for t in trajs:
            if keep and n + len(t) > args.max_tokens:
                break
            keep.append(t)
            n += len(t)
        trajs = keep
    arrays = [np.asarray(t.tokens) for t in trajs]
    lens = [a.shape[0] for a in arrays]
    cu_cpu = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)
    cu = cu_cpu.to(dev)
    T = int(cu_cpu[-1])
    seq, chk = fork_requests(arrays, C)
    hb = pack(trajs, config=cfg).to(dev)
    P = hb.num_phys

    x = _leaves(T, Hk, HV, K, V, dev, dtype, args.seed)
    xp = _leaves(P, Hk, HV, K, V, dev, dtype, args.seed + 1)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 2)
    do = torch.randn(T, HV, V, generator=gen, device=dev, dtype=dtype)
    dB = torch.randn(len(seq), HV, K, V, generator=gen, device=dev, dtype=torch.float32)
    do_P = torch.randn(P, HV, V, generator=gen, device=dev, dtype=dtype)

    def fwd_bwd(leaves, fn, grads):
        def f():
            outs = fn()
            torch.autograd.backward(outs, grads)
            for t in leaves.values():
                t.grad = None
        return f

    def fwd_only(fn):
        def f():
            with torch.no_grad():
                fn()
        return f

    def rounds_out():
        q, k, v, g, beta = _as_round(xp)
        return [kda_rounds(q, k, v, g, beta, hb, chunk_size=C, backend=be)]

    def rounds_fla_pieces_out():  # the scalar gate [P, HV], q and k at the key heads: chunk_gdn_round per round
        return [kda_rounds(xp["q"], xp["k"], xp["v"], xp["g"], xp["beta"].to(xp["q"].dtype), hb, chunk_size=C,
                           backend=be)]

    be = args.backend
    fla_gva = lambda: [core_fla(x, cu, cu_cpu, backend=be)]  # noqa: E731
    fla_rep = lambda: [core_fla(x, cu, cu_cpu, repeat=True, backend=be)]  # noqa: E731
    round_none = lambda: [core_round(x, cu, cu_cpu, C, backend=be)[0]]  # noqa: E731
    round_req = lambda: list(core_round(x, cu, cu_cpu, C, seq, chk, backend=be))  # noqa: E731
    pieces_none = lambda: [core_round_fla_pieces(x, cu, cu_cpu, C, backend=be)[0]]  # noqa: E731
    pieces_req = lambda: list(core_round_fla_pieces(x, cu, cu_cpu, C, seq, chk, backend=be))  # noqa: E731
    variants = {
        "fla": fwd_bwd(x, fla_gva, [do]),
        "fla_rep": fwd_bwd(x, fla_rep, [do]),
        "round": fwd_bwd(x, round_none, [do]),
        "round_states": fwd_bwd(x, round_req, [do, dB]) if seq else None,
        "round_fla_pieces": fwd_bwd(x, pieces_none, [do]),
        "round_fla_pieces_states": fwd_bwd(x, pieces_req, [do, dB]) if seq else None,
        "rounds": fwd_bwd(xp, rounds_out, [do_P]),
        "rounds_fla_pieces": fwd_bwd(xp, rounds_fla_pieces_out, [do_P]),
        "fla_fwd": fwd_only(fla_gva),
        "round_fwd": fwd_only(round_none),
        "round_states_fwd": fwd_only(round_req) if seq else None,
        "round_fla_pieces_fwd": fwd_only(pieces_none),
        "round_fla_pieces_states_fwd": fwd_only(pieces_req) if seq else None,
    }
    if not seq:  # no fork on these paths: nothing to emit, the state variants are the plain round
        for base in ("round", "round_fla_pieces"):
            variants[f"{base}_states"], variants[f"{base}_states_fwd"] = variants[base], variants[f"{base}_fwd"]
    fla_backward = fla_backward_refusal(variants["fla"])
    if fla_backward is not None:  # time fla's backward with its guard lifted: a timing, its gradients not trusted
        print(f"fla refuses its backward here ({fla_backward}); timing it with that guard lifted: its gradients "
              "are reported by the numerics check below, never used as a reference")
        for name in ("fla", "fla_rep"):
            variants[name] = _guard_lifted(variants[name])
    t0 = time.perf_counter()
    samples = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved: a drifting clock hits every variant alike
        for name, fn in variants.items():
            samples[name].append(time_ms(fn, warmup=args.warmup, reps=args.reps, device=dev))
    ms = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    t_time = time.perf_counter() - t0
    numerics = (check_numerics(x, lens, C, args.check_tokens, args.noise_factor, dtype, be) if args.check_tokens
                else None)

    import triton

    from harts.ops import tuning

    def ratio(a, b):
        return ms[a] / ms[b] if a in ms and b in ms else None

    raw, compact = hb.stats["raw_tokens"], hb.num_rows
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "fla": _version("fla-core"), "autotune": tuning.mode(), "backend": be,
           "preset": args.preset, "workload": args.workload, "seed": args.seed, "scale": args.scale,
           "capacity": args.capacity, "dtype": args.dtype, "key_heads": Hk, "value_heads": HV, "key_dim": K,
           "value_dim": V, "chunk": C, "fla_heads": "GVA (q, k at the key heads); fla_rep: q, k repeated",
           "fla_backward_refused": fla_backward,
           "trajectories": len(trajs), "rows": T, "max_len": max(lens), "requested_states": len(seq),
           "plan": {"compact_rows": compact, "phys_rows": P, "replay_rows": hb.stats["replay_tokens"],
                    "rounds": len(hb.rounds), "boundary_states": hb.stats["boundary_states"],
                    "round_positions": int(sum(int(r.cu_seqlens_cpu[-1]) for r in hb.rounds)),
                    "trajectory_wise_rows": raw, "compression": raw / compact},
           "ms": ms, "samples_ms": samples, "timing_s": t_time,
           "round_over_fla": ratio("round", "fla"), "round_states_over_fla": ratio("round_states", "fla"),
           "round_over_fla_rep": ratio("round", "fla_rep"),
           "round_fwd_over_fla_fwd": ratio("round_fwd", "fla_fwd"),
           "round_states_fwd_over_fla_fwd": ratio("round_states_fwd", "fla_fwd"),
           "round_fla_pieces_over_fla": ratio("round_fla_pieces", "fla"),
           "round_fla_pieces_states_over_fla": ratio("round_fla_pieces_states", "fla"),
           "round_fla_pieces_fwd_over_fla_fwd": ratio("round_fla_pieces_fwd", "fla_fwd"),
           "round_fla_pieces_states_fwd_over_fla_fwd": ratio("round_fla_pieces_states_fwd", "fla_fwd"),
           "round_fla_pieces_over_round": ratio("round_fla_pieces", "round"),
           "fla_backward_guard_lifted": fla_backward is not None,
           "rounds_fla_pieces_speedup_over_trajectory_wise": ratio("round_fla_pieces", "rounds_fla_pieces"),
           # the model's trajectory-wise GDN path is the round kernel without states (harts.ops.gdn)
           "rounds_speedup_over_trajectory_wise": ratio("round", "rounds"),
           "rounds_speedup_over_fla": ratio("fla", "rounds"),
           "numerics": numerics}
    res["rounds_speedup_over_compression"] = res["rounds_speedup_over_trajectory_wise"] / (raw / compact)
    res["rounds_fla_pieces_speedup_over_compression"] = (res["rounds_fla_pieces_speedup_over_trajectory_wise"]
                                                         / (raw / compact))
    return res


def _guard_lifted(fn):
    """``fn`` run with fla's Hopper refusal of its gated ``chunk_bwd_dqkwg`` lifted (fla 0.6.0 checks the
    module flag ``TRITON_ABOVE_3_7_1`` of ``fla.ops.common.chunk_o`` at each call; the flag is restored after).
    Why: the issue's bound is a fwd+bwd ratio to fla, and fla refuses to train on this stack; its backward's
    time does not depend on whether the miscompile hits (fla #640 bisects it to BK = 64; Qwen3.5's K = 128
    gives BK = 128 on Hopper), and the numerics check reports what its gradients are."""
    def f():
        from harts.ops._fla import module

        chunk_o = module("fla.ops.common.chunk_o")
        saved = chunk_o.TRITON_ABOVE_3_7_1
        chunk_o.TRITON_ABOVE_3_7_1 = True
        try:
            return fn()
        finally:
            chunk_o.TRITON_ABOVE_3_7_1 = saved
    return f


def fla_backward_refusal(fla_fwd_bwd) -> str | None:
    """None when fla's forward + backward runs; else fla's refusal. fla 0.6.0 raises a RuntimeError in the
    backward of gated chunk_bwd_dqkwg on Hopper with Triton >= 3.4 and < 3.7.1 (wrong results there) unless
    tilelang is installed; other errors propagate."""
    try:
        fla_fwd_bwd()
    except RuntimeError as e:
        if "chunk_bwd_dqkwg" not in str(e):
            raise
        return str(e)
    return None


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _print(res: dict) -> None:
    p, ms = res["plan"], res["ms"]
    print(f"{res['device']}, torch {res['torch']}, triton {res['triton']}, fla {res['fla']}, autotune "
          f"{res['autotune']}, backend {res['backend']}; {res['preset']} GDN: Hk={res['key_heads']}, "
          f"HV={res['value_heads']}, K={res['key_dim']}, V={res['value_dim']}, chunk {res['chunk']}, {res['dtype']}")
    print(f"rows: {res['trajectories']} trajectories, {res['rows']:,} raw rows (longest {res['max_len']:,}); "
          f"{res['requested_states']} fork states requested on them; HARTS plan: {p['compact_rows']:,} compact "
          f"rows + {p['replay_rows']:,} replay in {p['rounds']} rounds, {p['boundary_states']} boundary states, "
          f"compression {p['compression']:.2f}x")
    n, m = res["rows"], res["requested_states"]
    rows = (("fla", "fla chunk_gated_delta_rule, GVA", n, "fla", "fla_fwd"),
            ("fla_rep", "fla, q/k repeated to value heads", n, "fla", None),
            ("round", "chunk_kda_round, broadcast decay, no states", n, "fla", "fla_fwd"),
            ("round_states", f"the same + {m} fork states", n, "fla", "fla_fwd"),
            ("round_fla_pieces", "chunk_gdn_round, fla's GDN pieces, no states", n, "fla", "fla_fwd"),
            ("round_fla_pieces_states", f"the same + {m} fork states", n, "fla", "fla_fwd"),
            ("rounds", "kda_rounds over the HARTS plan", p["round_positions"], "round", None),
            ("rounds_fla_pieces", "the same, scalar gate (chunk_gdn_round)", p["round_positions"],
             "round_fla_pieces", None))
    print("\n| variant | what | rows | fwd+bwd ms | ratio | fwd ms | fwd ratio |\n|---|---|---|---|---|---|---|")
    for name, what, rows_n, over, over_f in rows:
        t, tf = ms.get(name), ms.get(f"{name}_fwd")
        r = t / ms[over] if t is not None and over in ms else None
        rf = tf / ms[over_f] if tf is not None and over_f in ms else None
        print(f"| {name} | {what} | {rows_n:,} | {_fmt(t)} | {_fmt(r)} | {_fmt(tf)} | {_fmt(rf)} |")
    print("(ratio: over fla; rounds over round and rounds_fla_pieces over round_fla_pieces, the trajectory-wise GDN "
          "path of the model with each implementation; fwd ratio: over fla's forward)")
    if res["fla_backward_refused"]:
        print(f"fla's backward refused on this stack: {res['fla_backward_refused']}\n"
              "fla's fwd+bwd was timed with that guard lifted (its gradients are in the numerics table, not trusted)")
    print(f"\nround / fla {_fmt(res['round_over_fla'])}, round_states / fla {_fmt(res['round_states_over_fla'])} "
          f"(bound 1.05); forward only: {_fmt(res['round_fwd_over_fla_fwd'])}, "
          f"{_fmt(res['round_states_fwd_over_fla_fwd'])}")
    print(f"round_fla_pieces / fla {_fmt(res['round_fla_pieces_over_fla'])}, round_fla_pieces_states / fla "
          f"{_fmt(res['round_fla_pieces_states_over_fla'])} (bound 1.05); forward only: "
          f"{_fmt(res['round_fla_pieces_fwd_over_fla_fwd'])}, {_fmt(res['round_fla_pieces_states_fwd_over_fla_fwd'])}")
    print(f"HARTS rounds vs the trajectory-wise rows: {res['rounds_speedup_over_trajectory_wise']:.2f}x at "
          f"compression {p['compression']:.2f}x ({res['rounds_speedup_over_compression']:.3f} of it); scalar gate: "
          f"{res['rounds_fla_pieces_speedup_over_trajectory_wise']:.2f}x "
          f"({res['rounds_fla_pieces_speedup_over_compression']:.3f} of it)")
    nm = res["numerics"]
    if nm:
        print(f"\nnumerics on {nm['rows']:,} rows ({nm['sequences']} sequences) against float64 on the CPU, "
              f"max |err| / max |truth|:")
        print(f"{'tensor':>8} {'fla':>10} {'round':>10} {'within':>7} {'fla_pieces':>10} {'within':>7}")
        for i, t in enumerate(nm["tensors"]):
            print(f"{t:>8} {_fmt(nm['fla'][i], '10.2e'):>10} {nm['round'][i]:10.2e} {str(nm['within_noise'][i]):>7} "
                  f"{nm['round_fla_pieces'][i]:10.2e} {str(nm['within_noise_fla_pieces'][i]):>7}")
        if "fla_guard_lifted" in nm:
            print("fla with its refusal lifted (not a reference): "
                  + ", ".join(f"{t} {e:.2e}" for t, e in zip(nm["tensors"], nm["fla_guard_lifted"])))
        print(f"round (KDA kernels) within {'' if nm['ok_round'] else 'NOT '}the noise of fla"
              + ("" if nm["fla_grads"] else " (outputs only: fla's backward refused; gradients not judged)"))
        print(f"round_fla_pieces within {'' if nm['ok_fla_pieces'] else 'NOT '}the noise of "
              + ("fla" if nm["fla_grads"] else "fla (outputs) and of the KDA-kernel round (gradients)"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gdn_round", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, scale=0.2)
    ap.set_defaults(preset="qwen3.5-8l")
    ap.add_argument("--chunk-size", type=int, default=0, help="GDN chunk size (default: the preset's)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="keep the microbatch's first trajectories within this many raw rows (0: all)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per round (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before each round's timed ones")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants (median)")
    ap.add_argument("--check-tokens", type=int, default=512,
                    help="rows of the float64 numerics check (0: no check)")
    ap.add_argument("--noise-factor", type=float, default=2.0,
                    help="the round kernel's error may be this many times fla's (floored at the dtype's eps)")
    ap.add_argument("--autotune", choices=("table", "full"), default=None,
                    help="kernel choice autotune for this run: the shipped autotune table (default) or a full autotune")
    ap.add_argument("--backend", choices=("fast", "reference"), default="fast",
                    help="fast: fla's and our Triton kernels (the measurement); reference: the pure-torch paths with "
                         "the same contracts (chunk_kda_round_reference, gated_delta_rule_reference), which checks "
                         "the bench's plumbing on a CPU in seconds and measures nothing")
    ap.add_argument("--out", default="out/bench_gdn_round")
    args = ap.parse_args(argv)
    for name in ("reps", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.autotune:
        set_kernel_choices(autotune=args.autotune)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gdn_round: no CUDA GPU here (--device cpu runs the interpreter smoke run)")
    if dev.type != "cuda" and args.backend == "fast" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("benchmarks.gdn_round on CPU needs TRITON_INTERPRET=1 (and fla's interpreter shims: "
                         "run it through tests/test_bench_qwen35.py)")
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = time.perf_counter() - t0
    _print(res)
    write_results(args.out, "gdn_round", res)
    print(f"\nwrote {os.path.join(args.out, 'gdn_round.json')} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
