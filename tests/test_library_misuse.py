"""Misuse of the library API fails at once, in one line that names the argument and the fix.

- ``batch.split`` refuses a tensor of another length than the batch's log-prob positions (it used to
  truncate); ``batch.to`` refuses a dtype or a non-device where a device goes.
- ``router_stats()`` / ``moe_counts()`` refuse before any forward; after a forward under ``torch.no_grad``
  they are that forward's (the documented semantics), and ``require_grad=True`` refuses them.
- Packed inputs: ``cu_seqlens`` must run from 0 to T, non-decreasing; inputs and batches must be on the
  model's device; the hidden states and the LM head must share a dtype.
- A batch without log-prob positions gives an empty log-prob tensor on the graph: backward runs and every
  gradient is zero.
"""
import numpy as np
import pytest
import torch

from harts.data import Trajectory
from harts.models.ling import LingConfig, LingForCausalLM
from harts.runtime import pack

VOCAB = 512


def small_model(**overrides) -> LingForCausalLM:
    cfg = LingConfig.preset("ling3-tiny-debug", backend="reference", kda_chunk_size=16, num_hidden_layers=4,
                            **overrides)
    torch.manual_seed(0)
    return LingForCausalLM(cfg).double()


@pytest.fixture(scope="module")
def model():
    return small_model()


