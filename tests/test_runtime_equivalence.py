"""The strongest test: on CPU in float64, HARTS equals ordinary trajectory-wise training.

The independent reference is the model's ordinary packed forward over each trajectory separately
(``pack(..., prefix_sharing=False)``): no trie, no rounds, no boundary states, no MLA views. HARTS runs
the same model on the compact layout. Log-probs, every parameter's gradient under a GRPO-style loss with
per-position advantages and masks, and the multiplicity-weighted MoE statistics must agree.
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts.runtime import logprobs, pack
from tests.helpers import VOCAB, drop_replay, fork_tree, make_model


def grpo_loss(lp_S, adv_S, mask_S):
    """Token-level policy-gradient surrogate with per-position advantages and a loss mask."""
    return -(adv_S * mask_S * lp_S).sum() / mask_S.sum().clamp_min(1.0)


def run(model, batch, adv_S, mask_S):
    model.zero_grad(set_to_none=True)
    lp = logprobs(model, batch)
    loss = grpo_loss(lp, adv_S, mask_S)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = model.router_stats()
    return lp.detach(), grads, stats


def assert_equivalent(trajs, chunk_size, recompute=False, seed=0):
    model = make_model(chunk_size, recompute, seed)
    hb = pack(trajs, chunk_size=chunk_size)
    bb = pack(trajs, chunk_size=chunk_size, prefix_sharing=False)
    assert hb.logprob_rows.shape == bb.logprob_rows.shape
    assert torch.equal(hb.logprob_targets, bb.logprob_targets)  # same targets, original order
    # the log-prob op runs once per distinct (row, target) pair (brute force over the positions)
    pairs = list(zip(hb.logprob_pair_rows.tolist(), hb.logprob_pair_targets.tolist()))
    assert len(pairs) == len(set(pairs)) == len(set(zip(hb.logprob_rows.tolist(), hb.logprob_targets.tolist())))
    assert torch.equal(hb.logprob_pair_rows[hb.logprob_pair_of], hb.logprob_rows)
    assert torch.equal(hb.logprob_pair_targets[hb.logprob_pair_of], hb.logprob_targets)
    assert bb.logprob_pair_of is None
    g = torch.Generator().manual_seed(seed + 1)
    n = hb.logprob_rows.shape[0]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) < 0.7).double()
    lp_h, g_h, st_h = run(model, hb, adv, mask)
    lp_b, g_b, st_b = run(model, bb, adv, mask)
    rel = ((lp_h - lp_b).abs().max() / lp_b.abs().max()).item()
    assert rel <= 1e-9, f"log-probs differ: relative {rel:.3e}"
    assert g_h.keys() == g_b.keys()
    for name in g_b:
        scale = g_b[name].abs().max().item()
        err = (g_h[name] - g_b[name]).abs().max().item()
        assert err <= 1e-9 * max(scale, 1e-12), f"grad {name}: {err:.3e} vs scale {scale:.3e}"
    for layer, (a, b) in enumerate(zip(st_h, st_b)):
        assert torch.equal(a.counts_E, b.counts_E), f"MoE layer {layer}: weighted counts differ"
        assert a.weight_sum.item() == b.weight_sum.item() == sum(len(t) for t in trajs)
        assert abs(a.z_loss.item() - b.z_loss.item()) <= 1e-12 * max(1.0, abs(b.z_loss.item()))
        assert abs(a.aux_loss.item() - b.aux_loss.item()) <= 1e-12 * max(1.0, abs(b.aux_loss.item()))
    return hb


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_fork_tree_equals_trajectory_wise(chunk_size):
    trajs = fork_tree(chunk_size, np.random.default_rng(chunk_size))
    hb = assert_equivalent(trajs, chunk_size)
    assert hb.stats["replay_tokens"] > 0 and hb.stats["boundary_states"] > 0  # the test exercises handoffs
    assert hb.stats["compact_rows"] < hb.stats["raw_tokens"]


def test_fork_tree_equals_trajectory_wise_with_recomputation():
    assert_equivalent(fork_tree(4, np.random.default_rng(7)), 4, recompute=True)


@st.composite
def rollout_forests(draw, B=4):
    """Several trees; forks biased to B-1, B, B+1 (and their multiples), fan-out up to 4, prefix
    trajectories and duplicates."""
    trajs = []
    for _ in range(draw(st.integers(1, 3))):
        root = draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=4 * B))
        paths = [root]
        for _ in range(draw(st.integers(0, 5))):
            src = paths[draw(st.integers(0, len(paths) - 1))]
            kind = draw(st.sampled_from(["fork", "fork", "fork", "prefix", "duplicate"]))
            if kind == "prefix":
                paths.append(src[: draw(st.integers(1, len(src)))])
            elif kind == "duplicate":
                paths.append(list(src))
            else:
                m = draw(st.sampled_from([1, 2]))
                p = draw(st.sampled_from([m * B - 1, m * B, m * B + 1, draw(st.integers(1, len(src)))]))
                p = min(p, len(src))
                tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2 * B))
                if p < len(src):
                    tail[0] = (src[p] + 1 + tail[0] % (VOCAB - 1)) % VOCAB
                paths.append(src[:p] + tail)
        trajs.extend(paths)
    return [trajs[i] for i in draw(st.permutations(range(len(trajs))))]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollout_forests())
def test_random_forests_equal_trajectory_wise(trajs):
    assert_equivalent(trajs, 4)


def test_logprob_pairs_expand_to_the_layouts_rows_and_targets():
    """One pair per distinct (row, target), one per row with a parent; expanded by pair_of they are the layout's
    own log-prob rows and targets (built apart, in logprob_views). A layout whose targets or next rows disagree
    is refused by its validate()."""
    from dataclasses import replace

    from harts.data import Trajectory
    from harts.planning.calls import plan_calls
    from harts.planning.layout import build_layout
    from harts.runtime.batch import logprob_pairs

    trajs = [[1, 2, 3, 4], [1, 2, 9], [1, 2, 3, 7]]
    plan = plan_calls([np.array(t) for t in trajs], chunk_size=4)
    lay = build_layout(plan, conv_width=4)
    rows, targets, of = logprob_pairs(lay.logprob_next_rows, lay.parent_phys, lay.tokens)
    assert rows.size == 5 < lay.logprob_rows.size == 8  # 1->2, 2->3, 2->9, 3->4, 3->7
    np.testing.assert_array_equal(rows[of], lay.logprob_rows)
    np.testing.assert_array_equal(targets[of], lay.logprob_targets)
    assert sorted(zip(lay.tokens[rows].tolist(), targets.tolist())) == [(1, 2), (2, 3), (2, 9), (3, 4), (3, 7)]
    wrong = lay.logprob_targets.copy()
    wrong[4] += 1  # trajectory 1, position 1 (predicting 9)
    with pytest.raises(ValueError, match="logprob_targets"):
        replace(lay, logprob_targets=wrong).validate(plan)
    with pytest.raises(ValueError, match="logprob_next_rows"):
        replace(lay, logprob_next_rows=lay.logprob_rows).validate(plan)
    b = pack([Trajectory.create(t) for t in trajs], chunk_size=4)
    assert b.stats["logprob_pairs"] == 5


def test_round_pieces_rebuild_the_gather_and_refuse_another_order():
    from harts.planning.calls import plan_calls
    from harts.planning.layout import build_layout
    from harts.runtime.batch import round_pieces

    B = 4
    lay = build_layout(plan_calls([np.asarray(t) for t in fork_tree(B, np.random.default_rng(3))], chunk_size=B))
    replayed = 0
    for r in lay.rounds:
        own, replay, rows = round_pieces(r.cu_seqlens, r.is_output, r.gather, r.phys_start)
        it, start, parts = iter(rows.tolist()), r.phys_start, []
        for n_rep, n_own in zip(replay, own):  # brute force: replay rows, then the next own rows
            parts += [next(it) for _ in range(n_rep)] + list(range(start, start + n_own))
            start += n_own
        assert parts == r.gather.tolist() and start == r.phys_end
        replayed += sum(replay)
        if sum(replay):
            t = int(np.flatnonzero(~r.is_output)[0])  # sequence n's first replay position
            n = int(np.searchsorted(r.cu_seqlens, t, side="right")) - 1
            swapped = r.is_output.copy()
            swapped[[t, t + replay[n]]] = swapped[[t + replay[n], t]]  # an own row before a replay row
            with pytest.raises(ValueError, match=f"input position {t} "):
                round_pieces(r.cu_seqlens, swapped, r.gather, r.phys_start)
    assert replayed == lay.replay_tokens > 0


def test_compact_batch_split_and_metadata():
    from harts.data import Trajectory

    trajs = [Trajectory.create([1, 2, 3, 4], advantage=0.5, loss_mask=[0, 1, 1, 0]),
             Trajectory.create([1, 2, 9], advantage=-1.0, loss_mask=[0, 0, 1])]
    b = pack(trajs, chunk_size=4)
    assert b.num_rows == 5 and b.num_trajectories == 2
    adv = b.semantic("advantages")
    assert adv.tolist() == [0.5, 0.5, 0.5, -1.0, -1.0]
    assert [x.tolist() for x in b.split(b.semantic("loss_mask"))] == [[1, 1, 0], [0, 1]]
    assert [x.tolist() for x in b.split(b.logprob_targets)] == [[2, 3, 4], [2, 9]]
    with pytest.raises(KeyError, match="old_logprobs"):
        b.semantic("old_logprobs")


def test_no_replay_ablation_and_broken_handoffs():
    """replay=False (exact state at the fork, chunk grid restarted there) equals the baseline in float64
    up to rounding; a handoff that skips the mandatory replay, or drops the boundary state, is caught."""
    B = 4
    trajs = fork_tree(B, np.random.default_rng(3))
    model = make_model(B)
    base = logprobs(model, pack(trajs, chunk_size=B, prefix_sharing=False)).detach()
    nr = pack(trajs, chunk_size=B, replay=False)
    assert nr.stats["replay_tokens"] > 0 and not nr.replay
    lp_nr = logprobs(model, nr).detach()
    assert ((lp_nr - base).abs().max() / base.abs().max()).item() <= 1e-9
    hb = pack(trajs, chunk_size=B)
    for broken in (drop_replay(hb), _zero_states(hb)):
        lp = logprobs(model, broken).detach()
        assert ((lp - base).abs().max() / base.abs().max()).item() > 1e-6


def _zero_states(batch):
    from dataclasses import replace

    return replace(batch, rounds=tuple(replace(r, init_source=torch.full_like(r.init_source, -1), has_init=False)
                                       for r in batch.rounds))
