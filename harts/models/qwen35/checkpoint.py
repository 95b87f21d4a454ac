"""HF checkpoint I/O for Qwen3.5-MoE: config.json + safetensors shards + model.safetensors.index.json.

Our state dict uses transformers' ``Qwen3_5MoeForCausalLM`` names (routed experts stacked as
``mlp.experts.gate_up_proj`` [E, 2F, D] and ``mlp.experts.down_proj`` [E, D, F]), so saving writes it as it
is and transformers loads the folder. Loading also reads two other layouts, mapped by one rule each:

- per-expert keys ``mlp.experts.{e}.{gate,up,down}_proj.weight`` are stacked (gate rows before up rows);
- the released multimodal folders' ``model.language_model.`` prefix becomes ``model.``; their vision tower
  (``model.visual.``) and multi-token-prediction head (``mtp.``) are not part of this model and are refused
  unless dropped explicitly (``drop_vision``, ``drop_mtp``).

The whole key set is checked first; one error lists every missing key, unexpected key and shape mismatch.
Tensors keep their stored dtype (a save/load round trip is bit-exact) unless ``dtype`` is given.
"""
from __future__ import annotations

import logging
import os
import re

import torch
from torchtitan.models.utils import MoEStateDictAdapter

from harts.models.ling.checkpoint import (
    CheckpointError,
    _report,
    adopt_dtypes,
    hf_checkpoint_shapes,
    read_hf_config,
    read_hf_tensors,
    stack_layer_experts,
    unstack_layer_experts,
    write_hf_folder,
)
from harts.models.qwen35.config import Qwen35Config
from harts.models.qwen35.model import Qwen35ForCausalLM

__all__ = ["Qwen35StateDictAdapter", "to_hf_state_dict", "from_hf_names", "load_hf_state_dict", "save_pretrained",
           "load_pretrained", "CheckpointError"]

log = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_TEXT_PREFIX = "model.language_model."


class Qwen35StateDictAdapter(MoEStateDictAdapter):
    """Qwen3.5-MoE <-> its HF layouts, as a torchtitan state-dict adapter (the object torchtitan's
    ``CheckpointManager`` loads and saves HF safetensors through, with DCP).

    ``to_hf`` writes transformers' layout (our names, stacked experts) unless the folder at ``hf_assets_path``
    is a released one: then the keys get the ``model.language_model.`` prefix and per-expert
    ``{gate,up,down}_proj`` tensors, a sharded DTensor split into its own rank's experts without gathering
    (torchtitan's ``MoEStateDictAdapter``), so DCP reads exactly the keys the folder has. ``from_hf`` takes
    either layout (module docstring) and drops vision / MTP tensors only when asked (else refuses them)."""

    def __init__(self, config: Qwen35Config, hf_assets_path: str | os.PathLike | None = None, *,
                 drop_vision: bool = False, drop_mtp: bool = False):
        super().__init__(config, str(hf_assets_path) if hf_assets_path else None)
        self.config, self.drop_vision, self.drop_mtp = config, drop_vision, drop_mtp
        keys = list(hf_checkpoint_shapes(hf_assets_path)) if hf_assets_path else []
        self.prefix = _TEXT_PREFIX if any(k.startswith(_TEXT_PREFIX) for k in keys) else "model."
        self.per_expert = any(_PER_EXPERT.match("model." + k.removeprefix(self.prefix)) for k in keys)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state_dict.items():
            m = _STACKED.match(name)
            if not (self.per_expert and m):
                out[self._hf_name(name)] = t
                continue
            layer, proj = m.groups()
            out.update(unstack_layer_experts(self, layer, proj, t,
                                             self._hf_name(f"model.layers.{{}}.mlp.experts.{{}}.{proj}"),
                                             lambda w: w.chunk(2, dim=0)))  # [2F, D]: gate rows, up rows
        return out

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], where: str = "<dict>") -> dict[str, torch.Tensor]:
        out, experts, dropped = {}, {}, {"vision": [], "mtp": []}
        for k, v in hf_state_dict.items():
            if k.startswith(_TEXT_PREFIX):
                k = "model." + k.removeprefix(_TEXT_PREFIX)
            if k.startswith(("model.visual.", "visual.")):
                dropped["vision"].append(k)
            elif k.startswith("mtp."):
                dropped["mtp"].append(k)
            elif m := _PER_EXPERT.match(k):
                experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
            else:
                out[k] = v
        for kind, flag, name in (("vision", self.drop_vision, "drop_vision"), ("mtp", self.drop_mtp, "drop_mtp")):
            keys = dropped[kind]
            if keys and not flag:
                raise CheckpointError(f"{where}: {len(keys)} {kind} tensors (e.g. {keys[0]}) are not part of the "
                                      f"text model: pass {name}=True to load it without them")
            if keys:
                log.info("%s: dropped %d %s tensors (%s=True)", where, len(keys), kind, name)
        for layer, parts in experts.items():
            out.update(self._stack(layer, parts, where))
        return out

    def _stack(self, layer: str, parts: dict, where: str) -> dict[str, torch.Tensor]:
        """One layer's per-expert tensors -> stacked gate_up_proj [E, 2F, D] (gate rows first), down_proj."""
        return stack_layer_experts(self, layer, parts, where, lambda gate, up: torch.cat((gate, up)))

    def _hf_name(self, name: str) -> str:
        return self.prefix + name.removeprefix("model.") if name.startswith("model.") else name


