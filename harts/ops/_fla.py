"""The one way HARTS imports fla (fla-core): every fla function, kernel and constant the library uses, by name,
behind a version check.

HARTS launches fla's kernels and calls its internal helpers (intra-chunk pieces, autotuned Triton kernels,
index builders) by module path and signature, which change between fla releases; the shipped autotune table
(``harts.ops.tuned``) also names fla's kernels and configs. So exactly one fla version is supported:
``REQUIRED_VERSION``. Importing this module checks it and raises a one-line ImportError naming the installed
and the required version and the fix. ``from harts.ops._fla import chunk_kda`` then imports only the fla
module that defines the name (``NAMES``), on first use, so a module that imports fla lazily stays lazy;
``module("fla.x.y")`` returns an fla module itself.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["REQUIRED_VERSION", "NAMES", "installed_version", "check_version", "module"]

REQUIRED_VERSION = "0.6.0"

# name here -> (fla module, name there). Names that fla defines twice get a prefix here.
NAMES: dict[str, tuple[str, str]] = {
    # KDA
    "chunk_kda": ("fla.ops.kda", "chunk_kda"),
    "chunk_kda_bwd_dAv": ("fla.ops.kda.chunk_bwd", "chunk_kda_bwd_dAv"),
    "chunk_kda_bwd_wy_dqkg_fused": ("fla.ops.kda.chunk_bwd", "chunk_kda_bwd_wy_dqkg_fused"),
    "chunk_kda_bwd_intra": ("fla.ops.kda.chunk_intra", "chunk_kda_bwd_intra"),
    "chunk_kda_fwd_intra": ("fla.ops.kda.chunk_intra", "chunk_kda_fwd_intra"),
    "kda_gate_bwd": ("fla.ops.kda.gate", "kda_gate_bwd"),
    "kda_gate_chunk_cumsum": ("fla.ops.kda.gate", "kda_gate_chunk_cumsum"),
    "kda_recompute_w_u_fwd": ("fla.ops.kda.wy_fast", "recompute_w_u_fwd"),
    "chunk_gla_fwd_kernel_o": ("fla.ops.gla.chunk", "chunk_gla_fwd_kernel_o"),
    # Gated DeltaNet
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "chunk_gated_delta_rule_fwd_intra": ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_intra"),
    "gdn_recompute_w_u_fwd": ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd"),
    "prepare_wy_repr_bwd": ("fla.ops.gated_delta_rule.wy_fast", "prepare_wy_repr_bwd"),
    "chunk_bwd_dv_local": ("fla.ops.common.chunk_o", "chunk_bwd_dv_local"),
    "chunk_fwd_kernel_o": ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"),
    # chunk helpers
    "chunk_local_cumsum": ("fla.ops.utils", "chunk_local_cumsum"),
    "prepare_chunk_indices": ("fla.ops.utils.index", "prepare_chunk_indices"),
    "prepare_chunk_offsets": ("fla.ops.utils.index", "prepare_chunk_offsets"),
    "RCP_LN2": ("fla.ops.utils.constant", "RCP_LN2"),
    # norms
    "layer_norm_gated_bwd_kernel": ("fla.modules.norm.fused_norm_gate", "layer_norm_gated_bwd_kernel"),
    "layer_norm_gated_bwd_kernel_row": ("fla.modules.norm.fused_norm_gate", "layer_norm_gated_bwd_kernel_row"),
    "layer_norm_gated_fwd_kernel": ("fla.modules.norm.fused_norm_gate", "layer_norm_gated_fwd_kernel"),
    "layer_norm_gated_fwd_kernel_row": ("fla.modules.norm.fused_norm_gate", "layer_norm_gated_fwd_kernel_row"),
    "l2norm_bwd_kernel": ("fla.modules.norm.l2norm", "l2norm_bwd_kernel"),
    "l2norm_bwd_kernel_row": ("fla.modules.norm.l2norm", "l2norm_bwd_kernel_row"),
    "l2norm_fwd_kernel": ("fla.modules.norm.l2norm", "l2norm_fwd_kernel"),
    "l2norm_fwd_kernel_row": ("fla.modules.norm.l2norm", "l2norm_fwd_kernel_row"),
    "layer_norm_bwd_kernel": ("fla.modules.norm.layernorm", "layer_norm_bwd_kernel"),
    "layer_norm_bwd_kernel_row": ("fla.modules.norm.layernorm", "layer_norm_bwd_kernel_row"),
    "layer_norm_fwd_kernel": ("fla.modules.norm.layernorm", "layer_norm_fwd_kernel"),
    "layer_norm_fwd_kernel_row": ("fla.modules.norm.layernorm", "layer_norm_fwd_kernel_row"),
    # short convolution
    "causal_conv1d": ("fla.modules.causal_conv1d", "causal_conv1d"),
    "causal_conv1d_fwd": ("fla.modules.causal_conv1d.ops", "causal_conv1d_fwd"),
    "causal_conv1d_bwd": ("fla.modules.causal_conv1d.ops", "causal_conv1d_bwd"),
    "causal_conv1d_fwd_kernel": ("fla.modules.causal_conv1d.ops", "causal_conv1d_fwd_kernel"),
    "causal_conv1d_bwd_kernel": ("fla.modules.causal_conv1d.ops", "causal_conv1d_bwd_kernel"),
    "compute_dh0_triton": ("fla.modules.causal_conv1d.ops", "compute_dh0_triton"),
    # fla.utils
    "autocast_custom_bwd": ("fla.utils", "autocast_custom_bwd"),
    "autocast_custom_fwd": ("fla.utils", "autocast_custom_fwd"),
    "input_guard": ("fla.utils", "input_guard"),
    "tensor_cache": ("fla.utils", "tensor_cache"),
    "check_shared_mem": ("fla.utils", "check_shared_mem"),
    "get_multiprocessor_count": ("fla.utils", "get_multiprocessor_count"),
    "IS_INTEL": ("fla.utils", "IS_INTEL"),
}


def installed_version() -> str | None:
    """The importable fla's version (``fla.__version__``, else fla-core's package metadata); None without fla."""
    try:
        import fla
    except ImportError:
        return None
    version = getattr(fla, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("fla-core")
        except PackageNotFoundError:
            return "unknown"
    return str(version)


_LOOK_UP = object()


def check_version(installed: Any = _LOOK_UP) -> None:
    """Raise a one-line ImportError unless fla ``REQUIRED_VERSION`` is installed (``installed``: the version
    to check, None for none; default ``installed_version()``)."""
    installed = installed_version() if installed is _LOOK_UP else installed
    if installed != REQUIRED_VERSION:
        have = "fla is not installed" if installed is None else f"fla {installed} is installed"
        raise ImportError(f"{have}; HARTS's fast kernels need fla-core=={REQUIRED_VERSION} (they call fla internals "
                          f"that change between releases): pip install fla-core=={REQUIRED_VERSION}")


check_version()


def module(name: str):
    """The fla module ``name`` (``fla.`` or ``fla.x.y``), imported after the version check."""
    if name != "fla" and not name.startswith("fla."):
        raise ValueError(f"harts.ops._fla.module({name!r}): not an fla module name")
    return importlib.import_module(name)


def __getattr__(name: str) -> Any:
    if name not in NAMES:
        raise AttributeError(f"harts.ops._fla has no fla name {name!r}; add it to harts.ops._fla.NAMES")
    mod, attr = NAMES[name]
    value = getattr(importlib.import_module(mod), attr)
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(NAMES))
