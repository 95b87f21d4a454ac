"""Official HF checkpoint layout: config.json + sharded safetensors + model.safetensors.index.json.

Names are the official ones (``model.word_embeddings``, ``model.layers.{i}.attention.*``, ``mlp.gate.expert_bias``,
``mlp.experts.{e}.{gate,up,down}_proj.weight``, ...). Our module tree uses the same names except that routed experts are
stacked (``mlp.experts.gate_up_proj`` [E, 2, F, D]: each expert's gate and up weights; ``mlp.experts.down_proj`` [E, D,
F]); the only conversion is stacking/unstacking those. Loading checks the whole key set first and raises one error
listing every missing key, unexpected key and shape mismatch. Tensors are stored with their in-memory dtype, so a
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
from torch.distributed.tensor import DTensor
from torchtitan.models.utils import MoEStateDictAdapter

from harts.models.ling.config import LingConfig
from harts.models.ling.model import LingForCausalLM

__all__ = ["LingStateDictAdapter", "to_hf_state_dict", "load_hf_state_dict", "save_pretrained", "load_pretrained",
           "hf_checkpoint_shapes", "check_hf_keys", "CheckpointError"]

log = logging.getLogger(__name__)

_EXPERT_PARAM = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    pass


class LingStateDictAdapter(MoEStateDictAdapter):
    """Ling-3.0 <-> the official HF layout, as a torchtitan state-dict adapter: the object torchtitan's
    ``CheckpointManager`` uses to load and save HF safetensors through DCP (``sd_adapter``), which the trainer
    and ``save_pretrained`` / ``load_pretrained`` also use.

    Our names are the official ones except that routed experts are stacked (``gate_up_proj`` [E, 2, F, D], ``down_proj``
    [E, D, F]): ``to_hf`` splits them into ``mlp.experts.{e}.*.weight``, a sharded DTensor (FSDP2 / expert parallelism)
    into its own rank's experts without gathering (torchtitan's ``MoEStateDictAdapter``), and ``from_hf`` stacks them
    back (into the same sharding when ``to_hf`` saw DTensors). transformers' ``bailing_hybrid`` names every output
    projection ``attention.dense``, the released checkpoints name KDA's ``attention.o_proj``: ``from_hf`` accepts both,
    ``to_hf`` writes ``kda_output`` ("o_proj"; "dense" when the folder at ``hf_assets_path`` uses transformers' name,
    so DCP reads the keys the folder has)."""

    def __init__(self, config: LingConfig, hf_assets_path: str | os.PathLike | None = None):
        super().__init__(config, str(hf_assets_path) if hf_assets_path else None)
        self.config = config
        self.kda_layers = {i for i in range(config.num_hidden_layers) if config.layer_type(i) == "kda"}
        keys = hf_checkpoint_shapes(hf_assets_path) if hf_assets_path else {}
        self.kda_output = "dense" if any(f"model.layers.{i}.attention.dense.weight" in keys
                                         for i in self.kda_layers) else "o_proj"

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state_dict.items():
            m = _EXPERT_PARAM.match(name)
            if m is None:
                out[self._kda_name(name, self.kda_output)] = t
                continue
            layer, proj = m.groups()
            out.update(unstack_layer_experts(self, layer, proj, t, f"model.layers.{{}}.mlp.experts.{{}}.{proj}",
                                             lambda w: (w[0], w[1])))  # [2, F, D]: gate, up
        return out

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], where: str = "<dict>") -> dict[str, torch.Tensor]:
        out, experts = {}, {}
        for key, t in hf_state_dict.items():
            key = self._kda_name(key, "o_proj")
            if m := _EXPERT_KEY.match(key):
                experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
            else:
                out[key] = t
        for layer, parts in experts.items():
            out.update(stack_layer_experts(self, layer, parts, where, lambda gate, up: torch.stack((gate, up))))
        return out

    def _kda_name(self, key: str, to: str) -> str:
        """A KDA layer's output projection under the name ``to`` ("o_proj" or "dense")."""
        m = re.match(r"^model\.layers\.(\d+)\.attention\.(o_proj|dense)\.weight$", key)
        if m is None or int(m.group(1)) not in self.kda_layers:
            return key
        return f"model.layers.{m.group(1)}.attention.{to}.weight"


