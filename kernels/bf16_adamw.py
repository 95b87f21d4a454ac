"""One-pass AdamW update for bf16 weights with int16 low bits and bf16 moments (harts.train.bf16_adamw).

Why: the torch-op update runs ~20 elementwise kernels per tensor in fp32 temporaries (~90 B of memory
traffic per parameter); on the one-H200 Ling-3.0-tiny step the optimizer and clipping took 0.43 s of 4.58 s.
This kernel reads weight, low bits, both moments (2 B each) and the fp32 gradient (4 B) once and writes
weight, low bits and moments once: 20 B per parameter.

Every bf16 tensor is passed as its int16 bit pattern and converted with integer shifts, so the kernel
does the same bit manipulations as the torch path (``_join``/``_split_``: the master weight is
(bf16 bits << 16) + low bits, split back with round-half-away on the magnitude) and stays runnable under
TRITON_INTERPRET (numpy has no bfloat16). The moments are rounded to bf16 to nearest-even, as
``Tensor.copy_`` does. The fp32 arithmetic follows torch's formulas (lerp for the first moment, addcmul,
bias-corrected sqrt, addcdiv); the compiler may fuse multiply-adds, so results can differ from the torch
path in the last fp32 bit (the tests bound it).
"""
import triton
import triton.language as tl


@triton.jit
def bf16_adamw_fwd_kernel_update(w_bits, low_bits, m_bits, v_bits, g, N, one_minus_beta1, beta2, one_minus_beta2, eps,
                                 decay, step_size, bias_correction2, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    # bf16 bits -> fp32: the bit pattern in the high half of an int32
    w32 = ((tl.load(w_bits + offs, mask=mask, other=0).to(tl.int32) << 16)
           + tl.load(low_bits + offs, mask=mask, other=0).to(tl.int32)).to(tl.float32, bitcast=True)
    m = (tl.load(m_bits + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    v = (tl.load(v_bits + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    grad = tl.load(g + offs, mask=mask, other=0.0)

    # the scalars arrive as fp32 roundings of the host's doubles, as torch's scalar arguments do; IEEE
    # division and square root (Triton's defaults are approximate)
    m = m + one_minus_beta1 * (grad - m)  # torch.lerp with weight 1 - beta1 < 0.5
    v = v * beta2 + one_minus_beta2 * (grad * grad)  # addcmul
    denom = tl.sqrt_rn(tl.div_rn(v, bias_correction2)) + eps
    w32 = w32 * decay
    w32 = w32 - step_size * tl.div_rn(m, denom)  # addcdiv

    # fp32 -> bf16 bits, round to nearest even (finite values; NaN/Inf stay NaN/Inf in the high half)
    mb = m.to(tl.int32, bitcast=True)
    vb = v.to(tl.int32, bitcast=True)
    m_hi = (mb + 0x7FFF + ((mb >> 16) & 1)) >> 16
    v_hi = (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16
    tl.store(m_bits + offs, m_hi.to(tl.int16), mask=mask)
    tl.store(v_bits + offs, v_hi.to(tl.int16), mask=mask)
    # master weight -> bf16 (round half away on the magnitude) + the exact signed remainder
    wb = w32.to(tl.int32, bitcast=True)
    hi = (wb + 0x8000) >> 16
    tl.store(w_bits + offs, hi.to(tl.int16), mask=mask)
    tl.store(low_bits + offs, (wb - (hi << 16)).to(tl.int16), mask=mask)


def bf16_adamw_update_(w, low, m, v, g, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                       step: int, block: int = 1024) -> None:
    """In place: ``w`` (bf16), ``low`` (int16), ``m``/``v`` (bf16) from the fp32 gradient ``g``; all contiguous
    and of one shape. ``step`` is the 1-based step count after this update's increment."""
    import torch

    for name, t, dt in (("w", w, torch.bfloat16), ("low", low, torch.int16), ("m", m, torch.bfloat16),
                        ("v", v, torch.bfloat16), ("g", g, torch.float32)):
        if t.dtype != dt or not t.is_contiguous() or t.shape != w.shape:
            raise ValueError(f"bf16_adamw_update_: {name} must be a contiguous {dt} tensor of shape {tuple(w.shape)}, "
                             f"got {t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()})")
    n = w.numel()
    if n == 0:
        return
    if not 0.0 <= 1.0 - beta1 < 0.5:
        raise ValueError(f"bf16_adamw_update_: beta1 = {beta1}; "
                         "the kernel uses torch.lerp's formula for 1 - beta1 < 0.5")
    grid = (triton.cdiv(n, block),)
    bf16_adamw_fwd_kernel_update[grid](
        w.view(torch.int16), low, m.view(torch.int16), v.view(torch.int16), g, n, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        1.0 - lr * weight_decay, lr / (1.0 - beta1 ** step), 1.0 - beta2 ** step, BLOCK=block)
