"""Kernel variants, chosen by configuration: ``harts.ops.kernel_choices()`` and the functions that change it.

Some ops have two valid fast kernels for the same math, which round differently; which one runs is a
process-wide choice, not an argument of every call:

- ``view_attention``: the MLA views' attention (``harts.ops.attention.tree.view_attention_impl``):
  ``cudnn_split`` (default: each view as cuDNN pieces merged by log-sum-exp, long runs of shared ancestor
  rows read in place) or ``varlen`` (one packed bottom-right causal flash call on gathered keys);
- ``packed_attention``: packed self-attention, the trajectory-wise path
  (``harts.ops.attention.fast.packed_self_attention_impl``): ``cudnn`` (default: cuDNN per sequence where
  it takes the shapes) or ``varlen`` (one packed varlen call);
- ``conv``: the short convolutions, trajectory-wise (``harts.ops.conv``) and on tree paths
  (``harts.ops.tree_conv``) alike: ``harts`` (``harts.ops.conv.fused``: each row's pre-activation recomputed
  once in fp32 registers in the backward instead of stored; width 4 only), ``fla`` (fla's causal_conv1d), or
  ``auto`` (default: ``harts`` where it takes the convolution, else ``fla``, logged);
- ``swiglu``: the routed experts' weighted SwiGLU and down projection on the stacked fast path
  (``harts.ops.moe.experts``): ``harts`` (default: the op ``harts::moe_swiglu_down``, the backward as one fused pass,
  ``harts.kernels.moe_swiglu``) or ``torch`` (torch ops, which Inductor fuses in the compiled regions);
- ``autotune``: ``table`` (default: the shipped autotune results, ``harts.ops.tuning``) or ``full``
  (benchmark every config of every new key). Read when a fast entry point first restricts the autotuners
  of newly imported kernel modules; kernels already restricted to the table keep it.

The defaults come from ``HARTS_VIEW_ATTENTION``, ``HARTS_PACKED_ATTENTION``, ``HARTS_CONV``, ``HARTS_SWIGLU`` and
``HARTS_AUTOTUNE``
(read once, by ``harts.env``). Change them in code::

    import harts.ops
    harts.ops.set_kernel_choices(packed_attention="varlen")       # from now on
    with harts.ops.use_kernel_choices(view_attention="varlen"):   # inside the block only
        ...

The choice is one module-level object, shared by every thread of the process, and the ops read it on each
call (an attribute lookup). The fast path's log says which kernel ran and why, once per (kernel, reason).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

__all__ = ["KernelChoices", "kernel_choices", "set_kernel_choices", "use_kernel_choices", "ALLOWED"]

ALLOWED: dict[str, tuple[str, ...]] = {
    "view_attention": ("cudnn_split", "varlen"),
    "packed_attention": ("cudnn", "varlen"),
    "conv": ("auto", "fla", "harts"),
    "swiglu": ("torch", "harts"),
    "autotune": ("table", "full"),
}
_VARIABLE = {"view_attention": "HARTS_VIEW_ATTENTION", "packed_attention": "HARTS_PACKED_ATTENTION",
             "conv": "HARTS_CONV", "swiglu": "HARTS_SWIGLU",
             "autotune": "HARTS_AUTOTUNE"}


@dataclass(frozen=True)
class KernelChoices:
    """Which kernel variant each op with several runs (see ``harts.ops.choices``). Invalid values raise a
    ValueError naming the value and the allowed ones."""

    view_attention: str = "cudnn_split"
    packed_attention: str = "cudnn"
    autotune: str = "table"
    conv: str = "auto"
    swiglu: str = "harts"

    def __post_init__(self):
        for name, allowed in ALLOWED.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"kernel choice {name}={value!r}: expected one of {allowed}")


_current: KernelChoices | None = None  # built from harts.env on first use


def _from_environment() -> KernelChoices:
    from harts.env import ENV

    values = {name: getattr(ENV, name) for name in ALLOWED}
    for name, value in values.items():
        if value not in ALLOWED[name]:
            raise ValueError(f"{_VARIABLE[name]}={value!r}: expected one of {ALLOWED[name]} (unset it to get "
                             f"{getattr(KernelChoices, name)!r})")
    return KernelChoices(**values)


def kernel_choices() -> KernelChoices:
    """The current choices: the environment's defaults (``harts.env``) until changed in code."""
    c = _current
    if c is None:
        c = _set(_from_environment())
    return c


def _set(c: KernelChoices) -> KernelChoices:
    global _current
    _current = c
    return c


def set_kernel_choices(choices: KernelChoices | None = None, /, **changes: str) -> KernelChoices:
    """Change the current choices for the whole process and return the new ones: the named fields of the
    current choices (``set_kernel_choices(packed_attention="varlen")``), or all of them
    (``set_kernel_choices(KernelChoices())``, the library defaults, whatever the environment says)."""
    unknown = sorted(set(changes) - set(ALLOWED))
    if unknown:
        raise TypeError(f"unknown kernel choice(s) {unknown}: known: {sorted(ALLOWED)}")
    base = kernel_choices() if choices is None else choices
    if not isinstance(base, KernelChoices):
        raise TypeError(f"set_kernel_choices takes a KernelChoices, got {type(base).__name__}")
    return _set(dataclasses.replace(base, **changes) if changes else base)


@contextlib.contextmanager
def use_kernel_choices(choices: KernelChoices | None = None, /, **changes: str) -> Iterator[KernelChoices]:
    """``set_kernel_choices(...)`` inside a ``with`` block; on leaving it (also by an exception) the choices
    from before the block are restored, including over any change made inside it."""
    before = kernel_choices()
    new = set_kernel_choices(choices, **changes)
    try:
        yield new
    finally:
        _set(before)
