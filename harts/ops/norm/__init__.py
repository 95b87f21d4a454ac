"""RMSNorm and gated RMSNorm with an explicit backend: the torch reference, or fla's fused Triton kernels.

Two cases always take the torch ops, whatever was requested: tracing under ``torch.compile`` (Inductor
fuses the same ops with their neighbours; ``harts.models.ling.compile_model`` compiles the layers' row-wise
regions) and DTensor operands (tensor parallelism hands the norms Replicate weights; the Triton kernels
take plain tensors; logged once).
"""
from __future__ import annotations

import logging
import sys

import torch

from harts.ops.backend import resolve
from harts.ops.norm.reference import gated_rms_norm_reference, rms_norm_reference

__all__ = ["rms_norm", "gated_rms_norm", "rms_norm_reference", "gated_rms_norm_reference"]

log = logging.getLogger("harts.ops.backend")
_logged: set[str] = set()


def _use_fast(backend: str, x: torch.Tensor, *others) -> bool:
    if torch.compiler.is_compiling():  # Inductor fuses the torch ops
        return False
    # A DTensor exists only once torch.distributed.tensor is imported; importing it here would cost the
    # first forward ~0.8 s for an isinstance check.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and any(isinstance(t, dtensor.DTensor) for t in (x, *others)):
        if not _logged:
            _logged.add("dtensor")
            log.info("harts backend norm -> torch ops (DTensor operands: tensor parallelism)")
        return False
    return resolve("norm", backend, x.device, x.dtype) == "fast"


def rms_norm(x_TD: torch.Tensor, w_D: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if _use_fast(backend, x_TD, w_D):
        from harts.ops.norm.fast import rms_norm_fast

        return rms_norm_fast(x_TD, w_D, eps)
    return rms_norm_reference(x_TD, w_D, eps)


def gated_rms_norm(x_TD: torch.Tensor, g_TD: torch.Tensor, w_D: torch.Tensor, eps: float,
                   backend: str = "auto") -> torch.Tensor:
    if _use_fast(backend, x_TD, g_TD, w_D):
        from harts.ops.norm.fast import gated_rms_norm_fast

        return gated_rms_norm_fast(x_TD, g_TD, w_D, eps)
    return gated_rms_norm_reference(x_TD, g_TD, w_D, eps)
