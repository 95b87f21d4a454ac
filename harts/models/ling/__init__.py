"""Native Ling-3.0 (BailingMoeV3 / HF ``bailing_hybrid``): config, model, HF checkpoint I/O."""
from harts.models.ling.config import LingConfig
from harts.models.ling.model import LingForCausalLM, LingModel

__all__ = ["LingConfig", "LingForCausalLM", "LingModel", "load_pretrained", "save_pretrained",
           "compact_logprobs_reference"]


def __getattr__(name):
    if name in ("load_pretrained", "save_pretrained", "load_hf_state_dict", "to_hf_state_dict"):
        from harts.models.ling import checkpoint

        return getattr(checkpoint, name)
    if name == "compact_logprobs_reference":
        from harts.models.ling.logprobs import compact_logprobs_reference

        return compact_logprobs_reference
    raise AttributeError(f"module 'harts.models.ling' has no attribute {name!r}")
