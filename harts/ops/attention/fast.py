"""GPU varlen attention: cuDNN's fused attention per sequence where queries and keys are the same rows,
else flash-attn's varlen kernel if importable, else torch's varlen_attn.

Why cuDNN for packed self-attention: MLA's head dims differ (192 for q/k, 128 for v) and the FA2 kernels
behind flash-attn and torch's varlen_attn need one head dim, so V is zero-padded to 192 and a third of the
PV product and of its gradient is spent on zeros; cuDNN's Hopper kernels take the two head dims as they
are. On the H200 at Ling-3.0-tiny's MLA shape (16 heads, 65,536 packed rows in sequences of 5K-15K) the
per-sequence cuDNN calls run forward in 0.42x and forward + backward in 0.61x the time of the padded
varlen kernel. Where the head dims are equal (Qwen3.5's 256 / 256) flash pads nothing, and cuDNN is still
faster: 0.735x flash's forward + backward (``python -m benchmarks.kernels --only attention``), with output
and gradients as close to the float64 truth as flash's (GPU test). A value head wider than q/k (never in
the supported models) keeps flash: cuDNN's accuracy there is unchecked.

torch 2.11's own varlen entry into cuDNN is not usable (switched off in varlen_attn; its ragged path
returns wrong dq/dk at these head dims and aligns the causal diagonal top-left), so each sequence is one
dense [1, H, L, D] call on strided views of the packed rows, where causal top-left equals bottom-right
(Lq == Lk). Each sequence is padded at its end to a length bucket (``_bucket``): torch builds and caches
one cuDNN execution plan per shape, and without buckets every new trajectory length would build a new
plan (140-200 ms for forward + backward on the H200); the padded rows come after every real row, so under
the causal mask no real query sees them, and their outputs are cut. ``packed_self_attention_impl`` says
which kernel runs (and why not cuDNN); ``harts.ops.backend`` logs it once.

The flash path (queries a suffix of their keys, Lq != Lk: the HARTS views) is bottom-right causal
(flash-attn >= 2.1 convention; torch's wrapper calls the same kernel with window (-1, 0)).

Legend: Tq / Tk packed query / key rows, H heads, D q/k head dim, Dv value head dim, N sequences,
L one sequence's rows, Lb its bucket.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from harts.ops.backend import attention_fast_impl, log_once
from harts.ops.choices import ALLOWED, kernel_choices


def _max_len(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def _bucket(L: int) -> int:
    """L rounded up to a multiple of max(128, 2^floor(log2 L) / 16): padding below L / 16 or 128 rows, 16
    shapes per octave of lengths."""
    g = max(128, 1 << max(0, L.bit_length() - 5))
    return -(-L // g) * g


@functools.cache
def _cudnn_sdpa_available(device_index: int) -> str | None:
    if not torch.backends.cudnn.is_available():
        return "cuDNN not available"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN SDPA disabled (torch.backends.cuda.enable_cudnn_sdp)"
    if torch.cuda.get_device_capability(device_index) < (9, 0):
        return "measured faster only on Hopper (sm90+)"
    return None


# cuDNN builds an execution plan per attention shape on first use (140-200 ms fwd+bwd on the H200, then cached
# for the process). The shapes met so far, and callbacks on a new one: a benchmark then tells a run that built
# plans from a steady-state run, as it does for Triton compiles.
_CUDNN_SHAPES: set[tuple] = set()
CUDNN_SHAPE_HOOKS: list = []


def note_cudnn_shape(*key) -> None:
    """Record one cuDNN attention call's shape (eager calls only: compiled code is timed by its own warm-up)."""
    if torch.compiler.is_compiling() or key in _CUDNN_SHAPES:
        return
    _CUDNN_SHAPES.add(key)
    for hook in CUDNN_SHAPE_HOOKS:
        hook(key)


# Mean rows per sequence below which the one packed flash launch is kept: cuDNN runs one launch per sequence
# with one sequence each, which at a few hundred rows underfills the GPU (16 heads x L / 128 query tiles) and
# costs a host launch per sequence; the measured gain is at 5K-15K rows per sequence.
CUDNN_MIN_MEAN_LEN = 2048


