"""Parameter initialisation by qualified name, shared by the model families.

Every parameter draws from its own generator, seeded by the model seed and the parameter's qualified name
(``param_seed``), so its initial value depends on neither the order in which modules are visited nor on
which rank (or shard) initialises it. A family supplies ``value(module, attr, shape, cfg, generator,
device)``, the whole float32 initial tensor of one parameter or buffer (Ling-3.0's and Qwen3.5-MoE's
``initial_value`` in their ``blocks`` modules)."""
from __future__ import annotations

import hashlib

import torch
from torch import nn

__all__ = ["param_seed", "init_targets", "initial_tensors", "init_module_weights"]


def param_seed(seed: int, name: str) -> int:
    """One parameter's RNG seed, from the model seed and the parameter's qualified name.

    Every parameter draws from its own generator, so its initial value depends on neither the order in
    which modules are visited nor on which rank (or shard) initialises it: a model built on the meta
    device and initialised shard by shard on each rank (harts.train.model.init_sharded) equals the one
    built whole on one device, and replicated tensors agree across ranks."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes < 2**63


def init_targets(model: nn.Module):
    """(qualified name, owning module, attribute, tensor) of every parameter and buffer to initialise."""
    for mname, m in model.named_modules():
        for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is not None:
                yield (f"{mname}.{attr}" if mname else attr), m, attr, t


def initial_tensors(model: nn.Module, cfg, seed: int | None, value):
    """(tensor, its whole initial value) for every parameter and buffer of ``model``: with a seed, each
    drawn from its own generator (``param_seed``) on the tensor's device, without one from torch's global
    generator. Names are qualified from ``model``, so pass the root model to reproduce a whole model's init.
    ``value``: the model family's ``initial_value``."""
    for name, m, attr, t in init_targets(model):
        gen = None if seed is None else torch.Generator(device=t.device).manual_seed(param_seed(seed, name))
        yield t, value(m, attr, t.shape, cfg, gen, t.device)


@torch.no_grad()
def init_module_weights(model: nn.Module, cfg, seed: int | None, value) -> None:
    """Initialise every parameter and buffer of ``model`` in place (``initial_tensors``)."""
    for t, full in initial_tensors(model, cfg, seed, value):
        t.copy_(full)
