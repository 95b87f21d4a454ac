"""The HARTS verl engine (harts.integrations.verl) against verl's own FSDP engine, on CPU in float64.

One ``forward_backward_batch`` of ``HartsEngineWithLMHead`` (prefix-shared micro-batches through
``harts.pack`` and the compact path) against one of verl 0.9.1's ``FSDPEngineWithLMHead`` on the same
TensorDict with the same loss function (verl's ``ppo_loss`` with an entropy bonus): verl's engine runs its
own input preparation (remove-padding packing, ``cu_seqlens``), its log-softmax and entropy over full logits
and its nested outputs, around the same HARTS model's trajectory-wise packed forward (verl builds an HF
AutoModel in ``_build_module``; the reference subclass hands it the HARTS model behind an HF-style forward,
since transformers' Ling / Qwen3.5 classes compute in float32 internally and could not show a 1e-10
agreement). Loss, every per-token log-prob and entropy (all entries of verl's layout, each sample's last
included) agree to TOL relative, every parameter gradient to GRAD_TOL.

verl has no CPU platform (it falls back to CUDA), so the test registers a minimal one (``_CPUPlatform``)
before importing verl's engines, runs a one-process gloo group, and lets float64 through verl's precision
names (``PrecisionType.to_dtype``), which stop at fp32. The reference engine runs unsharded: verl's FSDP2 plan
crashes in backward on gloo (see ``_VerlReference._build_fsdp_module``); the HARTS engine runs its FSDP2 plan.
"""
from __future__ import annotations

import types
from contextlib import contextmanager

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is optional: pip install 'harts[verl]' (docs/verl.md)")
if verl.__version__ != "0.9.1":
    pytest.skip(f"written for verl 0.9.1, found {verl.__version__}", allow_module_level=True)

from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.plugin.platform.platform_manager import set_platform  # noqa: E402


