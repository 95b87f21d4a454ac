"""AdamW for bf16 weights that have no fp32 master copy (the one-GPU Ling-3.0-tiny setting).

Why: fp32 master weights plus fp32 Adam moments cost 16 B per parameter (126 GB for 7.9B), which does not
fit next to activations on one 141 GB H200, so that run keeps its weights in bf16. Done naively (torch's
AdamW on the bf16 tensors) this loses two things:

1. The update ``w - lr * u`` rounds back to bf16: at lr 1e-5 a step is below half an ulp of any weight
   with |w| >= 2^-8, so ~85 % of N(0, 0.02) weights and every norm weight (1.0) never move (training would
   move only the small weights and the fp32 parameters).
2. Gradients accumulate over microbatches in bf16 ``.grad``: each addition rounds the running sum to 8
   significant bits, which matters when per-microbatch gradients are large and cancel (GRPO's zero-mean
   advantages over trajectories that share a prefix, computed trajectory-wise).

Here each bf16 parameter's gradient is added, as soon as autograd has produced it, into an fp32 buffer
(a post-accumulate-grad hook; ``accumulate_grads()`` does the same for gradients set outside autograd,
e.g. FSDP's), and ``.grad`` is freed; and each bf16 weight keeps the low 16 bits of its fp32
master weight in an int16 buffer: the visible bf16 weight is the master rounded to nearest, and weight +
low bits rebuild the fp32 master bit for bit, so the update is exactly fp32-master AdamW's (the test
checks against torch's AdamW on an fp32 copy). Memory per bf16 parameter: weight 2 + low bits 2 +
moments 2 x 2 (bf16, see ``state_dtype``) + fp32 gradient 4 = 12 B (naive bf16 AdamW: 8 B; fp32 master
weights and moments: 16 B plus the bf16 compute copy).

Moments stored in bf16 need ``1 - beta >= 2^-6``: a smaller EMA increment would round away (the
constructor says so). Parameters that are not bf16 (A_log, dt_bias) get plain fp32 AdamW.
"""

from __future__ import annotations

import torch

__all__ = ["BF16AdamW"]

_MIN_EMA_STEP = 2.0 ** -6  # smallest 1 - beta whose EMA increments survive bf16 state rounding


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (aliases its storage), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _join(w_bf16: torch.Tensor, low_i16: torch.Tensor) -> torch.Tensor:
    """The fp32 master weight: bf16 bits as the high half, the stored signed residual as the low half."""
    hi = w_bf16.detach().view(torch.int16).to(torch.int32) << 16
    return (hi + low_i16.to(torch.int32)).view(torch.float32)


def _split_(w32: torch.Tensor, w_bf16: torch.Tensor, low_i16: torch.Tensor) -> None:
    """Writes round-to-nearest(w32) into ``w_bf16`` and the exact remainder (bits) into ``low_i16``.
    Adding 2^15 before dropping the low half rounds the magnitude to nearest (float bit patterns grow
    with magnitude for either sign, and a carry moves into the exponent as it should), so the remainder
    is a signed 16-bit integer and _join restores w32 bit for bit."""
    bits = w32.view(torch.int32)
    hi = (bits + 0x8000) >> 16
    low_i16.copy_(bits - (hi << 16))
    w_bf16.copy_(hi.to(torch.int16).view(torch.bfloat16))


