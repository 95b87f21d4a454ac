"""Native Ling-3.0 (BailingMoeV3 / HF ``bailing_hybrid``): config, model, HF checkpoint I/O, generation
(``harts.models.common.generate``: incremental decoding, sampling, forkable decoding state), torch.compile
as the layers' execution engine (``compile_model``)."""
from harts.models.ling.config import LingConfig
from harts.models.ling.model import LingForCausalLM, LingModel

_CHECKPOINT = ("load_pretrained", "save_pretrained", "load_hf_state_dict", "to_hf_state_dict", "CheckpointError")

_GENERATE = ("DecodeCache", "Sampling")  # generate(): harts.models.common.generate.generate

_COMPILE = ("compile_model", "CompileReport")

__all__ = ["LingConfig", "LingForCausalLM", "LingModel", *_CHECKPOINT, *_GENERATE, *_COMPILE,
           "compact_logprobs_reference"]


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name in _CHECKPOINT:
        from harts.models.ling import checkpoint

        return getattr(checkpoint, name)
    if name in _GENERATE:
        import importlib

        return getattr(importlib.import_module("harts.models.common.generate"), name)
    if name in _COMPILE:
        from harts.models.common import compile as compile_module

        return getattr(compile_module, name)
    if name == "compact_logprobs_reference":
        from harts.models.common.logprobs import compact_logprobs_reference

        return compact_logprobs_reference
    raise AttributeError(f"module 'harts.models.ling' has no attribute {name!r}")
