"""Benchmarks of the HARTS kernels: ``python -m benchmarks.kernels [--out DIR] [--quick]``.

1. ``chunk_kda_round`` fwd+bwd vs fla's ``chunk_kda`` on the same input (bf16, T = 64K, H = 16,
   K = V = 128), with one requested boundary per 4 chunks (and with none), for one 64K sequence and
   for 16 packed 4K sequences.
2. ``compact_logprobs`` fwd+bwd at C = 64K, V = 157,184, D = 1536, S/C = 5.6 vs expanding the
   compact rows to the S semantic positions and taking log_softmax. The expanded S x V logits
   (~115 GB in bf16) do not fit on one GPU, so the baseline runs in chunks of S positions (the
   chunked-CE loop a trainer without prefix sharing would run); peak extra memory of ours is
   measured over the inputs.

3. ``experts``: the routed experts' SwiGLU on expert-sorted rows (M = 64K x 8, D = 1536, F = 512, E = 128, bf16),
   gate and up as two grouped GEMMs (the model's) against one grouped GEMM over stacked [E, 2F, D] weights, fwd
   and fwd+bwd, with TFLOP/s, each eager and under torch.compile (the model runs its experts inside compiled
   regions, where Inductor fuses the SwiGLU and the routing weight around the GEMMs, and the ranking of the two
   layouts can differ from eager). ``--device cpu --quick --only experts`` is a float32 smoke run (eager).
4. ``moe_gather``: the MoE gather-sum (``harts.ops.moe.gather_sum``, T = 64K, K = 8, D = 1536, bf16): the
   Triton kernel's combine (K = 8) and slot gather (K = 1) against the same reference compiled by Inductor
   and run eagerly, with a device copy of the [T*K, D] rows as the bandwidth ceiling.
5. ``attention``: packed self-attention (one cu_seqlens for queries and keys) over 65,536 rows in 7
   trajectories of 5K-15K, fwd and fwd+bwd: cuDNN per sequence (``harts.ops.attention.fast``) against the
   flash varlen kernel (V zero-padded to the q/k head dim), at Ling-3.0's MLA heads (16 x 192 / 128) and at
   Qwen3.5's gated attention heads (16 x 256 / 256, key/value heads repeated).
6. ``router``: the router logits fwd+bwd (T = 64K, D = 1536, E = 128): tensor cores both ways (the backward on
   the exact bf16x3 split of the fp32 gradient) against the fp32 GEMMs of the upcast operands.
7. ``conv``: the tree short convolution (``harts.ops.tree_conv.fast``, W = 4, SiLU) over C = 61,924 compact rows
   in 12 sequences with ancestor windows, at Qwen3.5's channels (8,192: q, k, v in one call) and Ling-3.0's
   (2,048 per call), fwd and fwd+bwd, for each ``IMPL`` and for fla's trajectory-wise causal_conv1d over the
   same rows (no ancestors: the kernel the baseline runs); and both paths on HARTS's kernels (kernel choice
   ``conv="harts"``, ``harts.ops.conv.fused``: the backward recomputes the pre-activation in registers).
8. ``scan``: the KDA/GDN rounds' state scans (forward h, backward dh; HV = 16, K = V = 128, BT = 64) under each
   candidate config forced alone (value-block width BV 16/32/64, 2/4 warps, 2-4 stages), at a tree's trunk (one
   25K-row sequence), its branches (6 sequences) and trajectory-wise sequences (3, 65K rows): which config each
   round shape wants, which the autotuner's key cannot tell apart.

Prints tables and writes ``kernels.json`` (and ``kernels.png`` when matplotlib is there) to --out.
``--device cpu`` (with ``--quick --only logprobs``) runs ``compact_logprobs`` under the Triton interpreter
in float32 at small shapes, wall-clock timed: a smoke run that keeps the code path alive, not a
measurement. The KDA part needs CUDA (fla's autotuner benchmarks on the GPU).
Legend: T tokens, H heads, K/V head dims, C compact rows, S semantic positions, V vocab, D hidden.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.common import time_ms


def bench_kda(T=65536, H=16, K=128, V=128, layouts=((65536,), (4096,) * 16), every=4, reps=5, rounds=3,
              trace_dir=None):
    from harts.ops._fla import chunk_kda
    from harts.ops.kda_round import chunk_kda_round

    rows = []
    dev = "cuda"
    for lens in layouts:
        assert sum(lens) == T
        torch.manual_seed(0)
        cu_cpu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.long)
        cu = cu_cpu.to(dev)  # the runtime passes both (host copy: no stream sync in the argument checks)
        q = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16).requires_grad_()
        k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16().requires_grad_()
        v = torch.randn(1, T, H, V, device=dev, dtype=torch.bfloat16).requires_grad_()
        g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, device=dev)).requires_grad_()
        beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16).requires_grad_()
        do = torch.randn(1, T, H, V, device=dev, dtype=torch.bfloat16)
        seq, chunk = [], []
        for n, ln in enumerate(lens):
            nt = -(-ln // 64)
            for c in range(0, nt + 1, every):
                seq.append(n)
                chunk.append(c)
        dB = torch.randn(len(seq), H, K, V, device=dev)
        leaves = [q, k, v, g, beta]

        def run_fla():
            o, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu)
            torch.autograd.backward([o], [do])
            for x in leaves:
                x.grad = None

        def run_round(with_req):
            def f():
                o, _, B = chunk_kda_round(q, k, v, g, beta, cu, state_seq=seq if with_req else None,
                                          state_chunk=chunk if with_req else None, cu_seqlens_cpu=cu_cpu)
                torch.autograd.backward([o] + ([B] if with_req else []), [do] + ([dB] if with_req else []))
                for x in leaves:
                    x.grad = None
            return f

        def run_fla_fwd():
            with torch.no_grad():
                chunk_kda(q, k, v, g, beta, cu_seqlens=cu)

        def run_round_fwd():
            with torch.no_grad():
                chunk_kda_round(q, k, v, g, beta, cu, state_seq=seq, state_chunk=chunk, cu_seqlens_cpu=cu_cpu)
        # Interleaved rounds (fla, round, round with requests, ... then again): a drifting clock or a
        # neighbour's load hits every variant alike; each variant's figure is its median over all rounds.
        variants = {"fla": run_fla, "none": run_round(False), "req": run_round(True), "fla_f": run_fla_fwd,
                    "req_f": run_round_fwd}
        samples = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                samples[name].append(time_ms(fn, reps=reps))
        med = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
        t_fla, t_none, t_req, t_fla_f, t_req_f = (med[n] for n in ("fla", "none", "req", "fla_f", "req_f"))
        rows.append(dict(layout=f"{len(lens)}x{lens[0]}", boundaries=len(seq), fla_fwd_bwd_ms=t_fla,
                         round_no_req_fwd_bwd_ms=t_none, round_fwd_bwd_ms=t_req, ratio=t_req / t_fla,
                         ratio_no_req=t_none / t_fla, fla_fwd_ms=t_fla_f, round_fwd_ms=t_req_f,
                         samples_ms=samples,
                         kernels_fla=_kernel_times(run_fla, trace=_tr(trace_dir, "fla", lens)),
                         kernels_round=_kernel_times(run_round(True), trace=_tr(trace_dir, "round", lens)),
                         kernels_round_no_req=_kernel_times(run_round(False))))
        q = k = v = g = beta = do = dB = leaves = None  # free this layout's tensors (the closures hold them)
        torch.cuda.empty_cache()
    return rows


def _tr(trace_dir, what, lens):
    return os.path.join(trace_dir, f"trace_kda_{what}_{len(lens)}x{lens[0]}.json") if trace_dir else None


def _kernel_times(fn, top: int = 12, trace: str | None = None) -> dict:
    """One profiled call: device time per kernel (ms, the largest ``top``), their sum, and the wall time of
    the same call, so wall - kernel sum shows host gaps (syncs, launch overhead) rather than slow kernels.
    With ``trace`` the host side is recorded too, a chrome trace is written there, and the largest device
    idle gaps are listed with the kernel after each and the host ops that were running during it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with profile(activities=acts) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
    ks = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if us > 0 and e.device_type.name == "CUDA":
            ks[e.key[:90]] = ks.get(e.key[:90], 0.0) + us / 1e3
    total = sum(ks.values())
    out = {"wall_ms": a.elapsed_time(b), "kernel_sum_ms": total,
           "top": dict(sorted(ks.items(), key=lambda kv: -kv[1])[:top])}
    if trace:
        prof.export_chrome_trace(trace)
        out["gaps"] = _device_gaps(trace)
    return out


