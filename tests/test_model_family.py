"""harts.models.family: every preset resolves to its family and builds that family's config and model; unknown
names are refused with every family's presets listed; the declared capabilities are what harts.train runs
and refuses."""
import types

import pytest
import torch

from harts.models import family as fam
from harts.models.family import FAMILIES, all_presets, family_of, model_class, model_config
from harts.models.ling import LingConfig, LingForCausalLM
from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

PRESETS = [(f, p) for f in FAMILIES.values() for p in f.presets]


def _meta_model(f, preset):
    cfg = model_config(preset, backend="reference")
    with torch.device("meta"):
        return model_class(cfg)(cfg)


def test_registry_holds_both_families():
    assert {f.name: (f.config_class, f.model_class) for f in FAMILIES.values()} == {
        "ling3": (LingConfig, LingForCausalLM), "qwen3.5": (Qwen35Config, Qwen35ForCausalLM)}
    assert len(set(all_presets())) == len(all_presets())  # no preset in two families


@pytest.mark.parametrize("f,preset", PRESETS, ids=[p for _, p in PRESETS])
def test_every_preset_resolves_to_its_family(f, preset):
    assert family_of(preset) is f
    cfg = model_config(preset, backend="reference")
    assert type(cfg) is f.config_class and cfg.backend == "reference"
    assert family_of(cfg) is f and model_class(cfg) is f.model_class
    assert model_config(cfg) is cfg  # a ready config passes through
    assert cfg == f.config_class.preset(preset, backend="reference")


@pytest.mark.parametrize("f", FAMILIES.values(), ids=list(FAMILIES))
def test_family_presets_are_the_config_classes_presets(f):
    """The registry lists exactly the names the config class builds: its own refusal names the same set."""
    with pytest.raises(ValueError, match="known") as e:
        f.config_class.preset(f.preset_prefix + "-no-such-size")
    named = {p for p in str(e.value).replace("'", " ").replace(",", " ").split() if f.owns(p)}
    assert named - {f.preset_prefix + "-no-such-size"} == set(f.presets)


def test_family_of_a_model():
    f = FAMILIES["qwen3.5"]
    m = _meta_model(f, "qwen3.5-debug")
    assert family_of(m) is f


@pytest.mark.parametrize("name", ["ling3-huge", "qwen3.5-huge", "llama-7b"])
def test_unknown_preset_lists_every_family(name):
    with pytest.raises(ValueError, match=f"unknown model preset '{name}'") as e:
        model_config(name)
    for p in all_presets():
        assert p in str(e.value)
    assert "qwen3.5-8l" in str(e.value) and "ling3-tiny-debug" in str(e.value)


def test_type_errors():
    with pytest.raises(TypeError, match="preset name or a config"):
        model_config(3)
    with pytest.raises(TypeError, match="overrides"):
        model_config(model_config("ling3-tiny-debug"), backend="reference")
    with pytest.raises(TypeError, match="no model class"):
        model_class(object())
    with pytest.raises(TypeError, match="no model family"):
        family_of(object())
    with pytest.raises(ValueError, match="unknown capability"):
        FAMILIES["ling3"].supports("fp8")


def test_family_spec_checks_itself():
    base = FAMILIES["ling3"]
    with pytest.raises(ValueError, match="unknown capabilities"):
        fam.ModelFamily(**{**base.__dict__, "capabilities": frozenset({"tp", "zero3"})})
    with pytest.raises(ValueError, match="do not start with"):
        fam.ModelFamily(**{**base.__dict__, "presets": ("ling3-tiny", "tiny")})
    with pytest.raises(Exception):
        base.name = "other"  # frozen


def test_train_model_config_uses_the_registry():
    """The trainer's [model] section resolves through the same registry (and its error)."""
    from harts.train.config import parse_args
    from harts.train.model import model_config as train_model_config

    for preset in ("qwen3.5-debug", "ling3-tiny-debug"):
        cfg = train_model_config(parse_args([f"--model.preset={preset}", "--model.kda_chunk_size=32"]).model)
        assert family_of(cfg) is family_of(preset)
        assert cfg.layout_geometry[0] == 32
    with pytest.raises(ValueError, match="qwen3.5-35b-a3b"):
        train_model_config(types.SimpleNamespace(preset="ling3-huge", backend="auto", num_hidden_layers=0,
                                                 kda_chunk_size=0, op_backends=""))


# ---------------------------------------------------------------------- capabilities against the code
@pytest.mark.parametrize("f", FAMILIES.values(), ids=list(FAMILIES))
def test_tp_capability_is_what_apply_tp_accepts(f):
    """apply_tp refuses a family without a tensor-parallel plan before touching the mesh; a family with one
    passes that check (the stand-in mesh then fails it further on)."""
    from harts.train.parallelize import apply_tp

    model = _meta_model(f, f.presets[-1])
    mesh = types.SimpleNamespace(size=lambda: 2)
    with pytest.raises(Exception) as e:
        apply_tp(model, mesh)
    refused = isinstance(e.value, ValueError) and "has no plan for" in str(e.value)
    assert refused == (not f.supports("tp")), (
        f"apply_tp {'refuses' if refused else 'accepts'} {f.title} but harts.models.family declares "
        f"tp={f.supports('tp')}: update its capabilities ({e.value})")