def to_hf_state_dict(model: LingForCausalLM) -> dict[str, torch.Tensor]:
    return LingStateDictAdapter(model.config).to_hf(model.state_dict())


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


def unstack_layer_experts(adapter: MoEStateDictAdapter, layer: str, proj: str, t: torch.Tensor, hf: str,
                          split) -> dict:
    """The inverse of ``stack_layer_experts`` for ``layer``'s stacked weight ``proj`` ("gate_up_proj" or
    "down_proj"): per-expert HF tensors under the key template ``hf`` (layer and expert to fill), views of ``t``
    that DCP reads into in place; ``split`` gives an expert's (gate, up) from its gate_up entry. A DTensor gives
    only this rank's experts and its sharding is recorded for ``from_hf`` (torchtitan's ``MoEStateDictAdapter``)."""
    ours = f"model.layers.{{}}.mlp.experts.{proj}"
    if isinstance(t, DTensor):
        adapter.grouped_expert_weight_placements[ours] = t.placements
        adapter.grouped_expert_weight_shape[ours] = t.shape
        adapter.grouped_expert_weight_mesh[ours] = t.device_mesh
        per = adapter._get_local_experts_weights(hf, ours, layer, t)
    else:
        per = {hf.format(layer, e): w for e, w in enumerate(t.unbind(0))}
    out = {}
    for key, w in per.items():
        if proj == "down_proj":
            out[key + ".weight"] = w
        else:
            gate, up = split(w)
            out[key.replace("gate_up_proj", "gate_proj") + ".weight"] = gate
            out[key.replace("gate_up_proj", "up_proj") + ".weight"] = up
    return out


def stack_layer_experts(adapter: MoEStateDictAdapter, layer: str, parts: dict, where: str, join) -> dict:
    """One layer's per-expert HF tensors {(e, "gate_proj" | "up_proj" | "down_proj"): weight} -> our stacked
    ``mlp.experts.gate_up_proj`` (expert e's entry is ``join(gate, up)``) and ``mlp.experts.down_proj``, into
    the sharding that ``adapter.to_hf`` saw (torchtitan's ``MoEStateDictAdapter``: a rank's own experts only).
    Raises one ``CheckpointError`` listing every missing or out-of-range per-expert key."""
    prefix = f"model.layers.{layer}.mlp.experts"
    ids = sorted({e for e, _ in parts})
    missing = [f"{prefix}.{e}.{p}.weight" for e in ids for p in ("gate_proj", "up_proj", "down_proj")
               if (e, p) not in parts]
    extra = [f"{prefix}.{e}.{p}.weight" for e, p in parts if e >= adapter.config.num_experts]
    if missing or extra:
        _report(missing, extra, [], where)
    by = {layer: {"gate_up": {e: join(parts[e, "gate_proj"], parts[e, "up_proj"]) for e in ids},
                  "down": {e: parts[e, "down_proj"] for e in ids}}}
    out = {}
    for kind, proj in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
        ours = f"model.layers.{{}}.mlp.experts.{proj}"
        by[layer][ours] = by[layer].pop(kind)
        if ours in adapter.local_experts_indices:
            stacked = adapter._concatenate_expert_weights_dtensor(by, ours, layer)
        else:
            stacked = adapter._concatenate_expert_weights(by, ours, layer, adapter.config.num_experts)
        if stacked is None:
            _report([f"{prefix}.{e}.*" for e in range(adapter.config.num_experts) if e not in ids], [], [], where)
        out[ours.format(layer)] = stacked
    return out


def check_hf_keys(expected: dict[str, tuple], got: dict[str, tuple], where: str) -> None:
    """One error listing every missing key, unexpected key and shape mismatch (key -> shape maps)."""
    mismatched = [(k, tuple(s), tuple(expected[k])) for k, s in got.items()
                  if k in expected and tuple(s) != tuple(expected[k])]
    _report([k for k in expected if k not in got], [k for k in got if k not in expected], mismatched, where)


