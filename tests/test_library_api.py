"""The library API as a user's own training loop meets it: no silent traps, errors that name the problem.

- A batch planned for another KDA chunk size or convolution width is refused where it meets the model
  (a mismatched plan gives wrong log-probs, it does not crash); ``pack(config=...)`` takes both from the
  model and equals the trajectory-wise reference.
- Every ``LingConfig`` field round-trips through config.json, whose ``torch_dtype`` is the saved tensors'.
- Token ids are range-checked before the embedding, in the model forward and in ``pack``.
- ``dir(harts)`` lists the lazy names; the first forward does not import ``torch.distributed.tensor``.
"""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import harts
from harts.models.ling import LingConfig, LingForCausalLM
from harts.models.ling.checkpoint import load_pretrained, save_pretrained
from harts.runtime import hidden_states, logprobs, pack

VOCAB = 512


def small_model(chunk_size: int = 16, **overrides) -> LingForCausalLM:
    cfg = LingConfig.preset("ling3-tiny-debug", backend="reference", kda_chunk_size=chunk_size, num_hidden_layers=4,
                            **overrides)
    torch.manual_seed(0)
    return LingForCausalLM(cfg).double()


def forked_trees(B: int = 16, seed: int = 0) -> list[list[int]]:
    """Forks off the chunk grid of any of the chunk sizes tried (B-3, B+5, 2B+1), depth past 2 chunks."""
    rng = np.random.default_rng(seed)
    root = rng.integers(0, VOCAB, 3 * B + 5).tolist()
    return [root] + [root[:p] + rng.integers(0, VOCAB, 7).tolist() for p in (B - 3, B + 5, 2 * B + 1)]


def trajectory_wise(model, trajs) -> torch.Tensor:
    """Independent reference: the ordinary packed forward over each trajectory on its own."""
    with torch.no_grad():
        return torch.cat([logprobs(model, pack([t], prefix_sharing=False)) for t in trajs])


# ------------------------------------------------------------------ 1. chunk size / conv width
def test_pack_from_model_config_equals_trajectory_wise():
    model = small_model(16)
    trajs = forked_trees(16)
    batch = pack(trajs, config=model.config)
    assert batch.chunk_size == 16 and batch.conv_width == model.config.short_conv_kernel_size
    assert batch.stats["replay_tokens"] > 0 and batch.stats["boundary_states"] > 0
    with torch.no_grad():
        lp = logprobs(model, batch)
    ref = trajectory_wise(model, trajs)
    assert (lp - ref).abs().max().item() <= 1e-9 * ref.abs().max().item()
    assert pack(trajs, config=model).chunk_size == 16  # the model itself also works


@pytest.mark.parametrize("chunk_size", [8, 12, 32])
def test_batch_for_another_chunk_size_is_refused(chunk_size):
    model = small_model(16)
    batch = pack(forked_trees(16), chunk_size=chunk_size)
    msg = rf"chunk_size={chunk_size} does not match the model.s chunk_size=16"
    with pytest.raises(ValueError, match=msg):
        logprobs(model, batch)
    with pytest.raises(ValueError, match=msg):
        model(layout=batch)
    with pytest.raises(ValueError, match=msg):
        hidden_states(model, batch)


def test_batch_at_16_for_model_at_64_names_both_values():
    model = small_model(64)
    with pytest.raises(ValueError, match=r"chunk_size=16 does not match the model's chunk_size=64") as e:
        model.logprobs(pack(forked_trees(16), chunk_size=16))
    assert "config=model.config" in str(e.value)


def test_conv_width_mismatch_is_refused():
    model = small_model(16)
    with pytest.raises(ValueError, match=r"conv_width=3 does not match the model.s conv_width=4"):
        logprobs(model, pack(forked_trees(16), chunk_size=16, conv_width=3))


def test_pack_arguments_against_config():
    cfg = small_model(16).config
    with pytest.raises(ValueError, match=r"chunk_size=8 disagrees with the model.s chunk_size=16"):
        pack(forked_trees(16), config=cfg, chunk_size=8)
    with pytest.raises(TypeError, match="chunk size is required"):
        pack(forked_trees(16))
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        pack(forked_trees(16), chunk_size=16.0)
    with pytest.raises(TypeError, match="has no layout_geometry"):
        pack(forked_trees(16), config={"kda_chunk_size": 16})
    # the trajectory-wise batch needs no chunk size (the model runs its own)
    assert pack(forked_trees(16), prefix_sharing=False).chunk_size is None


