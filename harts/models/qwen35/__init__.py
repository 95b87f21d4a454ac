"""Native Qwen3.5-MoE (HF ``qwen3_5_moe``, text part): config, model, HF checkpoint I/O. Gated DeltaNet
layers run on the same planner, compact layout and round kernels as Ling's KDA layers."""
from harts.models.qwen35.config import Qwen35Config
from harts.models.qwen35.model import Qwen35ForCausalLM, Qwen35Model

_CHECKPOINT = ("load_pretrained", "save_pretrained", "load_hf_state_dict", "to_hf_state_dict", "from_hf_names",
               "CheckpointError")

__all__ = ["Qwen35Config", "Qwen35ForCausalLM", "Qwen35Model", *_CHECKPOINT]


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name in _CHECKPOINT:
        from harts.models.qwen35 import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'harts.models.qwen35' has no attribute {name!r}")
