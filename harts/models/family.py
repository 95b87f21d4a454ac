"""Model families: what the trainer, the benchmarks and library users need to know about a model family in one
place (the idea of torchtitan's TrainSpec / ModelSpec).

A family names its config class, its causal-LM class, its presets, the HF checkpoint I/O of its checkpoint
module (torchtitan state-dict adapter, ``load_pretrained``, ``save_pretrained``) and the training features the
trainer implements for it (``capabilities``). A preset name belongs to the family whose ``preset_prefix`` it
starts with: ``qwen3.5-*`` presets are Qwen3.5-MoE, ``ling3-*`` presets Ling-3.0.

    >>> from harts.models.family import family_of, model_config, model_class
    >>> cfg = model_config("qwen3.5-debug", backend="reference")
    >>> family_of(cfg).name, model_class(cfg).__name__
    ('qwen3.5', 'Qwen35ForCausalLM')

Capabilities (what harts.train runs today):

- ``tp``: tensor / sequence parallelism (``harts.train.parallelize.apply_tp``, the family's plan in
  ``harts.train.tensor_parallel``)
- ``ep``: expert parallelism (``apply_ep``); ``cp``: context parallelism; ``pp``: pipeline stages
  (``harts.train.pipeline.prune_to_stage``)
- ``compile``: ``harts.models.ling.compile_model``; ``selective_ac``: selective activation checkpointing
- ``expert_bias``: aux-loss-free expert-bias updates (``rl.expert_bias_rate``; Qwen3.5 routes by softmax
  without a bias)
- ``generate``: incremental decoding for online RL (``harts.models.common.generate``)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from harts.models.ling.config import LingConfig
from harts.models.ling.model import LingForCausalLM
from harts.models.qwen35.config import Qwen35Config
from harts.models.qwen35.model import Qwen35ForCausalLM

__all__ = ["ModelFamily", "FAMILIES", "CAPABILITIES", "family_of", "model_config", "model_class", "all_presets"]

CAPABILITIES = frozenset({"tp", "ep", "cp", "pp", "compile", "selective_ac", "expert_bias", "generate"})


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family. ``config_class.preset(name, **overrides)`` builds a preset's config and
    ``model_class(config)`` the model; the checkpoint functions read and write the family's HF layout:
    ``state_dict_adapter(config, hf_assets_path=None)`` (torchtitan ``StateDictAdapter``),
    ``load_pretrained(path, device=..., dtype=..., **config_overrides)`` and ``save_pretrained(model, path)``."""

    name: str
    title: str
    config_class: type
    model_class: type
    presets: tuple[str, ...]
    preset_prefix: str
    hf_model_types: tuple[str, ...]
    state_dict_adapter: Callable[..., Any]
    load_pretrained: Callable[..., Any]
    save_pretrained: Callable[..., Any]
    capabilities: frozenset[str]

    def __post_init__(self):
        unknown = self.capabilities - CAPABILITIES
        if unknown:
            raise ValueError(f"model family {self.name!r}: unknown capabilities {sorted(unknown)}; "
                             f"known: {sorted(CAPABILITIES)}")
        stray = [p for p in self.presets if not self.owns(p)]
        if stray:
            raise ValueError(f"model family {self.name!r}: presets {stray} do not start with {self.preset_prefix!r}")

    def owns(self, preset: str) -> bool:
        """Whether a preset name belongs to this family (its prefix rule; the name need not exist)."""
        return preset.startswith(self.preset_prefix)

    def supports(self, capability: str) -> bool:
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}; known: {sorted(CAPABILITIES)}")
        return capability in self.capabilities

    def config(self, preset: str, **overrides):
        """The config of one of this family's presets, with field overrides."""
        if preset not in self.presets:
            raise ValueError(_unknown(preset))
        return self.config_class.preset(preset, **overrides)


# HF checkpoint I/O, imported when used (the checkpoint modules import torchtitan and safetensors)
def _lazy(module: str, name: str):
    """``module.name``, imported at the first call."""
    def call(*args, **kwargs):
        import importlib

        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


