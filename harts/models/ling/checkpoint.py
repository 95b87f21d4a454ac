"""Official HF checkpoint layout: config.json + sharded safetensors + model.safetensors.index.json.

Names are the official ones (``model.word_embeddings``, ``model.layers.{i}.attention.*``,
``mlp.gate.expert_bias``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``, ...). Our module tree uses the
same names except that routed experts are stacked ([E, F, D] per projection); the only conversion is
stacking/unstacking those. Loading checks the whole key set first and raises one error listing every
missing key, unexpected key and shape mismatch. Tensors are stored with their in-memory dtype, so a
save/load round trip is bit-exact, and config.json's ``torch_dtype`` states that dtype.

Folders written by transformers' ``bailing_hybrid`` (``BailingHybridForCausalLM.save_pretrained``) load
unchanged: their config keys are read by ``LingConfig.from_hf_dict``, and their one naming difference is
mapped here: transformers saves every layer's attention output projection as ``attention.dense``, the
released checkpoints name KDA's ``attention.o_proj`` (MLA's is ``attention.dense`` in both). Our folders
load in transformers as they are.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from harts.models.ling.config import LingConfig
from harts.models.ling.model import LingForCausalLM

__all__ = ["to_hf_state_dict", "load_hf_state_dict", "save_pretrained", "load_pretrained", "CheckpointError"]

log = logging.getLogger(__name__)

_EXPERT_PARAM = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    pass


def _expected_hf_shapes(model: LingForCausalLM) -> dict[str, tuple[tuple[int, ...], str, int | None]]:
    """hf key -> (shape, our state-dict name, expert index or None)."""
    out = {}
    for name, t in model.state_dict().items():
        m = _EXPERT_PARAM.match(name)
        if m:
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = (tuple(t.shape[1:]), name, e)
        else:
            out[name] = (tuple(t.shape), name, None)
    return out


def to_hf_state_dict(model: LingForCausalLM) -> dict[str, torch.Tensor]:
    sd = {}
    for name, t in model.state_dict().items():
        m = _EXPERT_PARAM.match(name)
        if m:
            for e in range(t.shape[0]):
                sd[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e]
        else:
            sd[name] = t
    return sd


def _report(missing, unexpected, mismatched, where: str) -> None:
    if not (missing or unexpected or mismatched):
        return
    lines = [f"checkpoint {where} does not match the model:"]

    def block(title, items):
        if items:
            lines.append(f"  {title} ({len(items)}):")
            lines.extend(f"    {x}" for x in items[:50])
            if len(items) > 50:
                lines.append(f"    ... and {len(items) - 50} more")

    block("missing keys", sorted(missing))
    block("unexpected keys", sorted(unexpected))
    block("shape mismatches (key: checkpoint vs model)", [f"{k}: {a} vs {b}" for k, a, b in mismatched])
    raise CheckpointError("\n".join(lines))


def _kda_output_names(hf_sd: dict[str, torch.Tensor], cfg: LingConfig) -> dict[str, torch.Tensor]:
    """transformers' ``attention.dense`` of a KDA layer -> the released ``attention.o_proj``."""
    out = dict(hf_sd)
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_type(i) != "kda":
            continue
        src, dst = f"model.layers.{i}.attention.dense.weight", f"model.layers.{i}.attention.o_proj.weight"
        if src in out:
            if dst in out:
                raise CheckpointError(f"checkpoint holds both {src} and {dst} for KDA layer {i}")
            out[dst] = out.pop(src)
    return out


def _mtp_keys(hf_sd: dict[str, torch.Tensor], cfg: LingConfig) -> list[str]:
    """Keys of multi-token-prediction layers (stored as model.layers.{L}.*, L >= num_hidden_layers)."""
    pat = re.compile(r"^model\.layers\.(\d+)\.")
    return [k for k in hf_sd if (m := pat.match(k)) and int(m.group(1)) >= cfg.num_hidden_layers]


