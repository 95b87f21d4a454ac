"""HARTS: train hybrid-attention MoE language models on rollout trees, computing every shared prefix once.

Light imports only: ``harts.data`` and ``harts.planning`` need numpy alone; torch-facing names
(``harts.pack``, ``harts.CompactBatch``) are resolved lazily so planners can run in data-loader workers.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "pack": ("harts.runtime", "pack"),
    "CompactBatch": ("harts.runtime", "CompactBatch"),
    "pack_padded": ("harts.runtime", "pack_padded"),
    "unpack_padded": ("harts.runtime", "unpack_padded"),
    "PaddedLayout": ("harts.runtime", "PaddedLayout"),
}


def _register_source_kernels() -> None:
    """Make ``harts.kernels`` importable from a plain source checkout (PYTHONPATH=repo, no install).

    An install maps the top-level ``kernels/`` folder to ``harts.kernels`` (setup.py); without one,
    this finder, placed last on sys.meta_path so an installed mapping always wins, does the same.
    """
    import importlib.abc
    import importlib.util
    import os
    import sys

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    init = os.path.join(root, "__init__.py")
    if not os.path.isfile(init):
        return

    class _SourceKernelsFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != "harts.kernels":
                return None
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[root])

    if not any(type(f).__name__ == "_SourceKernelsFinder" for f in sys.meta_path):
        sys.meta_path.append(_SourceKernelsFinder())


_register_source_kernels()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'harts' has no attribute {name!r}")
