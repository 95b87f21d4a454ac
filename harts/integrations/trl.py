"""HARTS as the log-prob backend of TRL's GRPO trainer (TRL 1.16.0, transformers 5.23).

``harts.integrations.trl.GRPOTrainer`` is ``trl.GRPOTrainer`` with ``_get_per_token_logps_and_entropies``
overridden: the policy, old-policy and reference log-prob passes (and the per-token entropies) of the padded
prompt + completion rows run through ``harts.pack_padded`` -> the model's compact forward -> ``harts.unpack_padded``,
so the prompt shared by a group's completions (and any common first part of completions) is computed once.
Everything else (generation, rewards, advantages, the loss, the optimizer, checkpoints) is TRL's.

The model is a HARTS model (``LingForCausalLM``, ``Qwen35ForCausalLM``); the trainer wraps it in
``HartsForCausalLM`` (``as_hf_model``), a ``transformers.PreTrainedModel`` that holds the same module, so the
parameters TRL's optimizer updates are the HARTS model's (no second copy of the weights). The wrapper's padded
forward (for ``generate`` and for TRL's own log-prob path) runs each row alone through the model's packed path.

trl is imported when ``GRPOTrainer`` is first used: ``import harts.integrations.trl`` works without it.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

# GRPOTrainer and HartsForCausalLM are made on first access (module __getattr__): they subclass trl / transformers
__all__ = ["GRPOTrainer", "HartsForCausalLM", "as_hf_model", "frozen_copy", "HartsGRPOMixin", "SUPPORTED_TRL"]  # noqa: F822

SUPPORTED_TRL = "1.16.0"
_INSTALL = "pip install 'harts[trl]' (trl==1.16.0)"


def _harts_module(model) -> nn.Module:
    """The HARTS CausalLM inside ``model`` (itself, a ``HartsForCausalLM``, or either under a wrapper with .module)."""
    from harts.models.common.causal_lm import CausalLM

    seen = model
    for _ in range(4):
        if isinstance(seen, CausalLM):
            return seen
        if isinstance(seen, _PaddedBackbone):
            return seen.model
        inner = getattr(seen, "backbone", None) or getattr(seen, "module", None)
        if inner is None:
            break
        seen = inner
    raise TypeError(f"HARTS GRPOTrainer: {type(model).__name__} is not a HARTS model; pass a LingForCausalLM or "
                    "Qwen35ForCausalLM (or harts.integrations.trl.as_hf_model(model))")


class _PaddedBackbone(nn.Module):
    """Padded [B, L] rows -> final hidden states [B, L, D] (zeros at padding): each row's attended tokens (one
    contiguous run, positions from 0) as its own sequence of the model's packed path."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        if input_ids.dim() != 2:
            raise ValueError(f"HartsForCausalLM: input_ids must be [batch, length], got {tuple(input_ids.shape)}")
        mask = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.to(torch.bool))
        lengths = mask.sum(1)
        runs = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0]  # runs of attended tokens per row
        if bool((runs > 1).any()):
            i = int((runs > 1).nonzero()[0, 0])
            raise ValueError(f"HartsForCausalLM: row {i} has padding in the middle; padding may only lead or trail")
        keep = lengths > 0
        D = self.model.config.hidden_size
        dtype = self.model.lm_head.weight.dtype
        out = torch.zeros((*input_ids.shape, D), dtype=dtype, device=input_ids.device)
        if bool(keep.any()):
            flat = mask & keep[:, None]
            ids_T = input_ids[flat]
            cu = torch.zeros(int(keep.sum()) + 1, dtype=torch.long, device=input_ids.device)
            cu[1:] = lengths[keep].cumsum(0)
            pos_T = torch.arange(ids_T.shape[0], device=input_ids.device) - torch.repeat_interleave(cu[:-1],
                                                                                                  lengths[keep])
            h_TD = self.model(ids_T, pos_T, cu)
            out = out.masked_scatter(flat[..., None], h_TD.to(dtype))
        return BaseModelOutput(last_hidden_state=out)


def _hf_classes():
    try:
        from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    except ImportError as e:  # transformers comes with trl
        raise ImportError(f"harts.integrations.trl needs transformers: {_INSTALL}") from e
    return GenerationMixin, PretrainedConfig, PreTrainedModel