class _CPUPlatform(PlatformBase):
    """Just enough of a verl platform for one CPU process on gloo."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = types.SimpleNamespace(is_available=lambda: True, memory_allocated=lambda: 0,
                                          memory_reserved=lambda: 0, max_memory_allocated=lambda: 0,
                                          max_memory_reserved=lambda: 0, empty_cache=lambda: None,
                                          synchronize=lambda *a: None, mem_get_info=lambda *a: (0, 0))

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


set_platform(_CPUPlatform())

from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.torch_dtypes import PrecisionType  # noqa: E402
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from harts.integrations.verl import HartsEngineConfig, HartsEngineWithLMHead, micro_batch_trajectories  # noqa: E402
from harts.models.family import family_of, model_config  # noqa: E402

_to_dtype = PrecisionType.to_dtype
# float64 rounding of the compact path against the trajectory-wise one, for the loss, every per-token output
# and every parameter gradient (the temperature is verl's float32-rounded value on both sides)
TOL = 1e-10
GRAD_TOL = 1e-10


def _to_dtype64(precision):
    return torch.float64 if precision in ("fp64", torch.float64) else _to_dtype(precision)


@pytest.fixture(scope="module", autouse=True)
def _gloo(tmp_path_factory):
    PrecisionType.to_dtype = staticmethod(_to_dtype64)
    started = not torch.distributed.is_initialized()
    if started:
        store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    PrecisionType.to_dtype = staticmethod(_to_dtype)
    if started:
        torch.distributed.destroy_process_group()


class _PackedCausalLM(torch.nn.Module):
    """The HARTS model behind the forward verl's engine calls on an HF model with remove-padding input:
    (1, T) packed ids and positions plus cu_seqlens in, (1, T, V) logits out; the trajectory-wise packed path."""

    _no_split_modules = ["DecoderLayer"]

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids, position_ids, attention_mask=None, cu_seqlens=None, cu_seqlens_cpu=None,
                use_cache=False):
        assert attention_mask is None and cu_seqlens is not None
        h = self.model(input_ids[0], position_ids[0], cu_seqlens)
        return types.SimpleNamespace(logits=self.model.logits(h)[None])


class _VerlReference(FSDPEngineWithLMHead):
    """verl's FSDP engine, its HF AutoModel replaced by the HARTS model's packed forward (module docstring)."""

    def _build_module(self):
        return _PackedCausalLM(family_of(self.harts_config).load_pretrained(self.model_config.local_path,
                                                                            dtype=torch.float64, backend="reference"))

    def _build_fsdp_module(self, module):
        # unsharded: verl's apply_fsdp2 plan (embedding and lm_head as their own units) crashes in backward on gloo
        # (a segmentation fault in torch 2.13's CPU autograd); one process's FSDP2 computes the same values anyway
        return module


def _checkpoint(tmp_path, preset):
    torch.manual_seed(0)
    cfg = model_config(preset, backend="reference")
    fam = family_of(cfg)
    model = fam.model_class(cfg).double()
    with torch.no_grad():  # non-trivial norms, so a lost row or position shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    fam.save_pretrained(model, tmp_path)
    return cfg


def _engine(cls, path, cfg):
    model_cfg = HFModelConfig(path=str(path), load_tokenizer=False, enable_gradient_checkpointing=False,
                              use_remove_padding=True)
    kw = dict(model_dtype="fp64", mixed_precision={"param_dtype": "fp64", "reduce_dtype": "fp64",
                                                   "buffer_dtype": "fp64"},
              use_torch_compile=False, use_dynamic_bsz=False)
    if cls is HartsEngineWithLMHead:
        engine_cfg = HartsEngineConfig(model_overrides={"backend": "reference"}, **kw)
    else:
        engine_cfg = FSDPEngineConfig(strategy="fsdp2", **kw)
    engine = cls.__new__(cls)
    engine.harts_config = cfg
    engine.__init__(model_cfg, engine_cfg, FSDPOptimizerConfig(lr=1e-3, total_training_steps=1), CheckpointConfig())
    engine.initialize()
    if cls is _VerlReference:  # verl enters torch.autocast for any param dtype but fp32; fp64 has none on CPU
        engine._autocast_dtype = torch.float32
    return engine


def _samples(case, vocab, rng):
    """(prompt, response) token lists: groups of responses sharing a prompt, or a multi-turn conversation whose
    later turns' prompts are the earlier turns' full histories."""
    tok = lambda n: rng.integers(3, vocab, n).tolist()
    if case == "groups":  # two prompts, three responses each (one response repeated: identical samples)
        out = []
        for plen, rlens in ((7, (5, 9, 5)), (11, (3, 6, 8))):
            p = tok(plen)
            rs = [tok(n) for n in rlens]
            rs[2] = rs[0] if rlens[2] == rlens[0] else rs[2]
            out += [(p, r) for r in rs]
        return out
    system, u1, a1, u2, a2, u3, a3 = tok(6), tok(4), tok(7), tok(3), tok(9), tok(5), tok(4)
    other = tok(10)
    return [(system + u1, a1), (system + u1 + a1 + u2, a2), (system + u1 + a1 + u2 + a2 + u3, a3),
            (system + u1, tok(5)), (other, tok(6)), (other[:4], tok(3))]


def _data(samples, rng, temperature, micro):
    """verl's actor batch: left-padded prompts, right-padded responses, then verl's own no-padding conversion."""
    from tensordict import TensorDict

    N = len(samples)
    P, R = max(len(p) for p, _ in samples), max(len(r) for _, r in samples)
    ids, mask = torch.zeros(N, P + R, dtype=torch.long), torch.zeros(N, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(samples):
        ids[i, P - len(p):P], ids[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        mask[i, P - len(p):P + len(r)] = 1
    resp_mask = mask[:, P:].clone()
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    old = -torch.rand(N, R, dtype=torch.float64, generator=g) * 3 - 0.5
    adv = torch.randn(N, R, dtype=torch.float64, generator=g)
    td = TensorDict({"prompts": ids[:, :P], "responses": ids[:, P:], "input_ids": ids, "attention_mask": mask,
                     "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "response_mask": resp_mask,
                     "old_log_probs": old * resp_mask, "advantages": adv * resp_mask}, batch_size=[N])
    td = left_right_2_no_padding(td)
    if isinstance(temperature, torch.Tensor):
        td["temperature"] = temperature
    else:
        tu.assign_non_tensor(td, temperature=temperature)
    tu.assign_non_tensor(td, calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro,
                         global_batch_size=N, return_model_output=True)
    return td


def _rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def _grads(engine, strip):
    out = {}
    for n, p in engine.module.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[n.removeprefix(strip)] = g
    return out


@pytest.mark.parametrize("preset,case,temperature", [
    ("ling3-tiny-debug", "groups", 0.7),
    ("ling3-tiny-debug", "multiturn", 1.0),
    ("qwen3.5-debug", "multiturn", 0.7),
    ("qwen3.5-debug", "groups", 1.0),
])
def test_forward_backward_equals_verl_engine(tmp_path, preset, case, temperature):
    cfg = _checkpoint(tmp_path, preset)
    rng = np.random.default_rng(3)
    samples = _samples(case, cfg.vocab_size, rng)
    actor = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=len(samples), use_dynamic_bsz=False,
                            ppo_micro_batch_size_per_gpu=3, entropy_coeff=0.01, loss_agg_mode="token-mean",
                            rollout_n=3)
    loss_fn = lambda **kw: ppo_loss(actor, **kw)

    results = {}
    for cls in (HartsEngineWithLMHead, _VerlReference):
        engine = _engine(cls, tmp_path, cfg)
        td = _data(samples, np.random.default_rng(5), temperature, micro=3)
        with engine.train_mode(zero_grad_on_exit=False):
            out = engine.forward_backward_batch(td, loss_fn, forward_only=False)
            results[cls] = (out, _grads(engine, "model." if cls is _VerlReference else ""))
        if cls is HartsEngineWithLMHead:  # the micro-batches really shared rows
            stats = engine.last_pack_stats
            assert stats["compact_rows"] < stats["raw_tokens"], stats
    (mine, g_mine), (ref, g_ref) = results[HartsEngineWithLMHead], results[_VerlReference]
    assert len(mine["loss"]) == len(ref["loss"]) == 2
    for a, b in zip(mine["loss"], ref["loss"]):
        assert abs(a - b) <= TOL * abs(b), (a, b)
    for key in ("log_probs", "entropy"):
        a, b = mine["model_output"][key], ref["model_output"][key]
        assert torch.equal(a.offsets(), b.offsets())
        assert _rel(a.values(), b.values()) <= TOL, key
    assert g_mine.keys() == g_ref.keys()
    worst = max(((_rel(g_mine[n], g), n) for n, g in g_ref.items()))
    assert all(g.abs().max() > 0 for g in g_ref.values())
    assert worst[0] <= GRAD_TOL, worst


def test_registry_and_refusals(tmp_path):
    assert EngineRegistry.get_engine_cls("language_model", "harts") is HartsEngineWithLMHead
    ids = torch.nested.as_nested_tensor([torch.tensor([5, 6, 7]), torch.tensor([5, 6])], layout=torch.jagged)
    trajs = micro_batch_trajectories(ids)  # each sample + the next sample's first token (verl's rolled target)
    assert [t.tokens.tolist() for t in trajs] == [[5, 6, 7, 5], [5, 6, 5]]
    bad = torch.nested.as_nested_tensor([torch.tensor([0, 1, 2]), torch.tensor([3, 4])], layout=torch.jagged)
    with pytest.raises(ValueError, match="sample 1 has position id 3 at token 0"):
        micro_batch_trajectories(ids, bad)
    cfg = _checkpoint(tmp_path, "ling3-tiny-debug")
    engine = _engine(HartsEngineWithLMHead, tmp_path, cfg)
    td = _data([([5, 6, 7], [8, 9]), ([5, 6, 7], [10])], np.random.default_rng(0), torch.tensor([0.5, 1.0]), 2)
    with pytest.raises(ValueError, match="temperature differs between the samples"):
        engine.forward_backward_batch(td, lambda **kw: ppo_loss(None, **kw), forward_only=True)
    # the rollout engine's weight sync: the HF names and tensors save_pretrained writes
    from harts.models.ling.checkpoint import read_hf_tensors

    saved = read_hf_tensors(tmp_path)
    synced = dict(engine.get_per_tensor_param()[0])
    assert synced.keys() == saved.keys()
    assert all(torch.equal(synced[k], saved[k]) for k in saved)