def trees(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    root = rng.integers(0, VOCAB, 40).tolist()
    return [root] + [root[:p] + rng.integers(0, VOCAB, 6).tolist() for p in (13, 21)]


def packed(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + np.cumsum(lengths).tolist())
    return ids, pos, cu


# ------------------------------------------------------------------ CompactBatch.split / .to
@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_split_refuses_a_tensor_of_another_length(prefix_sharing):
    trajs = trees()
    batch = pack(trajs, chunk_size=16, prefix_sharing=prefix_sharing)
    n = sum(len(t) - 1 for t in trajs)
    parts = batch.split(torch.arange(n))
    assert [len(p) for p in parts] == [len(t) - 1 for t in trajs]
    assert torch.equal(torch.cat(parts), torch.arange(n))
    for bad in (n - 1, n + 1, 0):
        with pytest.raises(ValueError, match=rf"values has {bad} entries along dim 0, expected {n} entries"):
            batch.split(torch.zeros(bad))
    with pytest.raises(ValueError, match=rf"values has no dim 0, expected {n} entries"):
        batch.split(torch.tensor(1.0))


def test_to_refuses_a_dtype_where_a_device_goes():
    batch = pack(trees(), chunk_size=16)
    with pytest.raises(TypeError, match=r"CompactBatch.to\(torch.float64\): expected a device .* got a dtype"):
        batch.to(torch.float64)
    with pytest.raises(TypeError, match=r"CompactBatch.to\(None\): expected a device .* got NoneType"):
        batch.to(None)
    moved = batch.to("cpu")
    assert moved.input_ids.dtype == torch.long and moved.device == torch.device("cpu")


def assert_same_batch(a, b):
    from dataclasses import fields

    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif f.name == "rounds":
            for ra, rb in zip(x, y, strict=True):
                for g in fields(ra):
                    u, v = getattr(ra, g.name), getattr(rb, g.name)
                    assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, g.name
        elif f.name == "trajectories":
            assert all(np.array_equal(u.tokens, v.tokens) for u, v in zip(x, y, strict=True))
        elif f.name != "derived":
            assert x == y, f.name


def test_pack_lays_out_a_ready_plan_and_refuses_another_microbatchs():
    """``pack(..., plan=)`` lays out a call plan made earlier: the same batch as pack planning itself; a plan of
    other trajectories, another chunk size or for the trajectory-wise batch is refused, naming what differs."""
    from harts.planning.calls import plan_calls

    trajs = trees()
    plan = plan_calls(trajs, chunk_size=16)
    assert_same_batch(pack(trajs, chunk_size=16), pack(trajs, chunk_size=16, plan=plan))
    other = [t.copy() for t in trajs]
    other[2][24] = (other[2][24] + 1) % VOCAB
    with pytest.raises(ValueError, match="trajectory 2 differs from the plan's at position 24"):
        pack(other, chunk_size=16, plan=plan)
    with pytest.raises(ValueError, match="the plan is of 3 trajectories, the batch has 2"):
        pack(trajs[:2], chunk_size=16, plan=plan)
    with pytest.raises(ValueError, match="trajectory 1 has 18 tokens, the plan's 19"):
        pack([trajs[0], trajs[1][:-1], trajs[2]], chunk_size=16, plan=plan)
    with pytest.raises(ValueError, match="the plan was made for chunk_size=16, the batch needs 32"):
        pack(trajs, chunk_size=32, plan=plan)
    with pytest.raises(ValueError, match="trajectory-wise batch .* takes no call plan"):
        pack(trajs, prefix_sharing=False, plan=plan)
    with pytest.raises(TypeError, match="plan must be a CallPlan"):
        pack(trajs, chunk_size=16, plan=[plan])


def test_pack_on_its_threads_equals_pack_on_one(monkeypatch):
    """pack runs its independent passes on a thread pool: the batch is the one a single thread lays out, and a
    bad input is refused with the same error (the input checks run on the pool too)."""
    import harts.runtime.batch as batch_mod
    from harts.planning.calls import plan_calls

    trajs = trees()
    plan = plan_calls(trajs, chunk_size=16)
    assert batch_mod.pack_pool() is not None  # CI and GPU hosts have more than one core
    threaded = pack(trajs, chunk_size=16, plan=plan, vocab_size=VOCAB)
    monkeypatch.setattr(batch_mod, "pack_pool", lambda: None)
    assert_same_batch(threaded, pack(trajs, chunk_size=16, plan=plan, vocab_size=VOCAB))
    monkeypatch.undo()
    bad = [t.copy() for t in trajs]
    bad[1][3] = VOCAB
    with pytest.raises(ValueError, match=rf"trajectory 1 position 3: token id {VOCAB} is out of range"):
        pack(bad, chunk_size=16, plan=plan, vocab_size=VOCAB)


def test_pack_threads_come_from_the_environment(monkeypatch):
    """HARTS_PACK_THREADS sets the pool's size, 0 packs on the caller's thread alone (same batch), and a value
    that is not a count >= 0 is refused naming the variable."""
    import dataclasses

    import harts.runtime.batch as batch_mod
    from harts.planning.calls import plan_calls

    trajs = trees()
    plan = plan_calls(trajs, chunk_size=16)
    want = pack(trajs, chunk_size=16, plan=plan)
    monkeypatch.setattr(batch_mod, "_POOL", batch_mod._POOL)  # restored afterwards, with the default pool
    for value, threads in (("0", 0), ("2", 2)):
        monkeypatch.setattr(batch_mod, "ENV", dataclasses.replace(batch_mod.ENV, pack_threads=value))
        assert batch_mod.pack_threads() == threads
        assert (batch_mod.pack_pool() is None) == (threads == 0)
        assert_same_batch(want, pack(trajs, chunk_size=16, plan=plan))
    for bad in ("-1", "two"):
        monkeypatch.setattr(batch_mod, "ENV", dataclasses.replace(batch_mod.ENV, pack_threads=bad))
        with pytest.raises(ValueError, match=rf"HARTS_PACK_THREADS='{bad}': expected a number of threads >= 0"):
            pack(trajs, chunk_size=16, plan=plan)


def test_pack_pool_is_made_anew_in_a_forked_child(monkeypatch):
    """A forked child (a data-loader worker) has none of its parent's threads: a pool made in another process
    is replaced, not handed jobs that no thread would run."""
    import harts.runtime.batch as batch_mod

    parent = batch_mod.pack_pool()
    assert batch_mod.pack_pool() is parent
    monkeypatch.setattr(batch_mod, "_POOL", batch_mod._POOL)  # restored afterwards, with the parent's pool
    monkeypatch.setattr(batch_mod.os, "getpid", lambda: -1)
    child = batch_mod.pack_pool()
    try:
        assert child is not parent and child.submit(sum, (1, 2)).result(timeout=10) == 3
    finally:
        child.shutdown()


# ------------------------------------------------------------------ router statistics
def test_router_stats_before_any_forward_raise():
    m = small_model()
    for call in (m.router_stats, m.moe_counts, lambda: m.update_expert_bias(1e-3)):
        with pytest.raises(RuntimeError, match=r"no forward has run yet; call the model"):
            call()


def test_router_stats_are_the_last_forward_whatever_its_grad_mode(model):
    a, b = pack(trees(1), config=model.config), pack(trees(2)[:2], config=model.config)
    model(layout=a)
    stats_a = model.router_stats(require_grad=True)
    assert all(s.z_loss.requires_grad for s in stats_a)
    k = model.config.num_experts_per_tok
    assert torch.equal(model.moe_counts().sum(1), torch.full((len(stats_a),), float(a.multiplicity.sum() * k),
                                                             dtype=torch.float64))
    with torch.no_grad():
        model(layout=b)
    stats_b = model.router_stats()
    # the no-grad forward's statistics: b's rows, weighted by b's multiplicities, without a graph
    assert all(sb is not sa for sa, sb in zip(stats_a, stats_b))
    assert all(not s.z_loss.requires_grad for s in stats_b)
    assert torch.equal(model.moe_counts().sum(1), torch.full((len(stats_b),), float(b.multiplicity.sum() * k),
                                                             dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"require_grad=True\): the last forward ran without grad"):
        model.router_stats(require_grad=True)


# ------------------------------------------------------------------ packed inputs
@pytest.mark.parametrize("cu, msg", [
    ([0, 5, 9], r"cu_seqlens must run from 0 to T = len\(input_ids\) = 12, got 0 \.\. 9"),
    ([0, 5, 14], r"cu_seqlens must run from 0 to T = len\(input_ids\) = 12, got 0 \.\. 14"),
    ([2, 5, 12], r"cu_seqlens must run from 0 to T = len\(input_ids\) = 12, got 2 \.\. 12"),
    ([0, 7, 5, 12], r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 7 > cu_seqlens\[2\] = 5"),
])
def test_cu_seqlens_must_run_from_zero_to_T(model, cu, msg):
    ids, pos, _ = packed([5, 7])
    with pytest.raises(ValueError, match=msg):
        model(ids, pos, torch.tensor(cu))
    model(ids, pos, torch.tensor([0, 5, 12]))  # the right offsets run


def test_inputs_on_another_device_are_refused(model):
    ids, pos, cu = packed([5, 7])
    for i, name in enumerate(("input_ids", "position_ids", "cu_seqlens")):
        args = [ids, pos, cu]
        args[i] = args[i].to("meta")
        with pytest.raises(ValueError, match=rf"^{name} is on meta but the model is on cpu: move the inputs"):
            model(*args)
    batch = pack(trees(), config=model.config)
    with pytest.raises(ValueError, match=r"^CompactBatch is on meta but the model is on cpu: move it with batch.to"):
        model.logprobs(batch.to("meta"))


def test_lm_head_dtype_must_match_the_hidden_states(model):
    ids, pos, cu = packed([6])
    with torch.no_grad():
        h = model(ids, pos, cu)
        with pytest.raises(TypeError, match=r"hidden states are torch.float32 but lm_head.weight is torch.float64"):
            model.token_logprobs(h.float(), ids.roll(-1))
        mixed = small_model()
        mixed.lm_head.float()
        with pytest.raises(TypeError, match=r"hidden states are torch.float64 but lm_head.weight is torch.float32"):
            mixed.logprobs(pack(trees(), config=mixed.config))


# ------------------------------------------------------------------ no log-prob positions
@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_batch_without_logprob_positions_backpropagates_zero_gradients(prefix_sharing):
    m = small_model()
    trajs = [Trajectory(tokens=np.array([5]), advantage=1.0), Trajectory(tokens=np.array([9]), advantage=-1.0)]
    batch = pack(trajs, config=m.config, prefix_sharing=prefix_sharing)
    lp = m.logprobs(batch)
    assert lp.shape == (0,) and lp.dtype == torch.float64 and lp.requires_grad
    assert [p.numel() for p in batch.split(lp)] == [0, 0]
    loss = -(lp * batch.semantic("advantages")).sum()
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert all(not g.any() for g in grads.values()), [n for n, g in grads.items() if g.any()]


@pytest.mark.gpu
def test_host_inputs_for_a_gpu_model_are_refused():
    m = small_model().cuda()
    ids, pos, cu = packed([5, 7])
    with pytest.raises(ValueError, match=r"^input_ids is on cpu but the model is on cuda:0: move the inputs"):
        m(ids, pos, cu)
    with pytest.raises(ValueError, match=r"^cu_seqlens is on cpu but the model is on cuda:0"):
        m(ids.cuda(), pos.cuda(), cu)
    batch = pack(trees(), config=m.config)
    with pytest.raises(ValueError, match=r"^CompactBatch is on cpu but the model is on cuda:0: move it with "
                                         r"batch.to\('cuda:0'\)"):
        m.logprobs(batch)
    with torch.no_grad():
        lp = m.logprobs(batch.to("cuda"))
    assert lp.shape == (batch.logprob_rows.shape[0],) and lp.is_cuda
