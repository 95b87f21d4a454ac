"""Explicit, logged backend selection for the model's ops.

Every op (attention, kda, conv, moe_experts, moe_gather_sum, logprobs, norm) has an exact ``reference``
implementation (pure torch, float64-capable, runs on CPU) and a ``fast`` one (GPU kernels).
``resolve(op, requested, device, dtype)`` turns a request into a concrete backend name and logs the choice
once per (op, choice, reason), so a run's numerics are never changed by a silent fallback:

- ``"reference"`` always gives the reference.
- ``"fast"`` gives the fast path or raises with the reason it is unavailable.
- ``"auto"`` gives the fast path on CUDA with a half-precision / fp32 dtype the kernels support, and the
  reference on CPU or for float64 (the reference *is* the CPU path, by design, not a fallback).
"""
from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from harts import env

__all__ = ["resolve", "attention_fast_impl", "has_fla", "log_once"]

log = logging.getLogger("harts.ops.backend")

OPS = ("attention", "kda", "conv", "moe_experts", "moe_gather_sum", "logprobs", "norm")
# Triton-only ops whose fast path also runs on the CPU under TRITON_INTERPRET=1 (CI tests the kernel code;
# only when asked for explicitly with "fast": "auto" on CPU stays on the reference).
_INTERPRETABLE = ("kda", "conv", "logprobs", "norm", "moe_gather_sum")
_logged: set[tuple] = set()
# Constants, not calls: resolve() runs inside torch.compile'd regions (norms, experts, the MoE gather-sum), and
# torch 2.11's Dynamo refuses to trace importlib's find_spec (through functools.cache too).
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_HAS_FLA = _HAS_TRITON and importlib.util.find_spec("fla") is not None


def has_fla() -> bool:
    return _HAS_FLA


@functools.cache
def attention_fast_impl() -> str | None:
    """'flash_attn' if flash-attn is importable, else 'torch_varlen' if torch has varlen_attn, else None."""
    if importlib.util.find_spec("flash_attn") is not None:
        try:
            import flash_attn  # noqa: F401

            return "flash_attn"
        except Exception as e:  # a broken install must not be used silently
            log.warning("flash_attn is installed but failed to import (%s); not using it", e)
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        return "torch_varlen"
    except Exception:
        return None


def _interpreting() -> bool:
    return env.ENV.triton_interpret  # through the module: a test can set harts.env.ENV


def _fast_unavailable(op: str, device: torch.device, dtype: torch.dtype, requested: str = "auto") -> str | None:
    if device.type != "cuda" and not (requested == "fast" and op in _INTERPRETABLE and _interpreting()):
        return f"device is {device.type}, fast {op} kernels need CUDA"
    if dtype == torch.float64:
        return "float64 is served by the reference path only"
    if op in ("kda", "conv", "norm") and not has_fla():
        return "fla (fla-core) + triton not importable"
    if op == "attention":
        if attention_fast_impl() is None:
            return "neither flash_attn nor torch.nn.attention.varlen is available"
        if dtype not in (torch.bfloat16, torch.float16):
            return f"flash attention kernels need bf16/fp16, got {dtype}"
    if op in ("logprobs", "moe_gather_sum"):
        if not _HAS_TRITON:
            return "triton not importable"
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"the {op} kernel takes fp32/bf16/fp16, got {dtype}"
    if op == "moe_experts":
        if not hasattr(torch, "_grouped_mm"):
            return "torch._grouped_mm not available"
        if dtype != torch.bfloat16:
            return f"torch._grouped_mm path is bf16-only here, got {dtype}"
    return None


def log_once(key: tuple, msg: str, *args) -> None:
    """``log.info(msg, *args)`` the first time ``key`` is seen, and only in eager code: under torch.compile
    the choice is a trace-time constant, and reading the set there would guard the graph on it (a
    recompilation whenever another op logs)."""
    if not torch.compiler.is_compiling() and key not in _logged:
        _logged.add(key)
        log.info(msg, *args)


def reset_log() -> None:
    """Forget which choices were logged, so each is logged again when next made (a process that runs and
    compares several configurations, each reporting its own)."""
    _logged.clear()


def resolve(op: str, requested: str, device: torch.device, dtype: torch.dtype) -> str:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {OPS}")
    if requested not in ("auto", "reference", "fast"):
        raise ValueError(f"backend for {op}: {requested!r} (expected 'auto', 'reference' or 'fast')")
    why = None
    if requested == "reference":
        choice, why = "reference", "requested"
    else:
        bad = _fast_unavailable(op, device, dtype, requested)
        if requested == "fast":
            if bad:
                raise RuntimeError(f"fast backend for {op} requested but unavailable: {bad}")
            choice, why = "fast", "requested"
        else:
            choice, why = ("reference", bad) if bad else ("fast", f"auto on {device.type}/{dtype}")
    if choice == "fast" and op == "attention":
        choice_name = f"fast:{attention_fast_impl()}"
    else:
        choice_name = choice
    log_once((op, choice_name, why), "harts backend %s -> %s (%s)", op, choice_name, why)
    return choice