def load_hf_state_dict(model: LingForCausalLM, hf_sd: dict[str, torch.Tensor], where: str = "<dict>") -> None:
    """Copy an HF-named state dict (released or transformers names) into ``model`` (on any device, not meta)
    after a full check. Values are copied with ``copy_`` into the model's tensors, keeping the model's dtypes."""
    hf_sd = _kda_output_names(hf_sd, model.config)
    expected = _expected_hf_shapes(model)
    missing = [k for k in expected if k not in hf_sd]
    unexpected = [k for k in hf_sd if k not in expected]
    mismatched = [(k, tuple(v.shape), expected[k][0]) for k, v in hf_sd.items()
                  if k in expected and tuple(v.shape) != expected[k][0]]
    _report(missing, unexpected, mismatched, where)
    own = model.state_dict()
    with torch.no_grad():
        for k, v in hf_sd.items():
            _, name, e = expected[k]
            dst = own[name] if e is None else own[name][e]
            dst.copy_(v)


def save_pretrained(model: LingForCausalLM, path: str | os.PathLike, max_shard_bytes: int = 4 << 30) -> None:
    write_hf_folder(path, to_hf_state_dict(model), model.config, max_shard_bytes)


def write_hf_folder(path: str | os.PathLike, hf_sd: dict[str, torch.Tensor], config, max_shard_bytes: int) -> None:
    """config.json (``config.to_hf_dict``, with the dtype that holds most elements) + safetensors shards of at
    most ``max_shard_bytes`` (one tensor may exceed it alone) + model.safetensors.index.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in hf_sd.items()}
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(torch_dtype=_main_dtype(sd)), indent=2) + "\n")
    shards, cur, cur_bytes = [], {}, 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if cur and cur_bytes + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[k] = v
        cur_bytes += nbytes
    if cur:
        shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2) + "\n")


def _main_dtype(sd: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype holding most floating-point elements (A_log, dt_bias and the expert bias stay fp32 in a
    bf16 model, as in the released checkpoints and transformers' keep-in-fp32 list)."""
    count: dict[torch.dtype, int] = {}
    for v in sd.values():
        if v.is_floating_point():
            count[v.dtype] = count.get(v.dtype, 0) + v.numel()
    return max(count, key=count.get) if count else torch.float32


def read_hf_tensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    if (path / INDEX_NAME).exists():
        files = sorted(set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: neither {INDEX_NAME} nor model.safetensors found")
    sd = {}
    for f in files:
        sd.update(load_file(str(path / f), device=str(device)))
    return sd


def load_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    drop_mtp: bool = False, **config_overrides) -> LingForCausalLM:
    """Build the model from config.json on the meta device, materialise it on ``device`` and load the weights.
    Without ``dtype`` each tensor keeps the dtype stored in the checkpoint (bit-exact). Reads our folders, the
    released Ling-3.0 layout and transformers' ``bailing_hybrid`` folders. Multi-token-prediction layers
    are not part of the model: a checkpoint holding them is refused unless ``drop_mtp=True``."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    cfg = LingConfig.from_hf_dict(raw, **config_overrides)
    sd = read_hf_tensors(path, device)
    mtp = _mtp_keys(sd, cfg)
    if mtp:
        if not drop_mtp:
            raise CheckpointError(f"{path}: {len(mtp)} tensors of multi-token-prediction layers (e.g. {mtp[0]}; "
                                  f"num_hidden_layers={cfg.num_hidden_layers}); HARTS has no MTP head: pass "
                                  "drop_mtp=True to load the main model without them")
        log.info("%s: dropped %d multi-token-prediction tensors (drop_mtp=True)", path, len(mtp))
        drop = set(mtp)
        sd = {k: v for k, v in sd.items() if k not in drop}
    sd = _kda_output_names(sd, cfg)
    with torch.device("meta"):
        model = LingForCausalLM(cfg)
    model.to_empty(device=device)
    # adopt checkpoint dtypes per tensor before copying so nothing is rounded
    expected = _expected_hf_shapes(model)
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    for k, v in sd.items():
        if k in expected:
            name = expected[k][1]
            if own[name].dtype != v.dtype:
                own[name].data = own[name].data.to(v.dtype)
    load_hf_state_dict(model, sd, where=str(path))
    if dtype is not None:
        model.cast_(dtype)
    return model