@pytest.mark.parametrize("f", FAMILIES.values(), ids=list(FAMILIES))
def test_trainer_refuses_what_the_family_lacks(f):
    """The trainer's family check (run before any mesh or weight) refuses exactly the settings of the
    capabilities the family does not declare."""
    from harts.train.config import parse_args
    from harts.train.model import is_qwen35
    from harts.train.trainer import Trainer

    # each setting alone: the other capability's setting at a value every family accepts
    settings = {"tp": ["--parallelism.tensor_parallel_degree=2", "--activation_checkpoint.mode=full",
                       "--rl.expert_bias_rate=0"],
                "expert_bias": ["--rl.expert_bias_rate=0.001"]}
    for cap, args in settings.items():
        cfg = parse_args([f"--model.preset={f.presets[-1]}", *args])
        # the trainer runs its Qwen3.5 check for the configs is_qwen35 names, nothing family-specific otherwise
        check = Trainer._check_qwen35 if is_qwen35(model_config(f.presets[-1])) else (lambda self: None)
        if f.supports(cap):
            check(types.SimpleNamespace(cfg=cfg))
        else:
            with pytest.raises(ValueError, match="does not support"):
                check(types.SimpleNamespace(cfg=cfg))


@pytest.mark.parametrize("f", FAMILIES.values(), ids=list(FAMILIES))
def test_declared_capabilities_run(f):
    """What a family declares goes through the functions the trainer applies: selective checkpointing and
    compile's region split on every decoder layer, the EP dispatch's stacked expert weights, a pipeline stage."""
    from harts.models.common.compile import check_region_split
    from harts.train import parallelize as par
    from harts.train.pipeline import prune_to_stage

    assert {"ep", "pp", "compile", "selective_ac", "cp"} <= f.capabilities
    model = _meta_model(f, f.presets[-1])
    par.apply_ac(model, "selective")
    assert model.model.checkpoint_policy == "selective"
    for layer in model.decoder_layers():
        check_region_split(layer)
        if hasattr(layer.mlp, "experts"):
            assert par.expert_weights(layer.mlp.experts)
    assert par.embeddings(model) is not None
    n = len(model.decoder_layers())
    prune_to_stage(model, 1, 2)
    assert 0 < len(model.decoder_layers()) < n and par.embeddings(model) is None


@pytest.mark.parametrize("f", FAMILIES.values(), ids=list(FAMILIES))
def test_checkpoint_io_round_trips(f, tmp_path):
    """save_pretrained / load_pretrained / state_dict_adapter of the family write and read its HF layout."""
    cfg = model_config(f.presets[-1], backend="reference")
    model = f.model_class(cfg)
    model.init_weights(0)
    f.save_pretrained(model, tmp_path)
    back = f.load_pretrained(tmp_path)
    assert type(back) is f.model_class and family_of(back) is f
    sd, sd2 = model.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    adapter = f.state_dict_adapter(cfg)
    assert adapter.from_hf(adapter.to_hf(sd)).keys() == sd.keys()
    import json

    assert json.loads((tmp_path / "config.json").read_text())["model_type"] in f.hf_model_types


@pytest.mark.parametrize("f", FAMILIES.values(), ids=list(FAMILIES))
def test_checkpointing_is_not_a_model_setting(f):
    """Activation checkpointing is applied to a built model from outside (apply_ac): a model config has no
    such field, asking for one names where it is set, and an earlier export's config.json that still
    carries it under "harts" loads."""
    import dataclasses

    cfg = f.config(f.presets[-1])
    assert "recompute" not in {x.name for x in dataclasses.fields(cfg)}
    with pytest.raises(TypeError, match=r"recompute is not a model config field.*apply_ac"):
        f.config(f.presets[-1], recompute=True)
    d = cfg.to_hf_dict()
    d["harts"] = {**d.get("harts", {}), "recompute": True}
    assert type(cfg).from_hf_dict(d) == cfg
    with pytest.raises(TypeError, match=r"recompute is not a model config field"):
        type(cfg).from_hf_dict(cfg.to_hf_dict(), recompute=False)


@pytest.mark.parametrize("f", FAMILIES.values(), ids=list(FAMILIES))
def test_both_families_expose_the_same_checkpoint_surface(f, tmp_path):
    """``Model.from_pretrained`` / ``model.save_pretrained`` on either family's class (one implementation on
    CausalLM through the registry): the round trip gives the same class and the same tensors."""
    cfg = f.config(f.presets[-1])
    model = f.model_class(cfg)
    model.save_pretrained(tmp_path / "hf")
    back = f.model_class.from_pretrained(tmp_path / "hf")
    assert type(back) is f.model_class and back.config == model.config
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