CUDNN_MAX_HEAD_DIM = 256  # cuDNN's fused attention, q/k and v


def cudnn_attention_unsupported(q_THD: torch.Tensor, Dv: int) -> str | None:
    """Why cuDNN's fused attention cannot take these queries and value heads (None: it can): head dims,
    device, dtype, and the GPU / torch settings. The packed path and the view split both ask this."""
    D = q_THD.shape[-1]
    if max(D, Dv) > CUDNN_MAX_HEAD_DIM or D % 8 or Dv % 8:
        return f"head dims {D}/{Dv} (cuDNN: multiples of 8, at most {CUDNN_MAX_HEAD_DIM})"
    if not q_THD.is_cuda:
        return "not on CUDA"
    if q_THD.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q_THD.dtype}"
    return _cudnn_sdpa_available(q_THD.device.index or 0)


PACKED_KERNELS = ALLOWED["packed_attention"]


def packed_kernel() -> str:
    """The requested kernel of packed self-attention, ``harts.ops.kernel_choices().packed_attention`` (default
    from ``HARTS_PACKED_ATTENTION``): ``cudnn`` (the default: cuDNN per sequence where it takes the shapes, see
    ``packed_self_attention_impl``) or ``varlen`` (the one packed varlen call of ``attention_fast_impl``). Both
    are valid bf16 executions of the same attention; the fidelity bench runs the trajectory-wise baseline on
    each to measure how far a change of fused kernel moves it."""
    return kernel_choices().packed_attention


def packed_self_attention_impl(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THDv: torch.Tensor,
                               num_sequences: int = 1) -> tuple[str, str]:
    """(kernel, reason) for attention of ``num_sequences`` packed sequences over themselves: 'cudnn_sdpa' or
    the varlen kernel of ``attention_fast_impl``."""
    D, Dv = q_THD.shape[-1], v_THDv.shape[-1]
    if packed_kernel() == "varlen":
        why = "kernel choice packed_attention='varlen'"
    elif q_THD.shape[0] < CUDNN_MIN_MEAN_LEN * num_sequences:
        why = f"sequences shorter than {CUDNN_MIN_MEAN_LEN} rows on average"
    elif Dv > D:  # accuracy checked on the GPU at Dv < D (MLA's 192 / 128) and Dv == D (Qwen3.5's 256 / 256)
        why = f"head dims {D}/{Dv}: cuDNN checked for value heads up to the q/k head dim"
    else:
        why = cudnn_attention_unsupported(q_THD, Dv)
    if why is None:
        return "cudnn_sdpa", "same rows for queries and keys, cuDNN fused attention"
    return attention_fast_impl(), f"cuDNN not used: {why}"