_CLASSES: dict = {}


def _hf_model_class():
    if "model" in _CLASSES:
        return _CLASSES["model"]
    GenerationMixin, PretrainedConfig, PreTrainedModel = _hf_classes()
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class HartsHFConfig(PretrainedConfig):
        """The transformers-facing config of a HARTS model: the sizes TRL and ``generate`` read."""

        model_type = "harts"

        def __init__(self, vocab_size=None, hidden_size=None, num_hidden_layers=None, **kwargs):
            self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
            kwargs.setdefault("use_cache", False)
            kwargs.setdefault("tie_word_embeddings", False)
            super().__init__(**kwargs)

    class HartsForCausalLM(PreTrainedModel, GenerationMixin):
        """A HARTS model (``.harts``) as a transformers causal LM: padded forward returning logits, ``generate``
        (without a KV cache: every step reruns the rows, fine for tests and small CPU runs; use vLLM for real
        generation), and ``save_pretrained`` writing the HARTS model's own Hugging Face folder."""

        config_class = HartsHFConfig
        base_model_prefix = "backbone"
        main_input_name = "input_ids"
        _supports_cache_class = False
        _no_split_modules: list = []

        def __init__(self, config, model: nn.Module | None = None):
            super().__init__(config)
            if model is None:
                raise TypeError("HartsForCausalLM wraps an existing HARTS model: use as_hf_model(model)")
            self.backbone = _PaddedBackbone(model)

        supports_gradient_checkpointing = True

        def _init_weights(self, module):  # the HARTS model is initialized (or loaded) already
            pass

        def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                        every_n_layers: int = 1, **kwargs):
            """TRL's ``gradient_checkpointing=True`` (its default) and transformers' ``gradient_checkpointing_enable``
            / ``activation_checkpointing_enable`` (transformers 5.17 and 5.23 route them here): the HARTS model's
            "full" policy, every decoder layer recomputed in backward (``harts.train.parallelize.apply_ac``);
            ``enable=False``: none."""
            from harts.train.parallelize import apply_ac

            if enable and every_n_layers != 1:
                raise ValueError(f"HartsForCausalLM: every_n_layers={every_n_layers} is not supported; HARTS "
                                 "checkpoints every decoder layer (every_n_layers=1)")
            apply_ac(self.harts, "full" if enable else "none")

        @property
        def is_gradient_checkpointing(self) -> bool:
            return self.harts.model.checkpoint_policy != "none"

        is_activation_checkpointing = is_gradient_checkpointing

        @property
        def harts(self) -> nn.Module:
            return self.backbone.model

        def get_input_embeddings(self):
            return getattr(self.harts.model, self.harts.model.embedding_attr)

        def get_output_embeddings(self):
            return self.harts.lm_head

        def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None,
                    logits_to_keep: int | None = None, **kwargs):
            """Padded rows -> logits [B, L, V] (fp32+), or [B, K, V] for the last ``logits_to_keep`` = K
            positions only, as transformers' causal LMs do (None or 0: all positions; TRL trainers that pass it
            ask for K + 1 and drop the last). With ``labels`` [B, L] the loss is the mean next-token cross
            entropy of the positions whose logits are computed (ignore index -100)."""
            for k in ("past_key_values", "inputs_embeds"):
                if kwargs.get(k) is not None:
                    raise ValueError(f"HartsForCausalLM.forward: {k} is not supported (no KV cache); pass input_ids")
            if logits_to_keep is not None and (isinstance(logits_to_keep, bool)
                                               or not isinstance(logits_to_keep, int) or logits_to_keep < 0):
                raise ValueError(f"HartsForCausalLM.forward: logits_to_keep must be an int >= 0 (0 or None: all "
                                 f"positions), got {logits_to_keep!r}")
            h_BLD = self.backbone(input_ids, attention_mask).last_hidden_state
            L = h_BLD.shape[1]
            K = min(logits_to_keep, L) if logits_to_keep else L
            logits_BKV = self.harts.logits(h_BLD[:, L - K:])
            loss = None
            if labels is not None:  # position L - K + j predicts token L - K + j + 1
                lab = labels[:, L - K + 1:].reshape(-1)
                loss = torch.nn.functional.cross_entropy(logits_BKV[:, :-1].reshape(-1, logits_BKV.shape[-1]), lab,
                                                         ignore_index=-100)
            return CausalLMOutputWithPast(loss=loss, logits=logits_BKV)

        def prepare_inputs_for_generation(self, input_ids, attention_mask=None, logits_to_keep=None, **kwargs):
            # generate asks for the last position's logits only (logits_to_keep=1), as of transformers' models
            return {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep}

        def save_pretrained(self, save_directory, *args, **kwargs):
            """The HARTS model's Hugging Face folder (loadable by its ``from_pretrained`` and by transformers)."""
            self.harts.save_pretrained(save_directory)

    _CLASSES.update(model=HartsForCausalLM, config=HartsHFConfig)
    return HartsForCausalLM


