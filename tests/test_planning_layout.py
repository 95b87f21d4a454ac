"""Compact execution layout: round trips against trajectory-wise execution.

Every check runs the layout the way the runtime will (index arrays only, no tree) and compares with an
independent per-trajectory computation: token gathers, an order-sensitive recurrence standing in for
KDA (with chunk-boundary state hand-offs between rounds), a causal convolution, the MLA visibility
matrix against an explicit dense causal mask, and the log-prob map.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts.planning.calls import plan_calls
from harts.planning.layout import build_layout, mla_block_counts
from tests.helpers import figure2, tree_specs

MOD = (1 << 61) - 1


def step(state: int, token: int) -> int:
    """An order-sensitive recurrence: the state after a prefix identifies the prefix."""
    return (state * 1_000_003 + 7 * token + 1) % MOD


def trajectory_states(traj):
    out, s = [], 0
    for t in traj:
        s = step(s, int(t))
        out.append(s)
    return out


def run_rounds(lay):
    """Execute the KDA contract through the layout: returns the per-physical-row output of the recurrence."""
    B = lay.chunk_size
    out = np.full(lay.num_phys, -1, dtype=object)
    states: list[int] = []
    for rd in lay.rounds:
        requested = {(int(n), int(c)): int(k) for n, c, k in zip(rd.emit_seq, rd.emit_chunk, rd.emit_state)}
        produced = {}
        for n in range(rd.num_sequences):
            src = int(rd.init_source[n])
            assert src < len(states), "a round reads a state not produced by an earlier round"
            s = 0 if src < 0 else states[src]
            lo, hi = int(rd.cu_seqlens[n]), int(rd.cu_seqlens[n + 1])
            for k in range(hi - lo):
                if k % B == 0 and (n, k // B) in requested:
                    produced[requested[(n, k // B)]] = s  # the state before local token c*B
                s = step(s, int(lay.tokens[rd.gather[lo + k]]))
                if rd.is_output[lo + k]:
                    assert out[rd.gather[lo + k]] == -1, "a physical row written twice"
                    out[rd.gather[lo + k]] = s
        assert sorted(produced) == list(range(len(states), len(states) + len(produced)))
        states.extend(produced[k] for k in sorted(produced))
    assert len(states) == lay.num_states
    return out


def check_layout(trajs, B, w=4, pad=1):
    plan = plan_calls(trajs, chunk_size=B)
    lay = build_layout(plan, conv_width=w, pad_to_multiple=pad)
    lay.validate(plan)
    C, P = lay.num_rows, lay.num_phys
    assert P % pad == 0 and P - C < pad
    offs = lay.semantic_offsets
    # 1. Token round trip through the semantic map and through every round's gathers.
    for i, traj in enumerate(trajs):
        rows = lay.semantic_rows[offs[i] : offs[i + 1]]
        assert np.array_equal(lay.tokens[rows], traj)
        assert np.array_equal(lay.position_ids[rows], np.arange(len(traj)))
    for rd in lay.rounds:
        for n in range(rd.num_sequences):
            q = rd.seq_offset + n
            traj = trajs[lay.seq_trajectory[q]]
            a, e = lay.seq_replay_start[q], lay.seq_end[q]
            g = rd.gather[rd.cu_seqlens[n] : rd.cu_seqlens[n + 1]]
            assert np.array_equal(lay.tokens[g], traj[a:e])
            assert np.all(g < C), "padding gathered"
    # 2. The recurrence through rounds equals trajectory-wise execution at every semantic position.
    out = run_rounds(lay)
    assert np.all(out[C:] == -1) and all(x != -1 for x in out[:C])
    for i, traj in enumerate(trajs):
        rows = lay.semantic_rows[offs[i] : offs[i + 1]]
        assert list(out[rows]) == trajectory_states(traj)
    # 3. Causal conv over physical rows with the context windows equals the per-trajectory conv.
    x = np.zeros(P, dtype=np.int64)
    x[:C] = lay.tokens[:C] + 1
    weights = 10 ** np.arange(w)[::-1]  # newest token has weight 1: an injective window code
    y = np.full(P, -1, dtype=np.int64)
    for q in range(lay.num_sequences):
        ctx = lay.conv_context[q]
        own = x[lay.seq_cu_seqlens[q] : lay.seq_cu_seqlens[q + 1]]
        window = np.concatenate([np.where(ctx >= 0, x[np.maximum(ctx, 0)], 0), own])
        for k in range(int(lay.seq_cu_seqlens[q + 1] - lay.seq_cu_seqlens[q])):
            y[lay.seq_cu_seqlens[q] + k] = int((window[k : k + w] * weights).sum())
    for i, traj in enumerate(trajs):
        xt = np.concatenate([np.zeros(w - 1, dtype=np.int64), np.asarray(traj) + 1])
        ref = [int((xt[t : t + w] * weights).sum()) for t in range(len(traj))]
        assert list(y[lay.semantic_rows[offs[i] : offs[i + 1]]]) == ref
    # 4. MLA visibility (bottom-right causal, Eq. 22) equals the dense causal mask projected to compact rows.
    dense = np.zeros((P, P), dtype=np.int64)
    for i, traj in enumerate(trajs):
        rows = lay.semantic_rows[offs[i] : offs[i + 1]]
        for t in range(len(traj)):
            dense[rows[t], rows[: t + 1]] = 1  # query (i, t) sees (i, 0..t)
    seen = np.zeros((P, P), dtype=np.int64)
    n_q_seen = np.zeros(P, dtype=np.int64)
    for q in range(lay.num_sequences):
        qs = lay.mla_q_rows[lay.cu_seqlens_q[q] : lay.cu_seqlens_q[q + 1]]
        kv = lay.mla_kv_rows[lay.cu_seqlens_k[q] : lay.cu_seqlens_k[q + 1]]
        h = len(kv) - len(qs)
        for iq, row in enumerate(qs):
            np.add.at(seen[row], kv[: h + iq + 1], 1)
            n_q_seen[row] += 1
    assert np.all(n_q_seen[:C] == 1) and np.all(n_q_seen[C:] == 0), "each compact query exactly once"
    assert np.array_equal(seen, dense), "MLA view visibility differs from the dense causal mask"
    # 4b. The same visibility from trie ancestry alone: k visible to q iff c_k <= c_q < mla_row_end[k].
    c = lay.row_of_phys
    ancestry = (c[None, :] >= 0) & (c[None, :] <= c[:, None]) & (c[:, None] < lay.mla_row_end[None, :])
    assert np.array_equal(ancestry, dense.astype(bool)), "ancestry mask differs from the views' visibility"
    # 4c. Visible pairs per block of physical rows, for block sizes that do and do not divide P.
    for blk in (1, 3, 8):
        nb = -(-P // blk)
        padded = np.zeros((nb * blk, nb * blk), dtype=np.int64)
        padded[:P, :P] = dense
        want = padded.reshape(nb, blk, nb, blk).sum(axis=(1, 3))
        assert np.array_equal(mla_block_counts(lay, blk), want), f"block counts at block={blk}"
    # 5. Log-prob map: row of (i, t) and target token (i, t+1), in original order.
    k = 0
    for i, traj in enumerate(trajs):
        assert lay.logprob_offsets[i] == k
        for t in range(len(traj) - 1):
            row = lay.logprob_rows[k]
            assert out[row] == trajectory_states(traj[: t + 1])[-1]
            assert lay.logprob_targets[k] == traj[t + 1]
            k += 1
    assert k == lay.logprob_rows.shape[0] == lay.logprob_offsets[-1]
    # 6. Multiplicities.
    assert int(lay.multiplicity.sum()) == offs[-1]
    assert np.array_equal(np.bincount(lay.semantic_rows, minlength=P), lay.multiplicity)
    return plan, lay


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree_specs(max_internal=8), st.integers(1, 5), st.sampled_from([1, 8]))
def test_layout_round_trips_on_trees(case, w, pad):
    B, trajs = case
    check_layout([np.asarray(t) for t in trajs], B, w=w, pad=pad)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=18), min_size=1, max_size=8),
    st.sampled_from([1, 2, 3, 4, 16]),
)
def test_layout_round_trips_on_random_token_lists(trajs, B):
    check_layout([np.asarray(t) for t in trajs], B)


def test_figure2_layout():
    B = 4
    trajs = [np.asarray(t) for t in figure2(B)]
    plan, lay = check_layout(trajs, B, w=4, pad=16)
    assert lay.num_rounds == 2 and lay.num_phys == 16
    r1, r2 = lay.rounds
    # Round 2: v4 starts from the trunk's S_B (state 0) and replays position B (gathering the trunk's row).
    assert r2.num_sequences == 1 and int(r2.init_source[0]) == 0
    assert r2.replay_tokens == 1 and r1.replay_tokens == B - 1
    assert lay.position_ids[r2.gather[0]] == B and not r2.is_output[0]
    assert lay.num_states == 1 and r1.emit_chunk.tolist() == [1]


def test_validate_catches_corruption():
    B = 4
    trajs = figure2(B)
    plan = plan_calls(trajs, chunk_size=B)
    lay = build_layout(plan)
    lay.validate(plan)
    r1 = lay.rounds[0]
    g = r1.gather.copy()
    g[[1, 2]] = g[[2, 1]]
    bad = dataclasses.replace(lay, rounds=(dataclasses.replace(r1, gather=g),) + lay.rounds[1:])
    with pytest.raises(ValueError):
        bad.validate(plan)
    ctx = lay.conv_context.copy()
    ctx[-1, -1] = (ctx[-1, -1] + 1) % lay.num_rows
    with pytest.raises(ValueError):
        dataclasses.replace(lay, conv_context=ctx).validate(plan)
    kv = lay.mla_kv_rows.copy()
    kv[-1] = kv[0]
    with pytest.raises(ValueError):
        dataclasses.replace(lay, mla_kv_rows=kv).validate(plan)
    # The ancestry ranges: the root's range cut short (its last descendant falls out), the last row's overlong.
    end = lay.mla_row_end.copy()
    end[int(lay.phys_of_row[0])] -= 1
    with pytest.raises(ValueError, match="physical row"):
        dataclasses.replace(lay, mla_row_end=end).validate(plan)
    end = lay.mla_row_end.copy()
    end[int(lay.phys_of_row[lay.num_rows - 1])] = lay.num_rows + 1
    with pytest.raises(ValueError, match=rf"mla_row_end of physical row {int(lay.phys_of_row[lay.num_rows - 1])}"):
        dataclasses.replace(lay, mla_row_end=end).validate(plan)
    r2 = lay.rounds[1]
    with pytest.raises(ValueError):
        dataclasses.replace(lay, rounds=(r1, dataclasses.replace(r2, init_source=np.array([-1])))).validate(plan)


def test_bad_arguments():
    plan = plan_calls(figure2(4), chunk_size=4)
    with pytest.raises(ValueError, match="conv_width"):
        build_layout(plan, conv_width=0)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        build_layout(plan, pad_to_multiple=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=12), st.integers(1, 600))
def test_take_ranges_equals_an_arange_per_range(ranges, n):
    """Slices (few long ranges) or the index (many short ones): both are x at each range's positions, in
    order, built here with one Python arange per range; a range outside x is an IndexError naming it."""
    from harts.planning.layout import take_ranges

    x = np.arange(n, dtype=np.int64) * 7 + 3
    starts = np.array([min(a, n) for a, _ in ranges], dtype=np.int64)
    lengths = np.array([min(m, n - a) for a, (_, m) in zip(starts.tolist(), ranges)], dtype=np.int64)
    want = np.concatenate([x[np.arange(a, a + m)] for a, m in zip(starts, lengths)] + [np.zeros(0, np.int64)])
    np.testing.assert_array_equal(take_ranges(x, starts, lengths), want)
    if starts.size:
        bad = lengths.copy()
        bad[-1] = n - starts[-1] + 1
        with pytest.raises(IndexError, match=f"range {starts.size - 1} "):
            take_ranges(x, starts, bad)