def _cudnn_per_sequence(q_THD, k_THD, v_THDv, cu_N1, scale: float, sdpa_backend=None, cu_cpu=None) -> torch.Tensor:
    """``sdpa_backend``: cuDNN (the fast path), or another SDPA backend for the CPU tests of the plumbing.
    ``cu_cpu``: a host copy of ``cu_N1``, read instead of the device tensor (which costs a host sync).

    The sequences are cut from the packed rows and padded to their buckets by one autograd node per tensor
    (``_Buckets``), not by N slices: its backward joins their gradients with one concatenation, where N slices
    would each give a full-size zero gradient with their rows filled and sum the N of them (3 N full-size
    fills and adds per layer: in the H200 profile of the model bench, 132 bf16 add kernels took 30 ms of a
    1.77 s step, besides their fills)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_backend = SDPBackend.CUDNN_ATTENTION if sdpa_backend is None else sdpa_backend
    bounds = (cu_N1 if cu_cpu is None else cu_cpu).tolist()  # the loop below is over sequences
    if cu_cpu is not None and len(bounds) != cu_N1.numel():
        raise ValueError(f"cu_seqlens_cpu has {len(bounds)} entries, cu_seqlens {cu_N1.numel()}")
    if bounds[-1] != q_THD.shape[0] or bounds[0] != 0:
        raise ValueError(f"cu_seqlens spans rows [{bounds[0]}, {bounds[-1]}) of {q_THD.shape[0]} packed rows")
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if not lens:
        return v_THDv.new_zeros(q_THD.shape[0], q_THD.shape[1], v_THDv.shape[-1])
    buckets = [_bucket(L) for L in lens]
    gqa = k_THD.shape[1] != q_THD.shape[1]  # grouped key / value heads, read as they are
    outs = []
    with sdpa_kernel(sdpa_backend):  # raises rather than running another kernel
        for L, Lb, *seq in zip(lens, buckets, *(_Buckets.apply(t, lens, buckets) for t in (q_THD, k_THD, v_THDv))):
            note_cudnn_shape("causal", Lb, Lb, *seq[0].shape[1:], seq[2].shape[-1], seq[0].dtype, seq[1].shape[1])
            o_1HLDv = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in seq),
                                                     is_causal=True, scale=scale, enable_gqa=gqa)
            # squeeze, not [0]: a select's backward would fill and copy a full-size gradient once more
            outs.append(o_1HLDv.squeeze(0)[:, :L].transpose(0, 1))
    return torch.cat(outs)


class _Buckets(torch.autograd.Function):
    """Packed rows x [T, ...] of sequences ``lens`` (none empty) -> each sequence's rows followed by zero rows up
    to its bucket, [Lb, ...] each: views of one buffer that one concatenation writes. The backward cuts the
    sequences' real gradient rows out with one concatenation. (Per-sequence ``F.pad`` would copy each
    sequence's gradient once in its backward, and a split of x once more to join them.)"""

    @staticmethod
    def forward(ctx, x, lens, buckets):
        ctx.lens = lens
        pads = [Lb - L for L, Lb in zip(lens, buckets)]
        zero = x.new_zeros(max(pads), *x.shape[1:])
        pieces = []
        for t, p in zip(x.split(lens), pads):
            pieces += [t, zero[:p]] if p else [t]
        return torch.cat(pieces).split(buckets)

    @staticmethod
    def backward(ctx, *grads):
        return torch.cat([g[:L] for g, L in zip(grads, ctx.lens)]), None, None


def varlen_attention_fast(q_TqHD, k_TkHD, v_TkHDv, cu_q_N1, cu_k_N1, scale: float,
                          max_q: int | None = None, max_k: int | None = None, cu_cpu=None) -> torch.Tensor:
    if cu_q_N1 is cu_k_N1 and q_TqHD.shape[0] == k_TkHD.shape[0]:
        kernel, why = packed_self_attention_impl(q_TqHD, k_TkHD, v_TkHDv, cu_q_N1.numel() - 1)
        log_once(("attention kernel", kernel, why), "harts attention kernel -> %s (%s)", kernel, why)
        if kernel == "cudnn_sdpa":
            return _cudnn_per_sequence(q_TqHD, k_TkHD, v_TkHDv, cu_q_N1, scale, cu_cpu=cu_cpu)
    from harts.ops.attention.api import repeat_heads

    D, Dv, H = q_TqHD.shape[-1], v_TkHDv.shape[-1], q_TqHD.shape[1]
    k_TkHD, v_TkHDv = repeat_heads(k_TkHD, H), repeat_heads(v_TkHDv, H)  # the varlen kernels take H heads
    v = F.pad(v_TkHDv, (0, D - Dv)) if Dv < D else v_TkHDv
    cu_q, cu_k = cu_q_N1.to(torch.int32), cu_k_N1.to(torch.int32)
    max_q = _max_len(cu_q) if max_q is None else max_q
    max_k = _max_len(cu_k) if max_k is None else max_k
    impl = attention_fast_impl()
    if impl == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        o = flash_attn_varlen_func(q_TqHD, k_TkHD, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)
    elif impl == "torch_varlen":
        from torch.nn.attention.varlen import varlen_attn

        if "window_size" in inspect.signature(varlen_attn).parameters:
            o = varlen_attn(q_TqHD, k_TkHD, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))
        else:  # torch 2.10 spelling
            o = varlen_attn(q_TqHD, k_TkHD, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=True)
    else:
        raise RuntimeError("no fast varlen attention implementation available")
    return o[..., :Dv] if Dv < D else o