def _device_gaps(trace: str, top: int = 8) -> list[dict]:
    """Largest device idle gaps of the profiled call, each with the next kernel and the innermost host op
    running meanwhile (benchmarks.trace_summary.device_idle)."""
    from benchmarks.trace_summary import device_idle

    with open(trace) as f:
        return device_idle(json.load(f)["traceEvents"], min_gap_us=20.0, top=top)["gaps"]


def bench_logprobs(C=65536, V=157184, D=1536, ratio=5.6, baseline_chunk=8192, reps=3, device="cuda"):
    from harts.ops.logprobs import compact_logprobs

    dev = device
    cuda = torch.device(dev).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter computes in float32
    torch.manual_seed(0)
    S = int(C * ratio)
    h = (torch.randn(C, D, device=dev) * 0.05).to(dtype)
    w = (torch.randn(V, D, device=dev) * 0.05).to(dtype)
    rows = torch.cat([torch.arange(C, device=dev), torch.randint(0, C, (S - C,), device=dev)])
    tgts = torch.randint(0, V, (S,), device=dev)
    up = torch.randn(S, device=dev)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()

    def ours():
        out = compact_logprobs(hl, wl, rows, tgts)
        torch.autograd.backward([out], [up])

    def expand_chunked():
        for s in range(0, S, baseline_chunk):
            r, t = rows[s:s + baseline_chunk], tgts[s:s + baseline_chunk]
            logits = hl[r] @ wl.T
            lp = torch.log_softmax(logits.float(), -1).gather(-1, t[:, None])[:, 0]
            torch.autograd.backward([lp], [up[s:s + baseline_chunk]])

    ours()
    hl.grad = wl.grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ours()
        torch.cuda.synchronize()
        peak_extra = torch.cuda.max_memory_allocated() - base
    else:  # no allocator statistics on CPU
        ours()
        peak_extra = None
    grads_bytes = hl.grad.numel() * hl.grad.element_size() + wl.grad.numel() * wl.grad.element_size()

    def ours_t():
        hl.grad = wl.grad = None
        ours()

    def base_t():
        hl.grad = wl.grad = None
        expand_chunked()
    t_ours = time_ms(ours_t, warmup=1, reps=reps, device=dev)
    t_base = time_ms(base_t, warmup=1, reps=reps, device=dev)
    with torch.no_grad():
        t_ours_f = time_ms(lambda: compact_logprobs(h, w, rows, tgts), warmup=1, reps=reps, device=dev)
    limit = C * 8192 * 4
    return [dict(C=C, V=V, D=D, S=S, ours_fwd_bwd_ms=t_ours, ours_fwd_ms=t_ours_f, expand_fwd_bwd_ms=t_base,
                 speedup=t_base / t_ours, peak_extra_bytes=peak_extra,
                 peak_extra_minus_grads_bytes=None if peak_extra is None else peak_extra - grads_bytes,
                 limit_bytes=limit, within_limit=None if peak_extra is None else peak_extra <= limit)]


