"""The decoder stack both families share: the forward over packed trajectories or a compact batch (input
checks, the embedding or a pipeline stage's input rows), the layer loop under the activation checkpointing
policy, and the final norm; and ``Packed``, the batch description of packed trajectories.

Legend: T packed tokens, D hidden, N sequences (trajectories).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["DecoderStack", "Packed", "AC_POLICIES"]

AC_POLICIES = ("none", "selective", "full")

@dataclass(frozen=True, eq=False)
class Packed:
    """Packed trajectories as a batch description: every sequence its own varlen segment (reset at the
    ``cu_seqlens`` boundaries), positions explicit, no prefix sharing and no context parallelism. A
    trajectory-wise ``harts.CompactBatch`` (``prefix_sharing=False``) reads the same way."""

    position_ids: torch.Tensor  # [T] long
    cu_seqlens: torch.Tensor  # [N+1] long
    max_seqlen: int | None = None  # optional: avoids a host sync in the fast attention path
    # optional host copy of cu_seqlens: the fast kernels plan their chunks and per-sequence calls from it
    # instead of reading the device tensor (a host sync per call, i.e. several per layer)
    cu_seqlens_cpu: torch.Tensor | None = None
    prefix_sharing = False
    cp = None

    @staticmethod
    def local_rows(t: torch.Tensor) -> torch.Tensor:
        return t


def _check_packed(input_ids_T, position_ids_T, cu_seqlens, device: torch.device | None = None):
    """Shapes, dtypes and devices of packed inputs (no device read); ``device``: the model's."""
    for name, t in (("input_ids", input_ids_T), ("position_ids", position_ids_T), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the model is on {device}: move the inputs with "
                             f".to({str(device)!r})")
    if input_ids_T.dim() != 1:
        raise ValueError(f"input_ids must be a packed 1-D stream [T], got shape {tuple(input_ids_T.shape)}")
    if position_ids_T.shape != input_ids_T.shape:
        raise ValueError(f"position_ids {tuple(position_ids_T.shape)} must match input_ids {tuple(input_ids_T.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32/int64, got {cu_seqlens.dtype}")


def _check_cu_seqlens(cu_cpu: torch.Tensor, T: int) -> None:
    """Sequence offsets on their host copy (made once per forward anyway): 0, non-decreasing, ending at T."""
    if torch.compiler.is_compiling():
        return
    first, last = int(cu_cpu[0]), int(cu_cpu[-1])
    if first != 0 or last != T:
        raise ValueError(f"cu_seqlens must run from 0 to T = len(input_ids) = {T}, got {first} .. {last}: it holds "
                         "the sequences' start offsets followed by the total token count")
    if cu_cpu.numel() > 2 and bool((cu_cpu.diff() < 0).any()):
        i = int((cu_cpu.diff() < 0).nonzero()[0, 0])
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}] = {int(cu_cpu[i])} > "
                         f"cu_seqlens[{i + 1}] = {int(cu_cpu[i + 1])}")


def _packed(position_ids_T, cu_seqlens, max_seqlen) -> Packed:
    """The batch description of packed inputs, made once per forward: ``cu_seqlens`` as one int64 tensor (the
    kernels convert an int32 one per call otherwise, a new tensor each time, which defeats fla's per-tensor caches
    of its chunk plans: a host sync per call) and its host copy (read by the fast kernels instead of the device
    tensor: one sync here instead of several per layer)."""
    cu = cu_seqlens.long()
    cu_cpu = cu.cpu()
    if max_seqlen is None and cu_cpu.numel() > 1:
        max_seqlen = int(cu_cpu.diff().max())
    return Packed(position_ids_T, cu, max_seqlen, cu_cpu)


def _check_token_ids(ids_T: torch.Tensor, vocab_size: int, cu_seqlens=None, where: str = "input_ids",
                     unit: str = "position") -> None:
    """Range-check token ids before the embedding: one min/max reduction and one host read per forward
    (the embedding's own error, "index out of range in self", names neither the id nor its place)."""
    if ids_T.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where} must be int32/int64 token ids, got {ids_T.dtype}")
    if ids_T.numel() == 0 or torch.compiler.is_compiling():
        return
    lo, hi = torch.stack(torch.aminmax(ids_T)).tolist()
    if lo >= 0 and hi < vocab_size:
        return
    bad = ((ids_T < 0) | (ids_T >= vocab_size)).nonzero()[0, 0].item()
    place = f"{unit} {bad}"
    if cu_seqlens is not None:
        n = int(torch.searchsorted(cu_seqlens.cpu(), torch.tensor(bad, dtype=cu_seqlens.dtype), right=True)) - 1
        place += f" (sequence {n}, offset {bad - int(cu_seqlens[n])})"
    raise ValueError(f"{where}: token id {int(ids_T[bad])} at {place} is out of range for "
                     f"vocab_size={vocab_size} (valid ids are 0..{vocab_size - 1})")