_LING_CKPT, _QWEN35_CKPT = "harts.models.ling.checkpoint", "harts.models.qwen35.checkpoint"
_ling_adapter, _ling_load, _ling_save = (_lazy(_LING_CKPT, n) for n in
                                         ("LingStateDictAdapter", "load_pretrained", "save_pretrained"))
_qwen35_adapter, _qwen35_load, _qwen35_save = (_lazy(_QWEN35_CKPT, n) for n in
                                               ("Qwen35StateDictAdapter", "load_pretrained", "save_pretrained"))


LING3 = ModelFamily(
    name="ling3", title="Ling-3.0", config_class=LingConfig, model_class=LingForCausalLM,
    presets=("ling3-tiny", "ling3-small", "ling3-tiny-debug"), preset_prefix="ling3",
    hf_model_types=("bailing_hybrid",),
    state_dict_adapter=_ling_adapter, load_pretrained=_ling_load, save_pretrained=_ling_save,
    capabilities=CAPABILITIES,
)

QWEN35 = ModelFamily(
    name="qwen3.5", title="Qwen3.5-MoE", config_class=Qwen35Config, model_class=Qwen35ForCausalLM,
    presets=("qwen3.5-35b-a3b", "qwen3.5-8l", "qwen3.5-debug"), preset_prefix="qwen3.5",
    hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
    state_dict_adapter=_qwen35_adapter, load_pretrained=_qwen35_load, save_pretrained=_qwen35_save,
    # no expert bias (the trainer refuses rl.expert_bias_rate != 0)
    capabilities=CAPABILITIES - {"expert_bias"},
)

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LING3, QWEN35)}


def all_presets() -> tuple[str, ...]:
    """Every preset of every family, in registry order."""
    return tuple(p for f in FAMILIES.values() for p in f.presets)


def _unknown(preset) -> str:
    known = "; ".join(f"{f.title} ({f.name}): {', '.join(f.presets)}" for f in FAMILIES.values())
    return f"unknown model preset {preset!r}; known presets: {known}"


def family_of(preset_or_config) -> ModelFamily:
    """The family of a preset name (by its prefix), a config, or a model (its ``config``)."""
    if isinstance(preset_or_config, str):
        for f in FAMILIES.values():
            if f.owns(preset_or_config):
                return f
        raise ValueError(_unknown(preset_or_config))
    cfg = getattr(preset_or_config, "config", preset_or_config)
    for f in FAMILIES.values():
        if isinstance(cfg, f.config_class):
            return f
    raise TypeError(f"no model family for a {type(preset_or_config).__name__}; expected a preset name, "
                    f"a config ({', '.join(f.config_class.__name__ for f in FAMILIES.values())}) or a model")


def model_config(preset, **overrides):
    """The config of a preset name with field overrides, or ``preset`` itself when it already is a family's
    config (then ``overrides`` must be empty)."""
    if not isinstance(preset, str):
        if not any(isinstance(preset, f.config_class) for f in FAMILIES.values()):
            raise TypeError(f"model preset must be a preset name or a config "
                            f"({', '.join(f.config_class.__name__ for f in FAMILIES.values())}), "
                            f"got {type(preset).__name__}")
        if overrides:
            raise TypeError(f"model_config: overrides {sorted(overrides)} given with a ready "
                            f"{type(preset).__name__}; apply them to the config instead")
        return preset
    return family_of(preset).config(preset, **overrides)


def model_class(cfg) -> type:
    """The causal-LM class of a config (``LingForCausalLM`` or ``Qwen35ForCausalLM``)."""
    for f in FAMILIES.values():
        if isinstance(cfg, f.config_class):
            return f.model_class
    raise TypeError(f"no model class for a {type(cfg).__name__}; expected one of "
                    f"{', '.join(f.config_class.__name__ for f in FAMILIES.values())}")