def bench_moe_gather(T=65536, K=8, D=1536, reps=20):
    from harts.ops.moe.experts import gather_sum, gather_sum_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    M = T * K
    src = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(M, device="cuda", generator=g)
    slot_TK, token_M1 = perm.view(T, K), (torch.argsort(perm) // K)[:, None]
    compiled = torch.compile(gather_sum_reference, dynamic=False)
    dst = torch.empty_like(src)
    rows = []
    for what, s, idx, inv in (("combine (K=8)", src, slot_TK, token_M1), ("slot gather (K=1)", x, token_M1, slot_TK)):
        nbytes = (idx.numel() + idx.shape[0]) * D * 2  # rows read + rows written
        r = {"what": what, "copy_ms": time_ms(lambda: dst.copy_(src), reps=reps),
             "kernel_ms": time_ms(lambda: gather_sum(s, idx, inv, backend="fast"), reps=reps),
             "inductor_ms": time_ms(lambda: compiled(s, idx), reps=reps),
             "eager_ms": time_ms(lambda: gather_sum_reference(s, idx), reps=reps)}
        r["kernel_TBps"] = nbytes / r["kernel_ms"] / 1e9
        r["inductor_TBps"] = nbytes / r["inductor_ms"] / 1e9
        k_order = s.index_select(0, idx[:, 0]).float()  # the kernel's contract: fp32, summed in k order
        for k in range(1, idx.shape[1]):
            k_order += s.index_select(0, idx[:, k]).float()
        out = gather_sum(s, idx, inv, backend="fast")
        r["bitwise_equal_k_order"] = bool(torch.equal(out, k_order.to(s.dtype)))
        r["max_abs_diff_torch_sum"] = (out.float() - gather_sum_reference(s, idx).float()).abs().max().item()
        rows.append(r)
    return rows


def bench_experts(T=65536, K=8, D=1536, F=512, E=128, reps=10, device="cuda", dtype=torch.bfloat16,
                  compiled: bool | None = None):
    """The routed experts' SwiGLU on expert-sorted rows (``harts.ops.moe.experts._grouped_swiglu``: gate and up as
    two grouped GEMMs over the same rows) against one grouped GEMM over gate and up weights stacked [E, 2F, D]
    (``_grouped_swiglu_stacked``: the rows read once, N = 2F per expert), fwd and fwd+bwd, with the routing weight
    on the activation in both. Rows per expert from a random top-K routing of T tokens. Both families run the
    stacked path (Qwen3.5's gate_up_proj as stored, Ling-3.0's [E, 2, F, D] flattened); the two-GEMM path is the
    comparison that decided it. ``stacked fused`` runs the stacked path's weighted SwiGLU and down projection as
    the op ``harts::moe_swiglu_down`` (the kernel choice ``swiglu="harts"``: one fused backward pass; on CUDA or
    the Triton interpreter; the default), against the same arithmetic as torch ops (``stacked``, run under
    ``swiglu="torch"``, which Inductor fuses under compile). ``compiled``
    (default: on CUDA) also times all under torch.compile (Inductor), as the model's compiled regions run them.
    The grouped GEMMs alone (forward and backward on the same operands, nothing between them) are timed too: the
    difference (``elementwise ms``) is what the SwiGLU, the routing weight and their backward add, the most a GEMM
    epilogue could save."""
    from harts.ops.choices import use_kernel_choices
    from harts.ops.moe.experts import _grouped_swiglu, _grouped_swiglu_stacked

    g = torch.Generator(device=device).manual_seed(0)
    M = T * K
    scores = torch.rand(T, E, device=device, generator=g)
    counts = torch.bincount(scores.topk(K, dim=1).indices.reshape(-1), minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    x = (torch.randn(M, D, device=device, generator=g) / 4).to(dtype).requires_grad_()
    w_gate, w_up = ((torch.randn(E, F, D, device=device, generator=g) / D ** 0.5).to(dtype).requires_grad_()
                    for _ in range(2))
    w_down = (torch.randn(E, D, F, device=device, generator=g) / F ** 0.5).to(dtype).requires_grad_()
    w_gu = torch.cat([w_gate.detach(), w_up.detach()], dim=1).requires_grad_()  # [E, 2F, D]
    scale = torch.rand(M, device=device, generator=g)
    dy = torch.randn(M, D, device=device, generator=g).to(dtype)

    def stacked_fused(x_MD, offs_E, w_gate_up_E2FD, w_down_EDF, scale_M):
        from harts.kernels.moe_swiglu import moe_swiglu_down

        gu_M2F = torch._grouped_mm(x_MD, w_gate_up_E2FD.transpose(-2, -1), offs=offs_E)
        return moe_swiglu_down(gu_M2F, scale_M, w_down_EDF, offs_E)

    fns = {"separate": (_grouped_swiglu, (w_gate, w_up)), "stacked": (_grouped_swiglu_stacked, (w_gu,))}
    if torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        fns["stacked fused"] = (stacked_fused, (w_gu,))
    if compiled is None:
        compiled = torch.device(device).type == "cuda"
    modes = {"eager": lambda f: f} | ({"compiled": torch.compile} if compiled else {})
    flops = 2 * M * D * 3 * F  # forward: gate, up, down
    r = {"M/D/F/E": f"{M}/{D}/{F}/{E}", "max_rows_per_expert": int(counts.max())}
    for mode, wrap in modes.items():
        for name, (fn, w_in) in fns.items():
            # "separate" and "stacked" are the torch ops whatever the default kernel choice
            with use_kernel_choices(swiglu="harts" if name == "stacked fused" else "torch"):
                fn = wrap(fn)
                params = (x, *w_in, w_down)

                def fwd():
                    return fn(x, offs, *w_in, w_down, scale)

                if mode == "compiled":  # compiled outside the timing (forward and backward graphs)
                    torch.autograd.grad(fwd(), params, dy)
                key = f"{mode} {name}"
                r[f"{key} fwd ms"] = time_ms(fwd, reps=reps, device=device)
                r[f"{key} fwd+bwd ms"] = time_ms(lambda: torch.autograd.grad(fwd(), params, dy), reps=reps,
                                                 device=device)
                r[f"{key} fwd+bwd TF/s"] = 3 * flops / r[f"{key} fwd+bwd ms"] / 1e9
        r[f"{mode} stacked / separate fwd+bwd"] = r[f"{mode} stacked fwd+bwd ms"] / r[f"{mode} separate fwd+bwd ms"]
        if "stacked fused" in fns:
            r[f"{mode} stacked fused / stacked fwd+bwd"] = (r[f"{mode} stacked fused fwd+bwd ms"]
                                                            / r[f"{mode} stacked fwd+bwd ms"])
    # the grouped GEMMs alone (their forward and backward, no elementwise work between them), same operands: what
    # the SwiGLU, the routing weight and their backward cost on top, i.e. what a GEMM epilogue could save
    h = torch.randn(M, F, device=device, generator=g).to(dtype).requires_grad_()
    dh_in = torch.randn(M, 2 * F, device=device, generator=g).to(dtype)
    gemms = {"separate": lambda: (torch._grouped_mm(x, w_gate.transpose(-2, -1), offs=offs),
                                  torch._grouped_mm(x, w_up.transpose(-2, -1), offs=offs),
                                  torch._grouped_mm(h, w_down.transpose(-2, -1), offs=offs)),
             "stacked": lambda: (torch._grouped_mm(x, w_gu.transpose(-2, -1), offs=offs),
                                 torch._grouped_mm(h, w_down.transpose(-2, -1), offs=offs))}
    grads = {"separate": (dh_in[:, :F].contiguous(), dh_in[:, F:].contiguous(), dy), "stacked": (dh_in, dy)}
    wts = {"separate": (x, w_gate, w_up, h, w_down), "stacked": (x, w_gu, h, w_down)}
    for name, fn in gemms.items():
        ms = time_ms(lambda: torch.autograd.grad(fn(), wts[name], grads[name]), reps=reps, device=device)
        r[f"GEMMs alone {name} fwd+bwd ms"] = ms
        r[f"GEMMs alone {name} fwd+bwd TF/s"] = 3 * flops / ms / 1e9
        for mode in modes:
            for variant in [v for v in fns if v.startswith(name)]:
                r[f"{mode} {variant} elementwise ms"] = r[f"{mode} {variant} fwd+bwd ms"] - ms
    with use_kernel_choices(swiglu="torch"):
        a = _grouped_swiglu(x, offs, w_gate, w_up, w_down, scale)
        b = _grouped_swiglu_stacked(x, offs, w_gu, w_down, scale)
    r["max_abs_diff"] = (a.float() - b.float()).abs().max().item()
    r["bitwise_equal"] = bool(torch.equal(a, b))
    if "stacked fused" in fns:
        c = stacked_fused(x, offs, w_gu, w_down, scale)
        r["stacked fused vs stacked max_abs_diff"] = (b.float() - c.float()).abs().max().item()
    return [r]


def bench_packed_attention(lens=(11628, 8402, 9745, 7204, 15452, 8114, 4991), reps=10):
    from harts.ops.attention.fast import _cudnn_per_sequence, packed_self_attention_impl, varlen_attention_fast

    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    T = int(cu[-1])
    rows = []
    for name, H, D, Dv in (("MLA (Ling-3.0)", 16, 192, 128), ("gated attention (Qwen3.5)", 16, 256, 256)):
        q, k = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.randn(T, H, Dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(T, H, Dv, device="cuda", dtype=torch.bfloat16)
        flops = sum(L * L * H * (D + Dv) for L in lens)  # causal: half of 2 * L^2 * (D + Dv) per head
        r = {"heads": name, "H/D/Dv": f"{H}/{D}/{Dv}",
             "dispatch": packed_self_attention_impl(q, k, v, len(lens))[0]}  # what the model runs at this shape
        paths = {"cudnn": lambda: _cudnn_per_sequence(q, k, v, cu, D ** -0.5),
                 # a distinct cu_seqlens tensor for the keys takes the flash varlen kernel
                 "flash": lambda: varlen_attention_fast(q, k, v, cu, cu.clone(), D ** -0.5, max(lens), max(lens))}
        for path, fwd in paths.items():
            r[f"{path}_fwd_ms"] = time_ms(fwd, reps=reps)
            r[f"{path}_fwd_bwd_ms"] = time_ms(lambda: torch.autograd.grad(fwd(), (q, k, v), do), reps=reps)
            r[f"{path}_fwd_TFps"] = flops / r[f"{path}_fwd_ms"] / 1e9
        r["cudnn_over_flash_fwd"] = r["cudnn_fwd_ms"] / r["flash_fwd_ms"]
        r["cudnn_over_flash_fwd_bwd"] = r["cudnn_fwd_bwd_ms"] / r["flash_fwd_bwd_ms"]
        rows.append(r)
    return rows


def bench_router(T=65536, D=1536, E=128, reps=20):
    """Router logits fwd+bwd (bf16 activations and weights, fp32 logits): ``router_logits`` (tensor cores both
    ways, the backward on the bf16x3 split of the gradient) against the GEMMs of the operands upcast to fp32
    (FMA units), with the backward's error against the float64 product."""
    import torch.nn.functional as F

    from harts.ops.moe import router_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, D, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16).requires_grad_()
    dl = torch.randn(T, E, device="cuda", generator=g)
    paths = {"tensor_cores": lambda: router_logits(x, w), "fp32_upcast": lambda: F.linear(x.float(), w.float())}
    exact = dl.double() @ w.detach().double()
    r = {"T/D/E": f"{T}/{D}/{E}"}
    for name, fwd in paths.items():
        r[f"{name}_fwd_ms"] = time_ms(fwd, reps=reps)
        r[f"{name}_fwd_bwd_ms"] = time_ms(lambda: torch.autograd.grad(fwd(), (x, w), dl), reps=reps)
        gx = torch.autograd.grad(fwd(), (x,), dl)[0]
        r[f"{name}_dx_rel_err"] = ((gx.double() - exact).norm() / exact.norm()).item()
    return [r]


def bench_tree_conv(C=61924, Q=12, widths=(8192, 2048), reps=20, device="cuda"):
    """Each tree-convolution implementation against the trajectory-wise convolution on the same rows. The
    ancestor rows are random rows of x (sequence 0 has none, as a root); what is timed is the kernels' work per
    row, which does not depend on where the ancestors are. Outputs must agree across the implementations
    (``max_rel_diff``: fla's run the same arithmetic per row; HARTS's kernels, ``conv="harts"``, round the
    backward's pre-activation differently, within bf16 rounding)."""
    import harts.ops
    from harts.ops.conv.fast import short_conv_fast
    from harts.ops.tree_conv import fast

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    cu = torch.linspace(0, C, Q + 1, device=dev).long()
    cu_cpu = cu.cpu()
    ctx = torch.randint(0, C, (Q, 3), device=dev, generator=g)
    ctx[0] = -1
    rows, saved = [], fast.IMPL
    try:
        for D in widths:
            x = torch.randn(C, D, device=dev, dtype=dtype, generator=g).requires_grad_()
            w = torch.randn(D, 4, device=dev, generator=g) * 0.5
            dy = torch.randn(C, D, device=dev, dtype=dtype, generator=g)
            def tree(impl):
                def run():
                    fast.IMPL = impl
                    return fast.tree_short_conv_fast(x, w, cu, ctx, "silu")
                return run

            def harts_kernels(fn):  # the kernel choice conv="harts" (harts.ops.conv.fused), on both paths
                def run():
                    with harts.ops.use_kernel_choices(conv="harts"):
                        return fn()
                return run

            paths = {f"tree {impl}": tree(impl) for impl in fast._IMPLS}
            paths["trajectory-wise"] = lambda: short_conv_fast(x, w, cu, "silu", cu_seqlens_cpu=cu_cpu)
            paths["tree harts"] = harts_kernels(tree("split_chunks"))
            paths["trajectory-wise harts"] = harts_kernels(paths["trajectory-wise"])
            r = {"channels": D, "rows": C, "sequences": Q}
            outs = []
            for name, fn in paths.items():
                with torch.no_grad():
                    r[f"{name} fwd ms"] = time_ms(fn, reps=reps, device=device)
                r[f"{name} fwd+bwd ms"] = time_ms(lambda: torch.autograd.grad(fn(), (x,), dy), reps=reps,
                                                  device=device)
                if name.startswith("tree"):
                    dx = torch.autograd.grad(fn(), (x,), dy)[0]
                    outs.append(torch.cat([fn().detach().float().flatten(), dx.float().flatten()]))
            r["max_rel_diff"] = max(((o - outs[0]).abs().max() / outs[0].abs().max()).item() for o in outs)
            rows.append(r)
    finally:
        fast.IMPL = saved
    return rows


def bench_scan(layouts=(("trunk", (25498,)), ("branches", (15065, 8000, 5000, 4000, 2000, 1280)),
                         ("trajectories", (34175, 20000, 11361))), HV=16, K=128, V=128, BT=64, reps=10):
    """The rounds' state scans (``harts.kernels.kda_round``: forward h, backward dh) under each candidate config
    forced alone, at the row layouts of a tree's rounds (Ling-3.0-tiny seed 9002's fullest microbatch): its
    shared trunk (one long sequence: HV * V / BV programs, fewer than the SMs, so the per-chunk latency sets the
    time), its branches, and trajectory-wise sequences (as the baseline packs them). Why: the autotuner's key
    (and the tuned table in harts/ops/tuned) does not see how many sequences a round has, so one config serves
    all three; this shows what each would pick. Inputs are random (timing only)."""
    import triton

    import harts.kernels.kda_round as kr

    dev = "cuda"
    cands = [triton.Config({"BV": bv}, num_warps=w, num_stages=st) for bv in (16, 32, 64) for w in (2, 4)
             for st in (2, 3, 4)]
    tuners = [kr.kda_round_fwd_kernel_h.fn, kr.kda_round_bwd_kernel_dh.fn]  # the autotuners under the heuristics
    saved = [(t.configs, dict(t.cache)) for t in tuners]
    rows = []
    try:
        for name, lens in layouts:
            torch.manual_seed(0)
            T, N = sum(lens), len(lens)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
            nch = [-(-n // BT) for n in lens]
            co = torch.tensor([0, *torch.tensor(nch).cumsum(0).tolist()], device=dev)
            kg, w = (torch.randn(1, T, HV, K, device=dev, dtype=torch.bfloat16) * 0.1 for _ in range(2))
            u, do, dv = (torch.randn(1, T, HV, V, device=dev, dtype=torch.bfloat16) for _ in range(3))
            gk = torch.full((1, T, HV, K), -0.01, device=dev)

            def fwd():
                return kr.kda_round_fwd_h(kg, w, u, gk, None, False, cu, co, sum(nch), BT)

            def bwd():
                return kr.kda_round_bwd_dh(kg, kg, w, gk, None, None, None, None, do, dv, 0.1, cu, co, sum(nch), BT)

            times = {}
            for c in cands:
                for t in tuners:
                    t.configs, t.cache = [c], {}
                times[c] = (time_ms(fwd, reps=reps), time_ms(bwd, reps=reps))
            r = {"layout": name, "rows": T, "sequences": N, "programs at BV=64": N * HV * V // 64}
            for i, d in enumerate(("fwd", "bwd")):
                for bv in (16, 32, 64):
                    r[f"{d} BV={bv} ms"] = min(v[i] for c, v in times.items() if c.kwargs["BV"] == bv)
                best = min(times, key=lambda c: times[c][i])
                r[f"{d} best"] = f"BV={best.kwargs['BV']} w{best.num_warps} s{best.num_stages}"
            r["all_ms"] = {f"BV={c.kwargs['BV']} w{c.num_warps} s{c.num_stages}": v for c, v in times.items()}
            rows.append(r)
    finally:
        for t, (configs, cache) in zip(tuners, saved):
            t.configs, t.cache = configs, cache
    return rows


def _table(rows, title):
    if not rows:
        return
    keys = [k for k, v in rows[0].items() if not isinstance(v, dict)]
    print(f"\n## {title}\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    for r in rows:
        if "samples_ms" in r:
            print(f"\n{r['layout']} per-round medians (rounds interleaved), ms: " + "; ".join(
                f"{n} {[round(x, 3) for x in xs]}" for n, xs in r["samples_ms"].items()))
        for k, v in r.items():
            if isinstance(v, dict) and "top" in v:
                print(f"\n{r.get('layout', '')} {k}: wall {v['wall_ms']:.3f} ms, kernels {v['kernel_sum_ms']:.3f} ms")
                for name, ms in v["top"].items():
                    print(f"    {ms:8.3f}  {name}")
                for g in v.get("gaps", []):
                    print(f"    gap {g['gap_us']:8.1f} us before {g['next']} (after {g['before']}); host: {g['host']}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/bench_kernels")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the interpreter smoke run of the log-probs")
    ap.add_argument("--only", choices=["kda", "logprobs", "moe_gather", "experts", "attention", "router", "conv",
                                       "scan"], default=None)
    ap.add_argument("--trace", metavar="DIR", default=None, help="also write chrome traces of the KDA calls to "
                    "DIR and list the largest device idle gaps in kernels.json")
    a = ap.parse_args(argv)
    cuda = torch.device(a.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels: no CUDA GPU here (--device cpu runs the log-probs smoke run)")
    if not cuda and a.only != "experts" and (a.only != "logprobs" or os.environ.get("TRITON_INTERPRET") != "1"):
        raise SystemExit("benchmarks.kernels on CPU runs only --only logprobs, under TRITON_INTERPRET=1, and "
                         "--only experts --quick (float32)")
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    import triton
    res["triton"] = triton.__version__
    t0 = time.time()
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
    if a.only in (None, "kda"):
        kw = dict(T=8192, layouts=((8192,), (2048,) * 4)) if a.quick else {}
        res["kda"] = bench_kda(**kw, trace_dir=a.trace)
        _table(res["kda"], "chunk_kda_round vs fla chunk_kda (bf16, fwd+bwd, ms; ratio = round / fla)")
    if a.only in (None, "logprobs"):
        kw = (dict(C=4096, V=32768) if cuda else dict(C=64, V=256, D=32, baseline_chunk=128, reps=1)) if a.quick else {}
        res["logprobs"] = bench_logprobs(**kw, device=a.device)
        _table(res["logprobs"], "compact_logprobs vs expand + log_softmax (bf16, fwd+bwd, ms)")
    if a.only in (None, "moe_gather"):
        res["moe_gather"] = bench_moe_gather(**(dict(T=4096) if a.quick else {}))
        _table(res["moe_gather"], "MoE gather-sum: Triton kernel vs the reference under Inductor and eager (bf16, ms)")
    if a.only in (None, "experts"):
        kw = (dict(T=256, D=64, F=32, E=8) if a.quick else {}) | ({} if cuda else dict(device="cpu",
                                                                                    dtype=torch.float32))
        res["experts"] = bench_experts(**kw)
        _table(res["experts"], "routed experts' SwiGLU: gate and up as two grouped GEMMs vs one over stacked "
                               "weights (fwd and fwd+bwd, ms)")
    if a.only in (None, "attention"):
        res["attention"] = bench_packed_attention(**(dict(lens=(1500, 700)) if a.quick else {}))
        _table(res["attention"], "packed self-attention: cuDNN per sequence vs flash varlen (bf16, ms)")
    if a.only in (None, "router"):
        res["router"] = bench_router(**(dict(T=4096) if a.quick else {}))
        _table(res["router"], "router logits: tensor cores (bwd on the bf16x3 split) vs fp32 upcast (ms)")
    if a.only in (None, "conv"):
        res["conv"] = bench_tree_conv(**(dict(C=4096, Q=3) if a.quick else {}))
        _table(res["conv"], "tree short convolution by implementation vs trajectory-wise (bf16, ms)")
    if a.only in (None, "scan"):
        res["scan"] = bench_scan(**(dict(layouts=(("trunk", (4096,)), ("trajectories", (2048, 2048))), reps=3)
                                    if a.quick else {}))
        _table(res["scan"], "round state scans by config, best of each value-block width (bf16, ms)")
    res["wall_s"] = time.time() - t0
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "kernels.json"), "w") as f:
        json.dump(res, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        if "kda" in res:
            labels = [r["layout"] for r in res["kda"]]
            x = range(len(labels))
            ax[0].bar([i - 0.25 for i in x], [r["fla_fwd_bwd_ms"] for r in res["kda"]], 0.25, label="fla chunk_kda")
            ax[0].bar(list(x), [r["round_no_req_fwd_bwd_ms"] for r in res["kda"]], 0.25, label="round, no req")
            ax[0].bar([i + 0.25 for i in x], [r["round_fwd_bwd_ms"] for r in res["kda"]], 0.25,
                      label="round, 1/4 chunks")
            ax[0].set_xticks(list(x), labels)
            ax[0].set_ylabel("fwd+bwd ms")
            ax[0].legend()
        if "logprobs" in res:
            r = res["logprobs"][0]
            ax[1].bar(["compact (ours)", "expand+log_softmax"], [r["ours_fwd_bwd_ms"], r["expand_fwd_bwd_ms"]])
            ax[1].set_ylabel("fwd+bwd ms")
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "kernels.png"), dpi=100)
    except ImportError:
        pass
    print(f"\nwrote {os.path.join(a.out, 'kernels.json')}")


if __name__ == "__main__":
    main()
