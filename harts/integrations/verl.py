"""A verl 0.9.1 training engine that runs every micro-batch through HARTS's compact path (docs/verl.md).

``HartsEngineWithLMHead`` is verl's own FSDP engine (``verl.workers.engine.FSDPEngineWithLMHead``: its
device mesh, optimizer, LR scheduler, micro-batching, gradient accumulation, loss normalisation and
checkpoint manager) with three parts replaced: the module is a HARTS model loaded from the HF folder
(``harts.models.family``), it is sharded with HARTS's FSDP2 plan (``harts.train.parallelize.apply_fsdp``),
and a micro-batch's forward packs its samples by shared prefix (``harts.pack``: the G responses of a prompt,
the turns of one conversation) and computes every shared row once. Per-token outputs come back in verl's
no-padding layout (nested jagged tensors over ``input_ids``), so verl's loss functions run unchanged.

Importing this module imports verl and registers the engine as ``EngineRegistry`` model_type
``"language_model"``, backend ``"harts"``; ``harts`` itself never imports it. In a verl run, set the
actor's (and reference policy's) ``strategy`` to ``harts`` and import this module in the workers
(``actor_rollout_ref.model.external_lib=harts.integrations.verl``).

verl's layout, which this engine reproduces: a micro-batch's ``input_ids`` is a nested tensor of the N
samples (prompt + response, no padding); ``log_probs[i][t]`` is log p(input_ids[i][t+1] | input_ids[i][:t+1])
under ``softmax(logits / temperature)``, and the last entry of each sample is the prediction of the next
sample's first token (verl rolls the packed stream by one; its losses never read that entry). HARTS packs
sample i as its tokens plus that next first token, so every entry, the last included, is the value verl's
engine computes. ``entropy`` and ``sum_pi_squared`` (when the micro-batch asks for them) are computed once
per distinct compact row and expanded to the positions.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

try:
    import verl
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.utils.device import get_device_id
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead
    from verl.workers.engine.utils import detach_tree
except ImportError as e:  # one line: what is missing and how to install it
    raise ImportError(f"harts.integrations.verl needs verl==0.9.1 ({e}); install it as docs/verl.md says "
                      "(pip install 'harts[verl]')") from None

from harts.data.trajectory import Trajectory

VERL_VERSION = "0.9.1"
if verl.__version__ != VERL_VERSION:
    raise ImportError(f"harts.integrations.verl is written for verl=={VERL_VERSION}, found verl=={verl.__version__}: "
                      f"pip install --no-deps verl=={VERL_VERSION}")

__all__ = ["HartsEngineConfig", "HartsEngineWithLMHead", "micro_batch_trajectories", "VERL_VERSION"]

# micro-batch flags of verl's FSDP engine that this engine does not implement; each is refused by name
_REFUSED_FLAGS = {
    "distillation_use_topk": "top-K distillation outputs",
    "distillation_only": "distillation-only forwards",
}


def _family_of_folder(path: str):
    """The HARTS model family of an HF folder, from its config.json ``model_type``."""
    from harts.models.family import FAMILIES

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"harts verl engine: {path} has no config.json; point actor_rollout_ref.model.path "
                                "at a HARTS or transformers folder of a Ling-3.0 or Qwen3.5-MoE model")
    with open(cfg_file) as f:
        model_type = json.load(f).get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    known = ", ".join(t for fam in FAMILIES.values() for t in fam.hf_model_types)
    raise ValueError(f"harts verl engine: {cfg_file} has model_type={model_type!r}; HARTS models are {known}")


def micro_batch_trajectories(input_ids, position_ids=None) -> list[Trajectory]:
    """HARTS trajectories of one verl micro-batch: sample i's tokens (``input_ids[i]`` of the nested jagged
    tensor) followed by the next sample's first token (the last sample's: the first sample's), which is the
    target verl's rolled packed stream gives the sample's last position. Samples that share a prefix (the
    responses of one prompt, the turns of one conversation) share its rows in ``harts.pack``.

    ``position_ids`` (optional, nested like ``input_ids``) must count 0, 1, ... within each sample: HARTS
    takes positions from the token's depth in the prefix trie."""
    if not getattr(input_ids, "is_nested", False):
        raise ValueError("harts verl engine: input_ids must be a nested (jagged) tensor, verl's no-padding layout "
                         "(pad_mode=no_padding)")
    offsets = input_ids.offsets().cpu().numpy().astype(np.int64)
    tokens = input_ids.values().cpu().numpy().astype(np.int64)
    lengths = np.diff(offsets)
    if lengths.size == 0 or (lengths == 0).any():
        bad = int(np.flatnonzero(lengths == 0)[0]) if lengths.size else 0
        raise ValueError(f"harts verl engine: sample {bad} of the micro-batch has no tokens")
    if position_ids is not None:
        if not getattr(position_ids, "is_nested", False) or position_ids.values().dim() != 1:
            raise ValueError("harts verl engine: position_ids must be a 1-D nested tensor like input_ids (multi-axis "
                             "position ids, e.g. mRoPE, are not supported)")
        pos = position_ids.values().cpu().numpy().astype(np.int64)
        want = np.arange(tokens.shape[0], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        if pos.shape != want.shape:
            raise ValueError(f"harts verl engine: position_ids has {pos.shape[0]} entries, input_ids {want.shape[0]}")
        if (pos != want).any():
            j = int(np.flatnonzero(pos != want)[0])
            i = int(np.searchsorted(offsets, j, side="right") - 1)
            raise ValueError(f"harts verl engine: sample {i} has position id {int(pos[j])} at token {j - offsets[i]}; "
                             "HARTS needs positions 0, 1, ... within each sample")
    firsts = tokens[offsets[:-1]]
    nxt = np.roll(firsts, -1)
    return [Trajectory(tokens=np.append(tokens[offsets[i]:offsets[i + 1]], nxt[i])) for i in range(lengths.size)]


def _to_dtype(precision) -> torch.dtype:
    """verl's precision names (fp32, bf16, fp16, ...) plus fp64 / float64, which verl does not name."""
    from verl.utils.torch_dtypes import PrecisionType

    if precision in ("fp64", "float64", "64", 64, torch.float64):
        return torch.float64
    return PrecisionType.to_dtype(precision)


def _row_stats(lm_head_weight, h_RD, want_entropy: bool, want_sum_pi2: bool, chunk: int = 2048):
    """Entropy and sum of squared probabilities of softmax(h @ W^T) per row, in chunks of rows (each chunk's
    [rows, V] logits recomputed in backward, never all kept). The formulas are verl's
    (``entropy_from_logits``: logsumexp - sum softmax * logits; ``calculate_sum_pi_squared_from_logits``)."""
    def stats(h):
        logits = (h @ lm_head_weight.t()).to(torch.promote_types(h.dtype, torch.float32))
        out = []
        if want_entropy:
            p = torch.softmax(logits, dim=-1)
            out.append(torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1))
        if want_sum_pi2:
            out.append(torch.softmax(logits, dim=-1).square().sum(-1))
        return tuple(out)

    parts = []
    for s in range(0, h_RD.shape[0], chunk):
        h = h_RD[s:s + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or lm_head_weight.requires_grad):
            parts.append(torch.utils.checkpoint.checkpoint(stats, h, use_reentrant=False))
        else:
            parts.append(stats(h))
    if not parts:
        empty = (h_RD[:0] @ lm_head_weight[:1].t()).view(0).to(torch.promote_types(h_RD.dtype, torch.float32))
        parts = [tuple(empty for _ in range(int(want_entropy) + int(want_sum_pi2)))]
    return tuple(torch.cat([p[k] for p in parts]) for k in range(len(parts[0])))