class BF16AdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam (torch.optim.AdamW's formula) with fp32 gradient accumulation and bf16
    weights backed by their fp32 low bits. ``grads()`` returns the fp32 gradients (placed like their
    parameters, so harts.train.parallelize.clip_grad_norm_mixed_ clips them on any mesh); call
    ``accumulate_grads()`` after every backward (a no-op when the hooks already took every gradient)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state_dtype: torch.dtype = torch.bfloat16,
                 fused: bool | None = None, foreach=None):  # foreach: accepted for torchtitan's kwargs, unused
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"state_dtype must be torch.bfloat16 or torch.float32, got {state_dtype}")
        if state_dtype == torch.bfloat16:
            for name, b in (("beta1", betas[0]), ("beta2", betas[1])):
                if 1.0 - b < _MIN_EMA_STEP:
                    raise ValueError(
                        f"{name} = {b}: with bf16 Adam moments 1 - {name} must be >= 2^-6 = {_MIN_EMA_STEP:.4f} "
                        f"(smaller EMA increments round away); use state_dtype=torch.float32 or fp32 master "
                        f"weights (FSDP mixed precision)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        # fused: one Triton kernel per bf16 tensor (harts.kernels.bf16_adamw) instead of ~20 torch ops, equal up to
        # the last fp32 bits of the master weight; None/False = torch ops; True needs CUDA (or TRITON_INTERPRET=1)
        self.fused = bool(fused)
        if self.fused and state_dtype != torch.bfloat16:
            raise ValueError("BF16AdamW(fused=True) needs state_dtype=torch.bfloat16 (the kernel stores bf16 moments)")
        self._main: dict[torch.Tensor, torch.Tensor] = {}  # bf16 param -> fp32 gradient (not checkpointed)
        self._fresh: set[torch.Tensor] = set()  # params whose fp32 gradient holds this step's sum
        self._hooks = [p.register_post_accumulate_grad_hook(self._take_grad)
                       for p in self._bf16_params() if p.requires_grad]

    def _bf16_params(self):
        return [p for g in self.param_groups for p in g["params"] if p.dtype == torch.bfloat16]

    # -------------------------------------------------------------------- gradients
    def _take_grad(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        buf = self._main.get(p)
        if buf is None:
            self._main[p] = g.float()
        elif p in self._fresh:
            buf.add_(g)
        else:
            buf.copy_(g)
        self._fresh.add(p)
        p.grad = None

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Move any bf16 ``.grad`` left by code that bypasses autograd's accumulation into fp32."""
        for p in self._bf16_params():
            if p.grad is not None:
                self._take_grad(p)

    def grads(self) -> list[torch.Tensor]:
        """This step's gradients, fp32 for bf16 parameters (what clipping and the update read)."""
        self.accumulate_grads()
        grads = (self._grad(p) for group in self.param_groups for p in group["params"])
        return [g for g in grads if g is not None]

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        if p.dtype == torch.bfloat16:
            return self._main[p] if p in self._fresh else None
        return p.grad

    def free_grad_buffers(self) -> None:
        """Drop the fp32 gradient buffers (the next backward allocates them again); for tools that need the
        memory between gradient evaluations, e.g. benchmarks.gradgap's fp32 truth."""
        self._main.clear()
        self._fresh.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._fresh.clear()  # the fp32 buffers are kept and overwritten by the next step's first gradient
        super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict) -> None:
        """torch's loader casts every floating-point parameter's state to the parameter's dtype, which
        would turn the int16 low bits (and fp32 moments) into bf16 values; put the saved dtypes back."""
        super().load_state_dict(state_dict)
        ours = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(saved_ids, ours))
        for pid, st in state_dict["state"].items():
            p = by_id[pid]
            for name, v in st.items():
                if name != "step" and torch.is_tensor(v) and self.state[p][name].dtype != v.dtype:
                    self.state[p][name] = v.to(device=p.device, copy=True)

    # -------------------------------------------------------------------- update
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.accumulate_grads()  # gradients set outside autograd since the last grads()
        if self.fused:
            from harts.kernels.bf16_adamw import bf16_adamw_update_
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                g = self._grad(p)
                if g is None:
                    continue
                low = p.dtype == torch.bfloat16
                st = self.state[p]
                if not st:
                    sd = self.state_dtype if low else p.dtype
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, dtype=sd)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=sd)
                    if low:
                        st["low_bits"] = torch.zeros_like(p, dtype=torch.int16)
                st["step"] += 1
                t = float(st["step"])
                if low and self.fused:
                    bf16_adamw_update_(_local(p), _local(st["low_bits"]), _local(st["exp_avg"]),
                                       _local(st["exp_avg_sq"]), _local(g), lr=lr, beta1=b1, beta2=b2, eps=eps,
                                       weight_decay=wd, step=int(t))
                    continue
                # elementwise from here: DTensors (FSDP/TP/EP shards) are updated through their local shards
                pl, ea, es = _local(p), _local(st["exp_avg"]), _local(st["exp_avg_sq"])
                g32 = _local(g).float()
                m = ea.float().lerp_(g32, 1 - b1)
                v = es.float().mul_(b2).addcmul_(g32, g32, value=1 - b2)
                ea.copy_(m)
                es.copy_(v)
                step_size = lr / (1 - b1 ** t)
                denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
                if not low:
                    pl.mul_(1 - lr * wd).addcdiv_(m, denom, value=-step_size)
                    continue
                lo = _local(st["low_bits"])
                w = _join(pl, lo).mul_(1 - lr * wd).addcdiv_(m, denom, value=-step_size)
                _split_(w, pl, lo)
        return loss
