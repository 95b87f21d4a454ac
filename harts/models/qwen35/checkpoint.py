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

import json
import logging
import os
import re
from pathlib import Path

import torch

from harts.models.ling.checkpoint import CheckpointError, _report, read_hf_tensors, write_hf_folder
from harts.models.qwen35.config import Qwen35Config
from harts.models.qwen35.model import Qwen35ForCausalLM

__all__ = ["to_hf_state_dict", "from_hf_names", "load_hf_state_dict", "save_pretrained", "load_pretrained",
           "CheckpointError"]

log = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_hf_state_dict(model: Qwen35ForCausalLM) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def from_hf_names(hf_sd: dict[str, torch.Tensor], num_experts: int, *, drop_vision: bool = False,
                  drop_mtp: bool = False, where: str = "<dict>") -> dict[str, torch.Tensor]:
    """An HF-named state dict in our names: prefix mapped, per-expert tensors stacked, vision / MTP tensors
    dropped when asked (else refused)."""
    out, experts, dropped = {}, {}, {"vision": [], "mtp": []}
    for k, v in hf_sd.items():
        if k.startswith("model.language_model."):
            k = "model." + k.removeprefix("model.language_model.")
        if k.startswith(("model.visual.", "visual.")):
            dropped["vision"].append(k)
            continue
        if k.startswith("mtp."):
            dropped["mtp"].append(k)
            continue
        m = _PER_EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
            continue
        out[k] = v
    for kind, flag, name in (("vision", drop_vision, "drop_vision"), ("mtp", drop_mtp, "drop_mtp")):
        keys = dropped[kind]
        if keys and not flag:
            raise CheckpointError(f"{where}: {len(keys)} {kind} tensors (e.g. {keys[0]}) are not part of the text "
                                  f"model: pass {name}=True to load it without them")
        if keys:
            log.info("%s: dropped %d %s tensors (%s=True)", where, len(keys), kind, name)
    for prefix, parts in experts.items():
        missing = [f"{prefix}.{e}.{p}.weight" for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")
                   if (e, p) not in parts]
        extra = [f"{prefix}.{e}.{p}.weight" for e, p in parts if e >= num_experts]
        if missing or extra:
            _report(missing, extra, [], where)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat((parts[e, "gate_proj"], parts[e, "up_proj"])) for e in range(num_experts)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(num_experts)])
    return out


def load_hf_state_dict(model: Qwen35ForCausalLM, sd: dict[str, torch.Tensor], where: str = "<dict>") -> None:
    """Copy a state dict in our names into ``model`` after a full check (values are copied into the
    model's tensors, keeping the model's dtypes)."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    mismatched = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in sd.items()
                  if k in own and v.shape != own[k].shape]
    _report(missing, unexpected, mismatched, where)
    with torch.no_grad():
        for k, v in sd.items():
            own[k].copy_(v)


def save_pretrained(model: Qwen35ForCausalLM, path: str | os.PathLike, max_shard_bytes: int = 4 << 30) -> None:
    write_hf_folder(path, to_hf_state_dict(model), model.config, max_shard_bytes)


def load_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    drop_vision: bool = False, drop_mtp: bool = False, **config_overrides) -> Qwen35ForCausalLM:
    """Build the model from config.json on the meta device, materialise it on ``device`` and load the
    weights; without ``dtype`` every tensor keeps its stored dtype. ``config_overrides`` set Qwen35Config
    fields (e.g. ``backend``, ``gdn_chunk_size``)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    cfg = Qwen35Config.from_hf_dict(raw, **config_overrides)
    sd = from_hf_names(read_hf_tensors(path, device), cfg.num_experts, drop_vision=drop_vision, drop_mtp=drop_mtp,
                       where=str(path))
    with torch.device("meta"):
        model = Qwen35ForCausalLM(cfg)
    model.to_empty(device=device)
    own = dict(model.named_parameters())
    for k, v in sd.items():  # adopt the stored dtypes before copying, so nothing is rounded
        if k in own and own[k].dtype != v.dtype:
            own[k].data = own[k].data.to(v.dtype)
    load_hf_state_dict(model, sd, where=str(path))
    if dtype is not None:
        model.cast_(dtype)
    return model