def _temperature(micro_batch, n: int, device):
    """verl's temperature of a micro-batch (a number, or one per sample, which must then all be equal), and None."""
    t = micro_batch["temperature"] if "temperature" in micro_batch.keys() else 1.0
    t = tu.unwrap_non_tensor_data(t) if not isinstance(t, torch.Tensor) else t
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1)
        if t.numel() == 1:
            return float(t.item()), None
        if t.numel() != n:
            raise ValueError(f"harts verl engine: temperature has {t.numel()} entries for {n} samples")
        if bool((t == t[0]).all()):
            return float(t[0].item()), None
        raise ValueError(f"harts verl engine: temperature differs between the samples of a micro-batch "
                         f"({t.min().item():g} to {t.max().item():g}); use one rollout temperature")
    return float(t), None


@EngineRegistry.register(model_type="language_model", backend="harts", device=["cuda", "cpu"])
class HartsEngineWithLMHead(FSDPEngineWithLMHead):
    """verl's FSDP engine with a HARTS model and prefix-shared micro-batches (module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        for name, why in (("ulysses_sequence_parallel_size", "Ulysses sequence parallelism"),):
            if getattr(engine_config, name, 1) != 1:
                raise ValueError(f"harts verl engine: {name}={getattr(engine_config, name)} ({why}) is not "
                                 f"supported; set {name}=1 (HARTS's own context parallelism is harts.runtime.cp)")
        if self.pad_to_length:
            raise ValueError("harts verl engine: pad_to_length=true pads verl's packed stream, which this engine "
                             "does not use (HARTS packs its own rows); set pad_to_length=false")
        for name in ("lora_rank", "use_liger"):
            if getattr(model_config, name, 0):
                raise ValueError(f"harts verl engine: model.{name}={getattr(model_config, name)} is not supported "
                                 f"with HARTS models; set model.{name} to its default")
        if getattr(self, "_qat_enabled", False):
            raise ValueError("harts verl engine: QAT (engine qat.enable=true) is not supported; set qat.enable=false")

    # ------------------------------------------------------------------ model
    def _build_module(self):
        path = self.model_config.local_path
        family = _family_of_folder(path)
        dtype = self.engine_config.model_dtype
        if dtype is None:
            dtype = "fp32" if not self.engine_config.forward_only else "bf16"
        overrides = dict(getattr(self.engine_config, "model_overrides", None) or {})
        module = family.load_pretrained(path, dtype=_to_dtype(dtype), **overrides)
        if self.model_config.enable_gradient_checkpointing:
            from harts.train.parallelize import apply_ac

            apply_ac(module, "full")
        self.harts_family = family
        return module

    def _build_fsdp_module(self, module):
        from harts.train.parallelize import apply_fsdp

        if self.engine_config.offload_policy or self.engine_config.param_offload:
            raise ValueError("harts verl engine: parameter offload (offload_policy / param_offload) is not "
                             "supported; set both to false")
        mp = self.engine_config.mixed_precision or {}
        param_dtype = _to_dtype(mp.get("param_dtype", "bf16"))
        reduce_dtype = _to_dtype(mp.get("reduce_dtype", "fp32"))
        self._autocast_dtype = param_dtype  # read by verl's helpers; HARTS's forward casts through FSDP2, no autocast
        self.scaler = None
        if param_dtype == torch.float16:
            raise ValueError("harts verl engine: mixed_precision.param_dtype=fp16 is not supported; use bf16 or fp32")
        module.to(torch.device(self.device_mesh.device_type, get_device_id())
                  if self.device_mesh.device_type != "cpu" else "cpu")
        apply_fsdp(module, self.device_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=self.engine_config.reshard_after_forward)
        return module

    # ------------------------------------------------------------------ forward
    def harts_model_output(self, micro_batch: TensorDict) -> dict:
        """verl's ``model_output`` of one micro-batch (log_probs, and entropy / sum_pi_squared when asked) in its
        nested layout, computed on the micro-batch's prefix-shared ``CompactBatch``."""
        from harts.runtime.batch import pack

        pad_mode = tu.get_non_tensor_data(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
        if pad_mode != DatasetPadMode.NO_PADDING:
            raise ValueError(f"harts verl engine: pad_mode={pad_mode} is not supported; verl's engines take "
                             "pad_mode=no_padding")
        for key, what in _REFUSED_FLAGS.items():
            if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
                raise ValueError(f"harts verl engine: {key}=true ({what}) is not supported; run it on verl's fsdp "
                                 "engine")
        if "multi_modal_inputs" in micro_batch.keys():
            raise ValueError("harts verl engine: multi_modal_inputs are not supported (HARTS models are text-only)")
        want_entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        want_pi2 = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False))

        input_ids = micro_batch["input_ids"]
        position_ids = micro_batch["position_ids"] if "position_ids" in micro_batch.keys() else None
        trajs = micro_batch_trajectories(input_ids, position_ids)
        model = self.module
        device = input_ids.values().device
        batch = pack(trajs, config=model.config).to(device)
        self.last_pack_stats = dict(batch.stats, samples=len(trajs))

        h = model(layout=batch)  # [P, D] final-normed rows; FSDP2's root hooks run around it
        weight = model.lm_head.weight
        temp, _ = _temperature(micro_batch, len(trajs), device)
        # verl's engine divides by the temperature rounded to float32 (its forward_step: temperature.to(float32)):
        # the same value here, so a float64 run equals verl's to rounding
        temp = float(torch.tensor(temp, dtype=torch.float32))
        offsets = input_ids.offsets()
        # logits / T = (h / T) W^T: scale the rows once, one log-prob per distinct (row, target)
        hs = h if temp == 1.0 else h / max(temp, 1e-8)
        lp = model.token_logprobs(hs, batch.logprob_pair_targets, batch.logprob_pair_rows)
        lp = lp.index_select(0, batch.logprob_pair_of)
        if want_entropy or want_pi2:
            rows_u, inv = torch.unique(batch.logprob_rows, return_inverse=True)
            stats = [s.index_select(0, inv) for s in _row_stats(weight, hs.index_select(0, rows_u),
                                                                 want_entropy, want_pi2)]
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(lp, offsets)}
        if want_entropy:
            out["entropy"] = torch.nested.nested_tensor_from_jagged(stats.pop(0), offsets)
        if want_pi2:
            out["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(stats.pop(0), offsets)
        return out

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        micro_batch = micro_batch.to(get_device_id())
        model_output = self.harts_model_output(micro_batch)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                          dp_group=self.get_data_parallel_group())
        else:
            if not forward_only:
                raise ValueError("harts verl engine: a training forward needs a loss_function")
            loss, metrics = torch.tensor(1.0, device=get_device_id()), {}
        output = {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
        return loss, output

    # ------------------------------------------------------------------ weights for the rollout engine
    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """Full tensors under their HF names (the family's state-dict adapter: what ``save_pretrained`` writes and
        vLLM / SGLang load), instead of the module's own parameter names."""
        from torch.distributed.tensor import DTensor

        from harts.models.family import family_of

        model = self.module
        sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}
        hf = family_of(model.config).state_dict_adapter(model.config).to_hf(sd)
        return iter(hf.items()), None


@dataclass
class HartsEngineConfig(FSDPEngineConfig):
    """``FSDPEngineConfig`` with ``strategy="harts"`` (the registry backend of ``HartsEngineWithLMHead``) and
    ``model_overrides``: HARTS model-config fields applied when the model is loaded (e.g.
    ``{"backend": "reference"}``, ``{"kda_chunk_size": 64}``). verl's actor config sets the strategy from
    ``actor.strategy``, so a plain ``FSDPEngineConfig`` with ``actor.strategy=harts`` selects the engine too."""

    strategy: str = "harts"
    model_overrides: dict | None = None

    def __post_init__(self):
        super(FSDPEngineConfig, self).__post_init__()  # FSDPEngineConfig's own check lists only verl's backends
        if self.strategy != "harts":
            raise ValueError(f"HartsEngineConfig: strategy={self.strategy!r}; the HARTS engine's backend is 'harts'")