def as_hf_model(model: nn.Module, *, eos_token_id=None, pad_token_id=None, bos_token_id=None):
    """``model`` (a HARTS ``CausalLM``) as a ``HartsForCausalLM`` holding the same module (no copy). Token ids
    default to the model config's own where it has them."""
    from harts.models.common.causal_lm import CausalLM

    if not isinstance(model, CausalLM):
        raise TypeError(f"as_hf_model: expected a HARTS model (LingForCausalLM, Qwen35ForCausalLM), got "
                        f"{type(model).__name__}")
    cls = _hf_model_class()
    c = model.config
    ids = {k: v if v is not None else getattr(c, k, None)
           for k, v in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id),
                        ("bos_token_id", bos_token_id))}
    config = _CLASSES["config"](vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                num_hidden_layers=c.num_hidden_layers, harts_family=type(model).__name__, **ids)
    dtype = model.lm_head.weight.dtype
    config.dtype = dtype
    hf = cls(config, model)
    for k, v in ids.items():
        setattr(hf.generation_config, k, v)
    return hf


def frozen_copy(hf) -> nn.Module:
    """A frozen copy of a ``HartsForCausalLM`` (eval mode, no gradients): the GRPO reference model at the start of
    training, made from the policy itself (TRL would load one from a hub id)."""
    ref = as_hf_model(copy.deepcopy(hf.harts), eos_token_id=hf.config.eos_token_id,
                      pad_token_id=hf.config.pad_token_id).eval()
    return ref.requires_grad_(False)


class HartsGRPOMixin:
    """Put before ``trl.GRPOTrainer`` in a subclass: its log-prob passes run through HARTS (module docstring).

    ``_get_per_token_logps_and_entropies`` has TRL 1.16's signature and contract: ``input_ids`` [N, L] are the
    left-padded prompts and right-padded completions concatenated, ``attention_mask`` their masks, the last
    ``logits_to_keep`` columns the completions; it returns (log-probs [N, logits_to_keep], entropies or None,
    aux loss or None) with zeros at padding. Rows are packed ``batch_size`` at a time (all at once by default), a
    group's completions sharing their prompt in the trie. ``harts_router_stats`` keeps the router statistics of
    the last pass (one ``RouterStats`` per MoE layer)."""

    harts_router_stats: list | None = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        import harts

        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise ValueError(f"HARTS GRPOTrainer: multimodal inputs ({', '.join(given)}) are not supported; train "
                             "text-only models")
        module = _harts_module(self.accelerator.unwrap_model(model))
        N, L = input_ids.shape
        K = int(logits_to_keep)
        batch_size = batch_size or N
        temperature = float(getattr(self, "temperature", 1.0))
        scored = attention_mask.clone()
        scored[:, :L - K] = 0  # TRL scores every attended token of the last K columns
        dt = torch.promote_types(module.lm_head.weight.dtype, torch.float32)
        lps, ents, auxes = [], [], []
        for start in range(0, N, batch_size):
            sl = slice(start, min(start + batch_size, N))
            ids, am, cm = input_ids[sl], attention_mask[sl], scored[sl]
            rows = cm.any(1).nonzero().squeeze(1)  # a row without scored tokens (masked completion) gets zeros
            n = ids.shape[0]
            lp_rows = torch.zeros(n, K, dtype=dt, device=ids.device)
            ent_rows = torch.zeros(n, K, dtype=dt, device=ids.device)
            if rows.numel():
                batch, layout = harts.pack_padded(ids[rows], am[rows], completion_mask=cm[rows], config=module)
                with self.accelerator.autocast():
                    lp_S, ent_S, stats = module.logprobs(batch, return_entropies=True, return_router_stats=True,
                                                         temperature=temperature)
                self.harts_router_stats = stats
                lead = layout.column_offset - (L - K)  # columns of the last K before the first completion token
                lp, _ = harts.unpack_padded(lp_S, layout)
                lp_rows = lp_rows.index_copy(0, rows, torch.nn.functional.pad(lp.to(dt), (lead, 0)))
                if compute_entropy:
                    ent, _ = harts.unpack_padded(ent_S, layout)
                    ent_rows = ent_rows.index_copy(0, rows, torch.nn.functional.pad(ent.to(dt), (lead, 0)))
                if compute_aux_loss:  # HARTS's batch-wise balance loss, averaged over the MoE layers
                    auxes.append(torch.stack([(s.f_E * s.P_E).sum() for s in stats]).mean())
            lps.append(lp_rows), ents.append(ent_rows)
        logps = torch.cat(lps)
        entropies = torch.cat(ents) if compute_entropy else None
        aux = torch.stack(auxes).mean() if compute_aux_loss and auxes else None
        return logps, entropies, aux


