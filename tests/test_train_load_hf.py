"""``model.load_hf``: the trainer starts from an HF folder through torchtitan's HF path (the family's state-dict
adapter, DCP's HuggingFace storage reader), after parallelisation.

The truth is the folder itself: the tensors ``safetensors`` reads from it, mapped to our names by an
independent rule written out here (stack per-expert tensors, strip the released text prefix, rename KDA's
``dense``). Checked: Ling-3.0 in our layout and in transformers' names, Qwen3.5-MoE in the released layout
(text prefix, per-expert tensors, several shards), host and meta (``init_on_meta``) initialisation, two gloo
ranks with FSDP2 + expert parallelism (each rank reads its own shards) and with two pipeline stages (each reads
its own layers), and one error that names every
missing, unexpected and mis-shaped tensor.
"""
import os
import re

import pytest
import torch

from harts.models.ling.checkpoint import CheckpointError, read_hf_tensors, write_hf_folder
from harts.train.config import load_config
from harts.train.trainer import Trainer
from tests.helpers import COMMON, spawn_ranks

QWEN = COMMON.replace('preset = "ling3-tiny-debug"', 'preset = "qwen3.5-debug"').replace(
    "expert_bias_rate = 1e-2", "expert_bias_rate = 0.0")


def _folder_truth(path, num_experts: int, kda_layers=(), gate_up: bool = False) -> dict[str, torch.Tensor]:
    """The folder's tensors in our names, by the rules written out (not through the adapters): each expert's
    gate and up weights joined into ``gate_up_proj``, as Qwen3.5's rows ([2F, D], ``gate_up``) or as Ling's
    pair ([2, F, D])."""
    out, experts = {}, {}
    for k, v in read_hf_tensors(path).items():
        k = re.sub(r"^model\.language_model\.", "model.", k)
        if (m := re.match(r"^model\.layers\.(\d+)\.attention\.dense\.weight$", k)) and int(m.group(1)) in kda_layers:
            k = f"model.layers.{m.group(1)}.attention.o_proj.weight"
        if m := re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", k):
            experts.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = v
        else:
            out[k] = v
    for prefix, parts in experts.items():
        join = torch.cat if gate_up else torch.stack
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [join((parts[e, "gate_proj"], parts[e, "up_proj"])) for e in range(num_experts)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(num_experts)])
    return out


def _config(tmp_path, text: str, name: str):
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return str(p)


def _ling_folder(tmp_path, transformers_names: bool = False):
    """A float64 Ling debug model with its own random weights (seed 7), saved in the official layout; with
    ``transformers_names`` its KDA output projections are renamed ``attention.dense`` (transformers'
    bailing_hybrid)."""
    from harts.models.ling import LingConfig, LingForCausalLM
    from harts.models.ling.checkpoint import save_pretrained

    cfg = LingConfig.preset("ling3-tiny-debug", num_hidden_layers=4)
    model = LingForCausalLM(cfg).double()
    model.init_weights(7)
    for m in model.moe_layers():
        m.gate.expert_bias.normal_()
    path = tmp_path / ("ling_tf" if transformers_names else "ling")
    save_pretrained(model, path, max_shard_bytes=200_000)
    kda = {i for i in range(4) if cfg.layer_type(i) == "kda"}
    if transformers_names:
        sd = {re.sub(r"^(model\.layers\.(\d+)\.attention)\.o_proj", r"\1.dense", k)
              if int(re.match(r"^model\.layers\.(\d+)", k).group(1)) in kda else k: v
              for k, v in read_hf_tensors(path).items() if k.startswith("model.layers.")}
        sd.update({k: v for k, v in read_hf_tensors(path).items() if not k.startswith("model.layers.")})
        write_hf_folder(path, sd, cfg, 200_000)
    return path, kda, cfg.num_experts


def _qwen_released_folder(tmp_path):
    """A float64 Qwen3.5 debug model (seed 5) written as the released folders are: ``model.language_model.``
    prefix, per-expert gate/up/down tensors, several shards."""
    from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

    cfg = Qwen35Config.preset("qwen3.5-debug", num_hidden_layers=4)
    model = Qwen35ForCausalLM(cfg).double()
    model.init_weights(5)
    sd = {}
    for k, v in model.state_dict().items():
        k2 = "model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", k2)
        if m is None:
            sd[k2] = v
            continue
        for e in range(v.shape[0]):
            if m.group(2) == "down_proj":
                sd[f"{m.group(1)}.{e}.down_proj.weight"] = v[e]
            else:
                gate, up = v[e].chunk(2)
                sd[f"{m.group(1)}.{e}.gate_proj.weight"], sd[f"{m.group(1)}.{e}.up_proj.weight"] = gate, up
    path = tmp_path / "qwen_released"
    write_hf_folder(path, sd, cfg, 100_000)
    return path, cfg.num_experts


