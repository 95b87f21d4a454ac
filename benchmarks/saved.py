"""What autograd keeps for backward, per decoder layer: the activation memory an activation checkpointing policy
trades for recomputation.

``SavedCensus(layers)`` is a context manager around one forward: a ``saved_tensors_hooks`` pack hook records every
tensor saved for backward (by ``ctx.save_for_backward`` of an autograd Function, fla's and ours included, of the
compiled regions' AOTAutograd functions, and of eager ops), attributed to the decoder layer whose forward is
running (a forward pre-hook / hook on each layer; ``None``: outside every layer, e.g. the LM head). Each storage
counts once (views of one tensor saved by several ops share it), at its full size; parameters and buffers are not
counted (they are held anyway). Why a census of saved tensors rather than the allocator's peak: the peak says how
much, the census says what (layer kind, shape, dtype), which is what a policy change acts on.

What it cannot see: what ``torch.utils.checkpoint`` keeps (its inputs, and under selective checkpointing the
outputs its policy saves), which its own saved-tensor hooks take before these: under ``full`` and eager
``selective`` checkpointing the checkpointed layers or regions show nothing. Compiled ``selective`` (the regions'
partitioner saves through AOTAutograd) and ``none`` are counted whole.

Legend: none (the module moves no tensors of its own).
"""
from __future__ import annotations

import collections

import torch
from torch import nn


class SavedCensus:
    """Saved-for-backward tensors of one forward, by layer (module docstring). ``layers``: {key: module}, the key
    a layer's label (e.g. its index); after the ``with`` block, ``entries`` holds (layer key or None, shape, dtype,
    bytes) per storage and ``by_layer()`` / ``by_shape()`` summarise them."""

    def __init__(self, layers: dict, model: nn.Module | None = None):
        self.layers = dict(layers)
        held = list(model.parameters()) + list(model.buffers()) if model is not None else []
        self._held = {t.untyped_storage().data_ptr() for t in held if t.device.type != "meta"}
        self._seen: set = set()
        self._stack: list = []
        self._handles: list = []
        self._hooks = None
        self.entries: list[tuple] = []

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and not isinstance(t, nn.Parameter):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage of their own
                storage = None
            if storage is not None:
                key = (storage.data_ptr(), t.device)
                if storage.data_ptr() not in self._held and key not in self._seen:
                    self._seen.add(key)
                    base = t if t._base is None else t._base  # a view is reported as the tensor it views
                    self.entries.append((self._stack[-1] if self._stack else None, tuple(base.shape), t.dtype,
                                         storage.nbytes()))
        return t

    def _enter_layer(self, key):
        def hook(module, args):  # returns None: the layer's inputs stay as they are
            self._stack.append(key)
        return hook

    def _leave_layer(self, module, args, output):  # returns None: the layer's output stays as it is
        self._stack.pop()

    def __enter__(self):
        for key, layer in self.layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer(key)))
            self._handles.append(layer.register_forward_hook(self._leave_layer, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    @property
    def total_bytes(self) -> int:
        return sum(e[3] for e in self.entries)

    def by_layer(self) -> dict:
        """{layer key or None: saved bytes}."""
        out: dict = collections.defaultdict(int)
        for key, _, _, nbytes in self.entries:
            out[key] += nbytes
        return dict(out)

    def by_shape(self, group=lambda key: key) -> list[tuple]:
        """(group of the layer key, shape, dtype, count, bytes) per distinct saved tensor kind, largest first;
        ``group`` maps a layer key to its group (e.g. the layer's kind), so equal layers add up."""
        out: dict = collections.defaultdict(lambda: [0, 0])
        for key, shape, dtype, nbytes in self.entries:
            acc = out[group(key), shape, str(dtype).removeprefix("torch.")]
            acc[0] += 1
            acc[1] += nbytes
        return sorted(((g, s, d, c, b) for (g, s, d), (c, b) in out.items()), key=lambda r: -r[4])