# ------------------------------------------------------------------ 4. token ids before the embedding
def test_out_of_vocab_ids_in_model_forward_name_id_position_and_vocab():
    model = small_model(16)
    ids = torch.tensor([5, 7, 9, 11, VOCAB + 3, 2])
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 3} at position 4 \(sequence 1, offset 1\).*"
                                         rf"vocab_size={VOCAB}"):
        model(ids, torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 3, 6]))
    ids[4] = -1
    with pytest.raises(ValueError, match=r"token id -1 at position 4"):
        model(ids, torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 3, 6]))
    # a compact batch packed without the vocab is checked by the model
    trajs = forked_trees(16)
    trajs[2] = trajs[2][:-1] + [VOCAB]
    with pytest.raises(ValueError, match=rf"token id {VOCAB} at physical row \d+.*vocab_size={VOCAB}"):
        model.logprobs(pack(trajs, chunk_size=16))
    with pytest.raises(ValueError, match=rf"token id {VOCAB} at position \d+"):
        model.logprobs(pack(trajs, prefix_sharing=False))


def test_pack_checks_token_ids_when_it_knows_the_vocab():
    trajs = forked_trees(16)
    trajs[3] = trajs[3][:5] + [VOCAB + 1] + trajs[3][6:]
    with pytest.raises(ValueError, match=rf"trajectory 3 position 5: token id {VOCAB + 1}.*vocab_size={VOCAB}"):
        pack(trajs, config=small_model(16).config)
    with pytest.raises(ValueError, match=r"trajectory 3 position 5"):
        pack(trajs, chunk_size=16, vocab_size=VOCAB, prefix_sharing=False)


# ------------------------------------------------------------------ 2. config.json round trip
def _non_default(f: dataclasses.Field, cfg: LingConfig):
    v = getattr(cfg, f.name)
    special = {"backend": "reference", "q_lora_rank": 24, "kda_lower_bound": -4.0, "tie_word_embeddings": False,
               "kda_chunk_size": 16, "short_conv_kernel_size": 3, "first_k_dense_replace": 2, "layer_group_size": 5,
               "num_shared_experts": 2, "pad_token_id": 7, "logprobs_chunk_size": 96}
    if f.name in special:
        return special[f.name]
    if f.name.endswith("_backend"):
        return "fast"
    if isinstance(v, bool):
        return not v
    if isinstance(v, float):
        return v * 1.5
    return v  # the debug preset's other values already differ from the class defaults


def test_every_config_field_round_trips_through_config_json(tmp_path):
    base = LingConfig.preset("ling3-tiny-debug")
    changed = {f.name: _non_default(f, base) for f in dataclasses.fields(LingConfig)}
    cfg = LingConfig.preset("ling3-tiny-debug", **changed)
    back = LingConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert back == cfg, {f.name: (getattr(cfg, f.name), getattr(back, f.name))
                         for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(back, f.name)}
    model = small_model(16)
    save_pretrained(model, tmp_path)
    assert load_pretrained(tmp_path).config == model.config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_config_json_states_the_saved_dtype(tmp_path, dtype):
    model = small_model(16).cast_(dtype)
    save_pretrained(model, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    assert d["torch_dtype"] == name and d["dtype"] == name
    assert load_pretrained(tmp_path).model.word_embeddings.weight.dtype == dtype


# ------------------------------------------------------------------ 5. discoverability and import cost
def test_public_names_are_listed():
    assert {"pack", "CompactBatch"} <= set(dir(harts))
    import harts.models.ling as ling

    for name in ("load_hf_state_dict", "to_hf_state_dict", "load_pretrained", "save_pretrained"):
        assert name in ling.__all__ and callable(getattr(ling, name))


def test_norms_do_not_import_dtensor_and_still_route_dtensors_to_torch_ops():
    """The norms' DTensor check reads sys.modules instead of importing torch.distributed.tensor (~0.8 s on a
    first forward); DTensor operands, which exist only once it is imported, still take the torch ops."""
    code = ("import sys, torch\n"
            "from harts.ops.norm import _use_fast, gated_rms_norm, rms_norm\n"
            "x, w = torch.randn(5, 8), torch.ones(8)\n"
            "rms_norm(x, w, 1e-6); gated_rms_norm(x, x, w, 1e-6); _use_fast('fast', x, w)\n"
            "print('torch.distributed.tensor' in sys.modules)\n"
            "import torch.distributed as dist\n"
            "from torch.distributed.tensor import DTensor, Replicate, init_device_mesh\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "d = DTensor.from_local(x, init_device_mesh('cpu', (1,)), [Replicate()])\n"
            "print(_use_fast('fast', d, w))\n"
            "dist.destroy_process_group()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_mtp_weights_are_refused_unless_dropped(tmp_path):
    """A released checkpoint with a multi-token-prediction layer (model.layers.{num_hidden_layers}.*)."""
    from safetensors.torch import save_file

    model = small_model(16)
    save_pretrained(model, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    key = f"model.layers.{model.config.num_hidden_layers}.enorm.weight"
    save_file({key: torch.ones(model.config.hidden_size)}, str(tmp_path / "mtp.safetensors"))
    index["weight_map"][key] = "mtp.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"multi-token-prediction.*{key}.*drop_mtp=True"):
        load_pretrained(tmp_path)
    back = load_pretrained(tmp_path, drop_mtp=True)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
