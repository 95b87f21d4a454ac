"""Every environment variable HARTS reads, read once, when this module is first imported.

The library reads its settings from ``ENV`` (an ``Environment``), never from ``os.environ`` at call time, so
a setting cannot change under a running process. The kernel variants (``HARTS_VIEW_ATTENTION``,
``HARTS_PACKED_ATTENTION``, ``HARTS_CONV``, ``HARTS_AUTOTUNE``) are only the process-wide defaults of
``harts.ops.kernel_choices()``; change them in code with ``harts.ops.set_kernel_choices`` or, for one block,
``harts.ops.use_kernel_choices``. docs/environment.md lists every variable with its default and effect.

Values are kept as given (an unknown kernel name is refused, naming the variable, by ``harts.ops.choices``
when the choices are first needed). Importing this module is cheap: it imports nothing but the standard
library.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["Environment", "ENV", "VARIABLES", "read", "cache_dirs", "keep_host_memory"]


def _flag(value: str | None) -> bool:
    """Unset, empty, ``0``, ``false`` and ``no`` (any case) are off; anything else is on."""
    return (value or "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Environment:
    """The HARTS settings of this process, as read from the environment."""

    view_attention: str = "cudnn_split"
    """``HARTS_VIEW_ATTENTION``: default kernel of the MLA views' attention (``harts.ops.attention.tree``):
    ``cudnn_split`` (cuDNN pieces merged by log-sum-exp) or ``varlen`` (one packed flash call)."""

    packed_attention: str = "cudnn"
    """``HARTS_PACKED_ATTENTION``: default kernel of packed self-attention (``harts.ops.attention.fast``):
    ``cudnn`` (cuDNN per sequence where it takes the shapes) or ``varlen`` (one packed varlen call)."""

    conv: str = "auto"
    """``HARTS_CONV``: default kernels of the short convolutions, trajectory-wise and on tree paths
    (``harts.ops.conv.fused``): ``harts`` (ours: the backward recomputes the pre-activation in registers; width
    4 only), ``fla`` (fla's causal_conv1d), or ``auto`` (``harts`` where it applies, else ``fla``, logged)."""

    swiglu: str = "harts"
    """``HARTS_SWIGLU``: default of the routed experts' weighted SwiGLU and down projection (``harts.ops.moe``):
    ``harts`` (``harts::moe_swiglu_down``, whose backward is one fused pass) or ``torch`` (torch ops; Inductor
    fuses them in compiled regions)."""

    autotune: str = "table"
    """``HARTS_AUTOTUNE``: default autotuning mode (``harts.ops.tuning``): ``table`` (the shipped autotune
    results where the GPU has a table) or ``full`` (benchmark every config of every new key)."""

    kernel_report: str | None = None
    """``HARTS_KERNEL_REPORT``: a JSONL file to which a training process appends the compile (and autotune)
    time of every autotuned kernel's first launch per key. Set by ``python -m harts.warmup`` for the
    training processes it starts."""

    autotune_record: str | None = None
    """``HARTS_AUTOTUNE_RECORD``: with ``HARTS_KERNEL_REPORT``, the autotune table rewritten after every new
    key (rank 0). Set by ``python -m harts.warmup --record PATH``."""

    debug: bool = False
    """``HARTS_DEBUG``: ``train.py`` prints full tracebacks from every rank instead of one error line
    (unset, empty, ``0``, ``false`` and ``no`` are off)."""

    host_memory: str = "keep"
    """``HARTS_HOST_MEMORY``: what ``keep_host_memory()`` (called by ``train.py`` and the speedup benchmark)
    does to glibc's malloc: ``keep`` (freed memory stays in the heap for the next pack) or ``system`` (glibc's
    defaults, untouched)."""

    pack_threads: str | None = None
    """``HARTS_PACK_THREADS``: worker threads of pack's pool (``harts.runtime.batch.pack_pool``), beside the
    thread that calls pack; unset: one per spare core, at most three; ``0``: pack runs on its caller's thread
    alone (e.g. many ranks per host with few cores each). Kept as given; ``pack`` refuses a value that is not
    a count >= 0, naming the variable."""

    triton_interpret: bool = False
    """``TRITON_INTERPRET`` (Triton's own switch) is ``1``: Triton kernels run in its CPU interpreter. HARTS's
    kernels then build a single small autotune config, and ``backend="fast"`` may run the Triton-only ops
    on CPU. Triton reads it when a kernel is defined, so set it before anything imports Triton."""


def read(environ: Mapping[str, str] | None = None) -> Environment:
    """The settings in ``environ`` (default ``os.environ``); unset variables take the defaults."""
    e = os.environ if environ is None else environ
    d = Environment()
    return Environment(
        view_attention=e.get("HARTS_VIEW_ATTENTION", d.view_attention),
        packed_attention=e.get("HARTS_PACKED_ATTENTION", d.packed_attention),
        conv=e.get("HARTS_CONV", d.conv),
        swiglu=e.get("HARTS_SWIGLU", d.swiglu),
        autotune=e.get("HARTS_AUTOTUNE", d.autotune),
        kernel_report=e.get("HARTS_KERNEL_REPORT") or None,
        autotune_record=e.get("HARTS_AUTOTUNE_RECORD") or None,
        debug=_flag(e.get("HARTS_DEBUG")),
        host_memory=e.get("HARTS_HOST_MEMORY", d.host_memory),
        pack_threads=e.get("HARTS_PACK_THREADS") or None,
        triton_interpret=e.get("TRITON_INTERPRET") == "1",
    )


ENV: Environment = read()
"""This process's settings, read at the first import of ``harts.env``."""

# The field each variable fills (docs and error messages name the variable).
VARIABLES = {"HARTS_VIEW_ATTENTION": "view_attention", "HARTS_PACKED_ATTENTION": "packed_attention",
             "HARTS_CONV": "conv", "HARTS_SWIGLU": "swiglu", "HARTS_AUTOTUNE": "autotune",
             "HARTS_KERNEL_REPORT": "kernel_report",
             "HARTS_AUTOTUNE_RECORD": "autotune_record", "HARTS_DEBUG": "debug",
             "HARTS_HOST_MEMORY": "host_memory", "HARTS_PACK_THREADS": "pack_threads",
             "TRITON_INTERPRET": "triton_interpret"}


def cache_dirs() -> dict[str, str]:
    """Default Triton's and inductor's kernel caches to ``~/.cache/harts/{triton,inductor}`` (persistent,
    unlike inductor's /tmp default; ``XDG_CACHE_HOME`` moves both); a ``TRITON_CACHE_DIR`` or
    ``TORCHINDUCTOR_CACHE_DIR`` already set wins. Those tools read the variables themselves, so this sets
    them in ``os.environ``, and it must run before Triton or inductor is imported (``train.py`` and
    ``python -m harts.warmup`` call it first thing). Returns ``{"triton": dir, "inductor": dir}``."""
    root = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "harts")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
    return {"triton": os.environ["TRITON_CACHE_DIR"], "inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"]}


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_host_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> str:
    """Let glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    ``pack`` builds each microbatch's layout from a few dozen numpy arrays and tensors of 1-30 MB, then frees
    them. Under glibc's defaults, blocks that size are mmapped (or the heap top is trimmed once more than
    twice the largest freed block is free), so every pack faults its pages in again, zero-filled, after the
    step that ran in between, on the host, while the GPU waits (``benchmarks.speedup`` reports pack's
    seconds per microbatch). With allocations up to ``mmap_threshold`` served from the heap and up to
    ``trim_threshold`` of free heap top kept, the pages stay mapped. This is process-wide: the trainer and
    the speedup benchmark call it once at start, before any data is packed; ``HARTS_HOST_MEMORY=system``
    leaves glibc's defaults as they are.

    Returns one line that says what was done (for the log), and changes nothing where the C library is not
    glibc.
    """
    import ctypes
    import platform

    if ENV.host_memory not in ("keep", "system"):
        raise ValueError(f"HARTS_HOST_MEMORY={ENV.host_memory!r}: expected 'keep' or 'system'")
    if ENV.host_memory == "system":
        return "host memory: glibc malloc defaults (HARTS_HOST_MEMORY=system)"
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return f"host memory: malloc defaults (the C library is {lib or 'unknown'}, not glibc)"
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    for name, param, value in (("M_MMAP_THRESHOLD", _M_MMAP_THRESHOLD, mmap_threshold),
                               ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, trim_threshold)):
        if mallopt(param, value) != 1:
            raise ValueError(f"glibc {version} refused mallopt({name}, {value})")
    return (f"host memory: glibc {version} malloc keeps freed memory (blocks up to {mmap_threshold >> 20} MiB "
            f"from the heap, up to {trim_threshold >> 20} MiB of free heap top kept)")
