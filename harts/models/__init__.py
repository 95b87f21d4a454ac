"""HARTS models: single-device modules, readable top to bottom (``harts.models.ling``: Ling-3.0,
``harts.models.qwen35``: Qwen3.5-MoE). ``harts.models.family`` is the registry of model families: presets,
config and model classes, HF checkpoint I/O and the training features each family supports."""

_FAMILY = ("ModelFamily", "FAMILIES", "family_of", "model_config", "model_class")

__all__ = list(_FAMILY)


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name in _FAMILY:
        from harts.models import family

        return getattr(family, name)
    raise AttributeError(f"module 'harts.models' has no attribute {name!r}")