class DecoderStack(nn.Module):
    """What a decoder stack does above its layers, shared by LingModel and Qwen3.5's stack: the forward over
    packed trajectories or a CompactBatch (input checks, the embedding or a pipeline stage's input rows), the
    layer loop under the activation checkpointing policy, and the final norm. A subclass calls
    ``super().__init__(cfg)`` and builds its embedding (attribute ``embedding_attr``), ``layers`` and ``norm``."""

    embedding_attr: str  # the token embedding's attribute (None on later pipeline stages)

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # activation checkpointing policy, "none" until harts.train.parallelize.apply_ac sets it from outside;
        # early stop ends a recomputation once the saved tensors are back, which layers with collectives must not do
        self.checkpoint_policy, self.checkpoint_early_stop = "none", True

    @property
    def checkpoint_policy(self) -> str:
        """One of ``AC_POLICIES`` (module docstring); read at every forward."""
        return self._checkpoint_policy

    @checkpoint_policy.setter
    def checkpoint_policy(self, policy: str) -> None:
        if policy not in AC_POLICIES:
            raise ValueError(f"checkpoint_policy = {policy!r}; expected one of {AC_POLICIES}")
        self._checkpoint_policy = policy

    @property
    def checkpoint_layers(self) -> bool:
        """Whether every layer is recomputed whole (``checkpoint_policy == "full"``); setting True / False
        selects "full" / "none"."""
        return self._checkpoint_policy == "full"

    @checkpoint_layers.setter
    def checkpoint_layers(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"checkpoint_layers must be a bool, got {on!r} (set checkpoint_policy to choose "
                            f"one of {AC_POLICIES})")
        self._checkpoint_policy = "full" if on else "none"

    def forward(self, input_ids_T=None, position_ids_T=None, cu_seqlens=None, token_weight_T=None, max_seqlen=None,
                *, layout=None, router: tuple | None = None, hidden_PD: torch.Tensor | None = None):
        """Packed trajectories (input_ids, position_ids, cu_seqlens), or a ``layout``: a
        ``harts.CompactBatch``, whose rows (its own share under context parallelism) and multiplicities
        replace the packed inputs. ``router``: see ``MoE.forward``. ``hidden_PD``: the input hidden
        states of a pipeline stage without embeddings. ``forward(batch)`` is ``forward(layout=batch)``."""
        if layout is None and input_ids_T is not None and not isinstance(input_ids_T, torch.Tensor):
            layout, input_ids_T = input_ids_T, None
        param = next(self.parameters(), None)
        device = None if param is None else param.device
        if layout is not None:
            from harts.runtime.compact import check_batch

            check_batch(layout, self.cfg, device)
            batch, input_ids_T = layout, layout.local_rows(layout.input_ids)
            token_weight_T = layout.local_rows(layout.multiplicity)
            checked = layout.vocab_size is not None and layout.vocab_size <= self.cfg.vocab_size  # by pack
        else:
            if input_ids_T is None or position_ids_T is None or cu_seqlens is None:
                raise TypeError("forward needs (input_ids_T, position_ids_T, cu_seqlens) or layout=CompactBatch")
            _check_packed(input_ids_T, position_ids_T, cu_seqlens, device)
            batch, checked = _packed(position_ids_T, cu_seqlens, max_seqlen), False
            _check_cu_seqlens(batch.cu_seqlens_cpu, input_ids_T.shape[0])
        embedding = getattr(self, self.embedding_attr)
        if embedding is not None:
            if not checked and batch.prefix_sharing:
                _check_token_ids(input_ids_T, self.cfg.vocab_size, where="CompactBatch.input_ids", unit="physical row")
            elif not checked:
                _check_token_ids(input_ids_T, self.cfg.vocab_size, batch.cu_seqlens)
            h_TD = embedding(input_ids_T)
        elif hidden_PD is None:
            raise ValueError("this pipeline stage has no embeddings: pass the previous stage's hidden_PD")
        elif device is not None and hidden_PD.device != device:
            raise ValueError(f"hidden_PD is on {hidden_PD.device} but the model is on {device}: move it with "
                             f".to({str(device)!r})")
        else:
            h_TD = hidden_PD
        return self.run_layers(h_TD, batch, token_weight_T, router)

    def run_layers(self, h_TD: torch.Tensor, batch, token_weight_T: torch.Tensor | None, router):
        """The decoder layers under the checkpoint policy, then the final norm (if this stage has it)."""
        if token_weight_T is not None:
            token_weight_T = token_weight_T.to(torch.promote_types(h_TD.dtype, torch.float32))
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        policy = self._checkpoint_policy if torch.is_grad_enabled() else "none"
        # Under HARTS the plan is fixed: recomputation reruns the same views, nothing is replanned.
        with (torch.utils.checkpoint.set_checkpoint_early_stop(self.checkpoint_early_stop) if policy != "none"
              else nullcontext()):
            for layer in layers:
                if policy == "full":
                    h_TD = checkpoint(layer, h_TD, batch, token_weight_T, router, use_reentrant=False)
                elif policy == "selective":  # through the module call, so FSDP2's per-layer hooks run
                    h_TD = layer(h_TD, batch, token_weight_T, router, selective=True)
                else:
                    h_TD = layer(h_TD, batch, token_weight_T, router)
        return h_TD if self.norm is None else self.norm(h_TD)