def to_hf_state_dict(model: Qwen35ForCausalLM) -> dict[str, torch.Tensor]:
    """transformers' layout: our names, stacked experts."""
    return Qwen35StateDictAdapter(model.config).to_hf(model.state_dict())


def from_hf_names(hf_sd: dict[str, torch.Tensor], num_experts: int, *, drop_vision: bool = False,
                  drop_mtp: bool = False, where: str = "<dict>") -> dict[str, torch.Tensor]:
    """An HF-named state dict in our names (``Qwen35StateDictAdapter.from_hf``)."""
    cfg = Qwen35Config.preset("qwen3.5-debug", num_experts=num_experts)
    return Qwen35StateDictAdapter(cfg, drop_vision=drop_vision, drop_mtp=drop_mtp).from_hf(hf_sd, where)


def load_hf_state_dict(model: Qwen35ForCausalLM, sd: dict[str, torch.Tensor], where: str = "<dict>") -> None:
    """Copy a state dict in our names into ``model`` after a full check (values are copied into the
    model's tensors, keeping the model's dtypes)."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    mismatched = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in sd.items()
                  if k in own and v.shape != own[k].shape]
    _report(missing, unexpected, mismatched, where)
    model.load_state_dict(sd)


def save_pretrained(model: Qwen35ForCausalLM, path: str | os.PathLike, max_shard_bytes: int = 4 << 30) -> None:
    write_hf_folder(path, to_hf_state_dict(model), model.config, max_shard_bytes)


def load_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    drop_vision: bool = False, drop_mtp: bool = False, **config_overrides) -> Qwen35ForCausalLM:
    """Build the model from config.json on the meta device, materialise it on ``device`` and load the
    weights; without ``dtype`` every tensor keeps its stored dtype. ``config_overrides`` set Qwen35Config
    fields (e.g. ``backend``, ``gdn_chunk_size``)."""
    cfg = Qwen35Config.from_hf_dict(read_hf_config(path), **config_overrides)
    adapter = Qwen35StateDictAdapter(cfg, drop_vision=drop_vision, drop_mtp=drop_mtp)
    sd = adapter.from_hf(read_hf_tensors(path, device), where=str(path))
    with torch.device("meta"):
        model = Qwen35ForCausalLM(cfg)
    model.to_empty(device=device)
    adopt_dtypes(model, sd)
    load_hf_state_dict(model, sd, where=str(path))
    if dtype is not None:
        model.cast_(dtype)
    return model