def _mtp_keys(keys, cfg: LingConfig) -> list[str]:
    """Keys of multi-token-prediction layers (stored as model.layers.{L}.*, L >= num_hidden_layers)."""
    pat = re.compile(r"^model\.layers\.(\d+)\.")
    return [k for k in keys if (m := pat.match(k)) and int(m.group(1)) >= cfg.num_hidden_layers]


def load_hf_state_dict(model: LingForCausalLM, hf_sd: dict[str, torch.Tensor], where: str = "<dict>") -> None:
    """Copy an HF-named state dict (released or transformers names) into ``model`` (on any device, not meta)
    after a full check. Values are copied into the model's tensors, keeping the model's dtypes."""
    adapter = LingStateDictAdapter(model.config)
    expected = {k: tuple(v.shape) for k, v in adapter.to_hf(model.state_dict()).items()}
    check_hf_keys(expected, {adapter._kda_name(k, "o_proj"): tuple(v.shape) for k, v in hf_sd.items()}, where)
    model.load_state_dict(adapter.from_hf(hf_sd, where))


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


def _weight_files(path: Path) -> list[str]:
    if (path / INDEX_NAME).exists():
        return sorted(set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values()))
    if (path / "model.safetensors").exists():
        return ["model.safetensors"]
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor model.safetensors found")


def read_hf_tensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for f in _weight_files(Path(path)):
        sd.update(load_file(str(Path(path) / f), device=str(device)))
    return sd


def hf_checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """key -> shape of every tensor of an HF folder, from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    out = {}
    for f in _weight_files(Path(path)):
        with safe_open(str(Path(path) / f), framework="pt") as fh:
            out.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return out


def read_hf_config(path: str | os.PathLike) -> dict:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None


def adopt_dtypes(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Give each of ``model``'s tensors the dtype of its value in ``sd`` (our names), so that loading
    rounds nothing."""
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    for k, v in sd.items():
        if k in own and own[k].dtype != v.dtype:
            own[k].data = own[k].data.to(v.dtype)


def load_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    drop_mtp: bool = False, **config_overrides) -> LingForCausalLM:
    """Build the model from config.json on the meta device, materialise it on ``device`` and load the weights.
    Without ``dtype`` each tensor keeps the dtype stored in the checkpoint (bit-exact). Reads our folders, the
    released Ling-3.0 layout and transformers' ``bailing_hybrid`` folders. Multi-token-prediction layers
    are not part of the model: a checkpoint holding them is refused unless ``drop_mtp=True``."""
    cfg = LingConfig.from_hf_dict(read_hf_config(path), **config_overrides)
    sd = read_hf_tensors(path, device)
    mtp = _mtp_keys(sd, cfg)
    if mtp:
        if not drop_mtp:
            raise CheckpointError(f"{path}: {len(mtp)} tensors of multi-token-prediction layers (e.g. {mtp[0]}; "
                                  f"num_hidden_layers={cfg.num_hidden_layers}); HARTS has no MTP head: pass "
                                  "drop_mtp=True to load the main model without them")
        log.info("%s: dropped %d multi-token-prediction tensors (drop_mtp=True)", path, len(mtp))
        sd = {k: v for k, v in sd.items() if k not in set(mtp)}
    with torch.device("meta"):
        model = LingForCausalLM(cfg)
    model.to_empty(device=device)
    adapter = LingStateDictAdapter(cfg)
    expected = {k: tuple(v.shape) for k, v in adapter.to_hf(model.state_dict()).items()}
    check_hf_keys(expected, {adapter._kda_name(k, "o_proj"): tuple(v.shape) for k, v in sd.items()}, str(path))
    ours = adapter.from_hf(sd, str(path))
    adopt_dtypes(model, ours)
    model.load_state_dict(ours)
    if dtype is not None:
        model.cast_(dtype)
    return model
