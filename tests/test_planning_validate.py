"""Planner validators and input checks: a valid plan or layout corrupted in one specific way is rejected with
a ValueError naming the offending item, also under ``python -O``; public inputs are type-checked the same way
in every planner entry point.

Every corruption below breaks one guarantee of the execution model by hand (the expected item and values are
read off the hand-built Figure 2 example, not off the validator), so each check must fire on its own.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from harts.data.trie import build_trie
from harts.planning.calls import min_calls_dp, plan_calls, plan_calls_for_trie
from harts.planning.layout import build_layout
from harts.planning.microbatch import PlanningError, plan_microbatches
from harts.planning.segments import SegmentTree

B = 4


def figure2():
    """Paper Figure 2 at B = 4: trunk v0 [0, 3) forks into v1 [3, 5) and v2 [3, 8); v1 forks into v3 [5, 8) and
    v4 [5, 7). Two rounds: round 0 runs the trunk (v0 v1 v3, sequence 0, emitting its chunk 1 = S_4) and v2
    (sequence 1, replaying [0, 3)); round 1 runs v4 (sequence 2) from S_4, replaying position 4."""
    v0, v1 = [9] * (B - 1), [1, 0]
    return [v0 + v1 + [3, 0, 0], v0 + v1 + [4, 0], v0 + [2, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def plan():
    p = plan_calls(figure2(), chunk_size=B)
    p.validate()
    return p


@pytest.fixture(scope="module")
def layout(plan):
    lay = build_layout(plan, conv_width=4, pad_to_multiple=16)
    lay.validate(plan)
    return lay


def test_figure2_plan_is_the_one_the_corruptions_assume(plan, layout):
    # Guards the hand-derived expectations below (pytest.raises still runs under -O; this check does not need to).
    assert plan.seq_round.tolist() == [0, 0, 1] and plan.seq_start.tolist() == [0, 3, 5]
    assert plan.seq_replay_start.tolist() == [0, 0, 4] and plan.seq_init.tolist() == [-1, -1, 0]
    assert plan.emit_chunks.tolist() == [1] and plan.direct_child.tolist() == [1, 2, -1, -1, -1]
    assert layout.num_rows == 15 and layout.num_phys == 16


# ---------------------------------------------------------------------------------------------- CallPlan
def _arr(values):
    return np.asarray(values, dtype=np.int64)


CALL_PLAN_CORRUPTIONS = {
    # v4 moved into round 0, the round of the state it needs.
    "round": (dict(seq_round=_arr([0, 0, 0])), r"round of sequence 2 is 0, expected 1"),
    # replay not starting at the anchor a(5) = 4.
    "replay": (dict(seq_replay_start=_arr([0, 0, 3])), r"replay_start \(must be a\(start\)\) of sequence 2 is 3, "
                                                        r"expected 4"),
    # the trunk no longer emits S_4.
    "dropped emit": (dict(emit_chunks=_arr([]), emit_offsets=_arr([0, 0, 0, 0])),
                     r"sequence 2: its initial state \(sequence 0, chunk 1\) is not emitted"),
    # v2's sequence emits a state nobody reads.
    "unused emit": (dict(emit_chunks=_arr([1, 1]), emit_offsets=_arr([0, 1, 2, 2])),
                    r"emitted states never used \(sequence, chunk\): \[\(1, 1\)\]"),
    # v0's direct continuation is v3, a grandchild.
    "direct child": (dict(direct_child=_arr([3, 2, -1, -1, -1])), r"segment 0: direct child 3 is not its child"),
    # v2 claimed by the trunk's sequence.
    "segment owner": (dict(segment_sequence=_arr([0, 0, 0, 2, 0])),
                      r"sequence owning the first segment of sequence 1 is 0, expected 1"),
    # v4 starting from its own state.
    "self init": (dict(seq_init=_arr([-1, -1, 2])), r"sequence 2 \(round 1\): initial state from sequence 2 of "
                                                    r"round 1, not an earlier round"),
    # sequence 1 (v2, outputs [3, 8)) said to run on trajectory 0, whose positions 3.. are the trunk's rows.
    "trajectory": (dict(seq_trajectory=_arr([0, 0, 1])), r"compact row \d+ is output by 2 sequences, expected 1"),
    # an empty round.
    "empty round": (dict(round_offsets=_arr([0, 3, 3]), seq_round=_arr([0, 0, 0])),
                    r"round 1 is empty"),
}


@pytest.mark.parametrize("name", list(CALL_PLAN_CORRUPTIONS))
def test_call_plan_validate_names_the_item(plan, name):
    changes, message = CALL_PLAN_CORRUPTIONS[name]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(plan, **changes).validate()


def test_call_plan_rounds_above_the_dp_minimum(plan):
    # A legal but non-optimal split: v2 (sequence 1) postponed to a third round.
    bad = dataclasses.replace(plan, round_offsets=_arr([0, 1, 2, 3]), seq_round=_arr([0, 1, 2]))
    with pytest.raises(ValueError, match=r"plan has 3 rounds, the DP minimum is 2"):
        bad.validate()


# ---------------------------------------------------------------------------------------------- ExecutionLayout
def _round(lay, r, **changes):
    rounds = list(lay.rounds)
    rounds[r] = dataclasses.replace(rounds[r], **changes)
    return dataclasses.replace(lay, rounds=tuple(rounds))


def _with(arr, index, value):
    out = np.array(arr, copy=True)
    out[index] = value
    return out


def test_layout_validate_names_the_item(plan, layout):
    lay = layout
    r0, r1 = lay.rounds
    cases = [
        # round 0 reads trunk rows 0 1 2 ...: positions 1 and 2 swapped.
        (_round(lay, 0, gather=_with(r0.gather, [1, 2], r0.gather[[2, 1]])),
         r"round 0: gathered row \(must be on the sequence's path\) of input position 1 is 2, expected 1"),
        # v4's initial state dropped although it replays from position 4.
        (_round(lay, 1, init_source=_arr([-1])),
         r"round 1: starts from the zero state \(iff replay_start == 0\) of local sequence 0 is True, expected False"),
        # the trunk asks for chunk 2 = position 8, its end.
        (_round(lay, 0, emit_chunk=_arr([2])),
         r"round 0: request 0 asks for chunk 2 of local sequence 0 \(8 inputs, B = 4\)"),
        # v4's conv window (positions 2, 3, 4) ends at another row.
        (dataclasses.replace(lay, conv_context=_with(lay.conv_context, (2, 2), lay.conv_context[2, 2] + 1)),
         rf"conv_context of sequence 2 at position 4 is row {int(lay.conv_context[2, 2]) + 1}, expected "
         rf"{int(lay.conv_context[2, 2])}"),
        # the last KV entry of v4's view (position 6) pointing at the root row.
        (dataclasses.replace(lay, mla_kv_rows=_with(lay.mla_kv_rows, -1, lay.mla_kv_rows[0])),
         rf"position id of KV entry {lay.mla_kv_rows.shape[0] - 1} is 0, expected 6"),
        # a padding row with a token.
        (dataclasses.replace(lay, tokens=_with(lay.tokens, 15, 7)), r"tokens of padding row 15 is 7, expected 0"),
        # trajectory 0 ([9, 9, 9, 1, 0, 3, 0, 0]): position 4 predicts token 3, not 5.
        (dataclasses.replace(lay, logprob_targets=_with(lay.logprob_targets, 4, 5)),
         r"logprob_targets \(the next token\) of log-prob 4 is 5, expected 3"),
        # a trie row given two physical rows.
        (dataclasses.replace(lay, row_of_phys=_with(lay.row_of_phys, 1, lay.row_of_phys[0])),
         rf"trie row {int(lay.row_of_phys[0])} has 2 physical rows, expected 1"),
        # the root row counted once too often.
        (dataclasses.replace(lay, multiplicity=_with(lay.multiplicity, 0, lay.multiplicity[0] + 1)),
         rf"multiplicity of physical row 0 is {int(lay.multiplicity[0]) + 1}, expected {int(lay.multiplicity[0])}"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            bad.validate(plan)


def test_layout_validate_against_another_plan(plan, layout):
    other = plan_calls(figure2(), chunk_size=8)  # one round
    with pytest.raises(ValueError, match=r"layout has 2 rounds, plan 1"):
        layout.validate(other)


# ---------------------------------------------------------------------------------------------- MicrobatchPlan
SEQS = [[1, 2, 3], [1, 2, 4], [5, 6], [5, 6, 7], [8], [8, 9, 9]]


@pytest.fixture(scope="module")
def mplan():
    p = plan_microbatches(SEQS, dp_degree=2, capacity=5)
    p.validate(SEQS)
    return p


def test_microbatch_plan_validate_names_the_item(mplan):
    p = mplan
    mb = [list(m) for m in p.microbatches]
    dup = [m + ([mb[1][0]] if i == 0 else []) for i, m in enumerate(mb)]
    cases = [
        (dataclasses.replace(p, microbatches=dup), rf"trajectory {mb[1][0]} is in 2 microbatches"),
        (dataclasses.replace(p, work=[p.capacity + 1] + list(p.work[1:])),
         rf"microbatch 0: work {p.capacity + 1} is not in \(0, capacity {p.capacity}\]"),
        (dataclasses.replace(p, replicas=[list(p.replicas[0]), list(p.replicas[0])]),
         rf"microbatch {p.replicas[0][0]} is on 2 replicas"),
        (dataclasses.replace(p, objective=(p.objective[0] + 1,) + tuple(p.objective[1:])),
         r"objective .* != recomputed"),
        (dataclasses.replace(p, microbatches=[m if i else [] for i, m in enumerate(mb)]), r"microbatch 0 is empty"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            bad.validate()


def test_microbatch_plan_validate_recomputes_work(mplan):
    other = [list(s) for s in SEQS]
    i = mplan.microbatches[0][0]
    other[i] = [99] * len(other[i])  # same lengths, no prefix shared any more
    with pytest.raises(ValueError, match=r"microbatch 0: work \d+ != recomputed \d+"):
        mplan.validate(other)


# ---------------------------------------------------------------------------------------------- python -O
def test_validators_raise_under_python_O():
    """Validation is code, not ``assert``: under -O a corrupted plan, layout and microbatch plan still raise."""
    script = textwrap.dedent(
        f"""
        import dataclasses, numpy as np
        from harts.planning.calls import plan_calls
        from harts.planning.layout import build_layout
        from harts.planning.microbatch import plan_microbatches
        if __debug__:
            raise SystemExit("not running under -O")
        plan = plan_calls({figure2()!r}, chunk_size={B})
        lay = build_layout(plan)
        mplan = plan_microbatches({SEQS!r}, dp_degree=2, capacity=5)
        bad = [
            lambda: dataclasses.replace(plan, seq_round=np.zeros_like(plan.seq_round)).validate(),
            lambda: dataclasses.replace(lay, tokens=lay.tokens[::-1].copy()).validate(plan),
            lambda: dataclasses.replace(mplan, work=[0] * len(mplan.work)).validate(),
        ]
        for i, f in enumerate(bad):
            try:
                f()
            except ValueError as e:
                print("raised", i, e)
            else:
                raise SystemExit(f"corruption {{i}} not caught under -O")
        """
    )
    out = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("raised") == 3


# ---------------------------------------------------------------------------------------------- public inputs
NOT_INTEGERS = [16.7, 16.0, "16", True, None, np.float64(4.0)]


@pytest.mark.parametrize("bad", NOT_INTEGERS, ids=repr)
def test_integer_parameters_reject_non_integers(bad):
    trajs = figure2()
    with pytest.raises(TypeError, match=r"plan_calls: chunk_size must be an integer"):
        plan_calls(trajs, chunk_size=bad)
    with pytest.raises(TypeError, match=r"plan_calls_for_trie: chunk_size must be an integer"):
        plan_calls_for_trie(build_trie(trajs), chunk_size=bad)
    with pytest.raises(TypeError, match=r"chunk_size must be an integer"):
        min_calls_dp(SegmentTree.from_trie(build_trie(trajs)), bad)
    plan = plan_calls(trajs, chunk_size=B)
    with pytest.raises(TypeError, match=r"build_layout: conv_width must be an integer"):
        build_layout(plan, conv_width=bad)
    with pytest.raises(TypeError, match=r"build_layout: pad_to_multiple must be an integer"):
        build_layout(plan, pad_to_multiple=bad)
    # The same rule for the microbatch planner: a float capacity is a TypeError like a float chunk size.
    with pytest.raises(TypeError, match=r"plan_microbatches: capacity must be an integer"):
        plan_microbatches(SEQS, dp_degree=1, capacity=bad)
    with pytest.raises(TypeError, match=r"plan_microbatches: dp_degree must be an integer"):
        plan_microbatches(SEQS, dp_degree=bad, capacity=100)
    if bad is not None:
        with pytest.raises(TypeError, match=r"plan_microbatches: exact_threshold must be an integer"):
            plan_microbatches(SEQS, dp_degree=1, capacity=100, exact_threshold=bad)


def test_integer_parameters_below_minimum_are_value_errors():
    with pytest.raises(ValueError, match=r"plan_calls: chunk_size must be >= 1, got 0"):
        plan_calls(figure2(), chunk_size=0)
    with pytest.raises(ValueError, match=r"build_layout: conv_width must be >= 1, got 0"):
        build_layout(plan_calls(figure2(), chunk_size=B), conv_width=np.int64(0))
    with pytest.raises(PlanningError, match=r"capacity must be >= 1, got -3"):
        plan_microbatches(SEQS, dp_degree=1, capacity=-3)


@pytest.mark.parametrize("np_int", [np.int64, np.int32, np.uint16])
def test_numpy_integers_are_accepted(np_int):
    trajs = figure2()
    ref = plan_calls(trajs, chunk_size=B)
    got = plan_calls(trajs, chunk_size=np_int(B))
    assert type(got.chunk_size) is int and got.to_dict() == ref.to_dict()
    lay = build_layout(got, conv_width=np_int(3), pad_to_multiple=np_int(8))
    lay.validate(got)
    assert type(lay.conv_width) is int and lay.num_phys == 16
    assert np.array_equal(lay.conv_context, build_layout(ref, conv_width=3, pad_to_multiple=8).conv_context)
    m = plan_microbatches(SEQS, dp_degree=np_int(2), capacity=np_int(5))
    assert m.to_dict() == plan_microbatches(SEQS, dp_degree=2, capacity=5).to_dict()
    assert type(m.capacity) is int and type(m.dp_degree) is int


@pytest.mark.parametrize("empty", [[], (), "generator"])
def test_empty_input_is_a_clear_error_from_the_entry_point(empty):
    def make():
        return (t for t in []) if empty == "generator" else empty

    with pytest.raises(ValueError, match=r"^plan_calls: no trajectories to plan \(empty input\)$"):
        plan_calls(make(), chunk_size=B)
    with pytest.raises(PlanningError, match=r"^plan_microbatches: no trajectories to plan \(empty input\)$"):
        plan_microbatches(make(), dp_degree=1, capacity=8)


def test_build_layout_rejects_what_is_not_a_plan():
    with pytest.raises(TypeError, match=r"build_layout: plan must be a CallPlan"):
        build_layout(figure2())
    with pytest.raises(TypeError, match=r"plan_calls_for_trie: trie must be a CompactTrie"):
        plan_calls_for_trie(figure2(), chunk_size=B)