def _check_trl():
    try:
        import trl
    except ImportError as e:
        raise ImportError(f"harts.integrations.trl.GRPOTrainer needs trl: {_INSTALL}") from e
    if trl.__version__ != SUPPORTED_TRL:
        warnings.warn(f"harts.integrations.trl is tested with trl=={SUPPORTED_TRL}, found trl=={trl.__version__}; "
                      "GRPOTrainer._get_per_token_logps_and_entropies may have changed", stacklevel=3)
    import inspect

    params = inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies).parameters
    missing = [p for p in ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy")
               if p not in params]
    if missing:
        raise ImportError(f"trl=={trl.__version__}'s GRPOTrainer._get_per_token_logps_and_entropies has no "
                          f"{', '.join(missing)}: install trl=={SUPPORTED_TRL}")
    return trl


def _grpo_trainer_class():
    if "trainer" in _CLASSES:
        return _CLASSES["trainer"]
    trl = _check_trl()

    class GRPOTrainer(HartsGRPOMixin, trl.GRPOTrainer):
        """``trl.GRPOTrainer`` training a HARTS model, its log-prob passes through HARTS (module docstring).

        ``model``: a ``LingForCausalLM`` / ``Qwen35ForCausalLM`` (wrapped with ``as_hf_model``, no copy) or a
        ``HartsForCausalLM``; ``processing_class`` (a tokenizer) is required. With ``beta != 0`` the reference
        model is a frozen copy of the initial model, made here (TRL would reload it from a hub id)."""

        def __init__(self, model, reward_funcs=None, args=None, *, processing_class=None, **kwargs):
            from harts.models.common.causal_lm import CausalLM

            if processing_class is None:
                raise TypeError("HARTS GRPOTrainer: pass processing_class= (the tokenizer of the model's vocabulary)")
            if isinstance(model, str):
                raise TypeError("HARTS GRPOTrainer: pass the model, e.g. LingForCausalLM.from_pretrained(path)")
            if isinstance(model, CausalLM):
                model = as_hf_model(model, eos_token_id=processing_class.eos_token_id,
                                    pad_token_id=processing_class.pad_token_id)
            _harts_module(model)
            if args is None:
                args = trl.GRPOConfig("harts-grpo")
            beta = args.beta
            args.beta = 0.0  # no reference model from a hub id: made below
            try:
                super().__init__(model, reward_funcs, args=args, processing_class=processing_class, **kwargs)
            finally:
                args.beta = beta
            self.beta = beta
            if beta != 0.0:
                ref = frozen_copy(self.accelerator.unwrap_model(self.model))
                self.ref_model = self.accelerator.prepare_model(ref, evaluation_mode=True)

    _CLASSES["trainer"] = GRPOTrainer
    return GRPOTrainer


def __getattr__(name: str):
    if name == "GRPOTrainer":
        return _grpo_trainer_class()
    if name == "HartsForCausalLM":
        return _hf_model_class()
    raise AttributeError(f"module 'harts.integrations.trl' has no attribute {name!r}")