def _assert_loaded(model_sd: dict, truth: dict):
    assert set(model_sd) == set(truth)
    for k, v in truth.items():
        assert torch.equal(model_sd[k].to(v.dtype), v), k


@pytest.mark.parametrize("meta", [False, True], ids=["host_init", "init_on_meta"])
@pytest.mark.parametrize("transformers_names", [False, True], ids=["official", "transformers_names"])
def test_ling_load_hf(tmp_path, meta, transformers_names):
    path, kda, E = _ling_folder(tmp_path, transformers_names)
    tr = Trainer(load_config(_config(tmp_path, COMMON, "ling"), **{
        "job.dump_folder": str(tmp_path / "out"), "model.load_hf": str(path), "model.init_on_meta": meta}))
    _assert_loaded(tr.model.state_dict(), _folder_truth(path, E, kda))


def test_qwen35_load_hf_released_layout(tmp_path):
    path, E = _qwen_released_folder(tmp_path)
    tr = Trainer(load_config(_config(tmp_path, QWEN, "qwen"), **{
        "job.dump_folder": str(tmp_path / "out"), "model.load_hf": str(path), "model.init_on_meta": True}))
    _assert_loaded(tr.model.state_dict(), _folder_truth(path, E, gate_up=True))


def test_load_hf_names_every_missing_unexpected_and_misshaped_tensor(tmp_path):
    path, _, _ = _ling_folder(tmp_path)
    sd = read_hf_tensors(path)
    sd.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    sd["model.layers.9.attention.bogus"] = torch.zeros(2)
    sd["model.norm.weight"] = torch.zeros(5, dtype=torch.float64)
    from harts.models.ling import LingConfig

    bad = tmp_path / "bad"
    write_hf_folder(bad, sd, LingConfig.preset("ling3-tiny-debug", num_hidden_layers=4), 1 << 30)
    with pytest.raises(CheckpointError) as e:
        Trainer(load_config(_config(tmp_path, COMMON, "ling"), **{
            "job.dump_folder": str(tmp_path / "out"), "model.load_hf": str(bad)}))
    for s in ("missing keys (1)", "model.layers.1.mlp.experts.3.up_proj.weight", "unexpected keys (1)",
              "model.layers.9.attention.bogus", "model.norm.weight: (5,) vs (64,)"):
        assert s in str(e.value), s


def _layout_worker(rank, world, port, cfg, out, path, truth_file, layout):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        tr = Trainer(load_config(cfg, **{"job.dump_folder": out, "model.load_hf": path, "model.init_on_meta": True,
                                         **LAYOUTS[layout]}))
        full = get_model_state_dict(tr.model, options=StateDictOptions(full_state_dict=True))
        truth = torch.load(truth_file)
        if layout == "pp2":  # each stage holds its own layers (and embeddings or head): check those, on each rank
            assert len(full) < len(truth) and full.keys() <= truth.keys(), sorted(set(full) - set(truth))[:5]
            truth = {k: truth[k] for k in full}
        if rank == 0 or layout == "pp2":
            _assert_loaded(full, truth)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


LAYOUTS = {"fsdp2_ep2": {"parallelism.data_parallel_shard_degree": 2, "parallelism.expert_parallel_degree": 2},
           "pp2": {"parallelism.pipeline_parallel_degree": 2}}


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("ling", "fsdp2_ep2"), ("qwen35", "fsdp2_ep2"), ("ling", "pp2")])
def test_load_hf_on_two_ranks(tmp_path, family, layout):
    if family == "ling":
        path, kda, E = _ling_folder(tmp_path)
        text, truth = COMMON, _folder_truth(path, E, kda)
    else:
        (path, E), text = _qwen_released_folder(tmp_path), QWEN
        truth = _folder_truth(path, E, gate_up=True)
    torch.save(truth, tmp_path / "truth.pt")
    spawn_ranks(_layout_worker, 2, _config(tmp_path, text, family), str(tmp_path / "out"), str(path),
                str(tmp_path / "truth.pt"), layout)
