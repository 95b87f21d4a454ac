"""JSONL rollout files (schema version 1): round trip, and bad-input errors that name file:line and the field."""
import json

import numpy as np
import pytest

from harts.data import RolloutBatch, Trajectory, TrajectoryError
from harts.data.jsonl import read_jsonl, write_jsonl


def _write(tmp_path, lines):
    p = tmp_path / "batch.jsonl"
    p.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return p


def test_round_trip_keeps_all_metadata(tmp_path):
    trajs = [
        Trajectory.create([1, 2, 3], loss_mask=[0, 1, 1], advantages=[0.5, -1.0, 2.0],
                          old_logprobs=[0.0, -0.1, -0.2], ref_logprobs=[0.0, -0.3, -0.4],
                          loss_weights=[1, 1, 0.5], reward=1.0, group_id=3, extra={"tag": "x"}),
        Trajectory.create([1, 2], advantage=-0.25, group_id=3),
    ]
    p = tmp_path / "rt.jsonl"
    write_jsonl(p, trajs)
    back = read_jsonl(p)
    assert len(back) == 2
    for a, b in zip(trajs, back):
        assert a.to_json_dict() == b.to_json_dict()
    assert np.array_equal(back[1].token_advantages(), [-0.25, -0.25])
    assert back[0].extra == {"tag": "x"}


GOOD = {"tokens": [1, 2, 3]}


@pytest.mark.parametrize(
    "bad, field, fragment",
    [
        ({"tokens": []}, "tokens", "empty"),
        ({"tokens": [1, "a", 3]}, "tokens", "position 1"),
        ({"tokens": [1, 2.5]}, "tokens", "position 1"),
        ({"tokens": [1, -4]}, "tokens", "negative token id -4"),
        ({"tokens": [1, 2], "loss_mask": [1]}, "loss_mask", "length 1"),
        ({"tokens": [1, 2], "advantages": [1, 2, 3]}, "advantages", "length 3"),
        ({"tokens": [1, 2], "old_logprobs": [0.0]}, "old_logprobs", "length 1"),
        ({"tokens": [1, 2], "ref_logprobs": [0.0, 1, 2]}, "ref_logprobs", "length 3"),
        ({"tokens": [1, 2], "loss_weights": [1]}, "loss_weights", "length 1"),
        ({"tokens": [1, 2], "group_id": "g"}, "group_id", "integer"),
        ({"tokens": [1, 2], "reward": "high"}, "reward", "number"),
        ({"loss_mask": [1]}, "tokens", "missing"),
        ({"tokens": [1, 2], "reward": float("nan")}, "reward", "not finite"),
        ({"tokens": [1, 2], "loss_mask": [0, 7.0]}, "loss_mask", "position 1 is 7"),
        ({"tokens": [1, 2], "loss_mask": [0, 0.5]}, "loss_mask", "0 or 1"),
        ({"tokens": [1, 2], "loss_weights": [1, -2]}, "loss_weights", ">= 0"),
        ({"tokens": [1, 2], "lossmask": [0, 1]}, "lossmask", "did you mean 'loss_mask'"),
        ({"tokens": [1, 2], "Reward": 1.0}, "Reward", "did you mean 'reward'"),
        ({"tokens": [1, 2], "meta": [1]}, "meta", "JSON object"),
        ({"tokens": [1, 2], "schema_version": 2}, "schema_version", "version 1"),
    ],
)
def test_bad_input_names_line_and_field(tmp_path, bad, field, fragment):
    p = _write(tmp_path, [GOOD, GOOD, bad])
    with pytest.raises(TrajectoryError) as e:
        read_jsonl(p)
    msg = str(e.value)
    assert f"{p}:3:" in msg and f"'{field}'" in msg and fragment in msg, msg


def test_token_beyond_vocab_names_line_and_field(tmp_path):
    p = _write(tmp_path, [GOOD, {"tokens": [1, 2, 1000]}])
    read_jsonl(p)  # fine without a vocabulary
    with pytest.raises(TrajectoryError) as e:
        read_jsonl(p, vocab_size=1000)
    msg = str(e.value)
    assert f"{p}:2:" in msg and "'tokens'" in msg and "1000 >= vocab size 1000" in msg


def test_structural_errors(tmp_path):
    with pytest.raises(TrajectoryError, match=":2: invalid JSON"):
        read_jsonl(_write(tmp_path, [GOOD, "{not json"]))
    with pytest.raises(TrajectoryError, match=":1: expected a JSON object"):
        read_jsonl(_write(tmp_path, ["[1, 2]"]))
    with pytest.raises(TrajectoryError, match=":2: empty line"):
        read_jsonl(_write(tmp_path, [GOOD, "", GOOD]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TrajectoryError, match="no trajectories"):
        read_jsonl(empty)


def test_raw_token_lists_are_validated_by_index():
    with pytest.raises(TrajectoryError, match="trajectory 1: field 'tokens' is empty"):
        RolloutBatch.from_tokens([[1], []])
    with pytest.raises(TrajectoryError, match="trajectory 0: field 'tokens' position 2"):
        RolloutBatch.from_tokens([[1, 2, None]])


def test_meta_is_kept_and_schema_version_1_accepted(tmp_path):
    p = _write(tmp_path, [{"tokens": [1, 2], "meta": {"task": "t1", "n": [1]}, "schema_version": 1}])
    (t,) = read_jsonl(p)
    assert t.extra == {"task": "t1", "n": [1]} and t.to_json_dict() == {"tokens": [1, 2], "meta": t.extra}


def test_library_constructor_rejects_unknown_fields():
    with pytest.raises(TrajectoryError, match="unknown field 'rewad' \\(did you mean 'reward'\\?\\)"):
        Trajectory.create([1, 2], rewad=1.0)


@pytest.mark.parametrize(
    "settings, line, missing",
    [
        ({}, {"tokens": [1, 2], "reward": 1.0, "group_id": 0}, "loss_mask"),
        ({}, {"tokens": [1, 2], "loss_mask": [0, 1], "group_id": 0}, "reward"),
        ({}, {"tokens": [1, 2], "loss_mask": [0, 1], "reward": 1.0}, "group_id"),
        ({"reward_from_data": False}, {"tokens": [1, 2], "loss_mask": [0, 1]}, "group_id"),
        ({"advantages": "data"}, {"tokens": [1, 2], "loss_mask": [0, 1]}, "advantage(s)"),
        ({"advantages": "data", "objective": "ppo"}, {"tokens": [1, 2], "loss_mask": [0, 1], "advantage": 1.0},
         "old_logprobs"),
        ({"advantages": "data", "kl_coef": 0.1}, {"tokens": [1, 2], "loss_mask": [0, 1], "advantage": 1.0},
         "ref_logprobs"),
    ],
)
def test_fields_the_objective_needs_are_required(tmp_path, settings, line, missing):
    from harts.data.jsonl import requirements

    req, forbidden = requirements(**settings)
    p = _write(tmp_path, [line])
    read_jsonl(p)  # the schema alone asks for tokens only (the stats and planner tools read token trees)
    with pytest.raises(TrajectoryError) as e:
        read_jsonl(p, required=req, forbidden=forbidden)
    assert f"{p}:1: field '{missing}' is missing (required by " in str(e.value), str(e.value)


def test_grpo_refuses_advantages_it_would_overwrite(tmp_path):
    from harts.data.jsonl import requirements

    req, forbidden = requirements()
    p = _write(tmp_path, [{"tokens": [1, 2], "loss_mask": [0, 1], "reward": 1.0, "group_id": 0, "advantage": 2.0}])
    with pytest.raises(TrajectoryError, match=r":1: field 'advantage' is not used under rl.advantages = 'grpo'"):
        read_jsonl(p, required=req, forbidden=forbidden)


def test_stats_cli_validates_with_one_line(tmp_path, capsys):
    from harts.data.stats import main

    p = _write(tmp_path, [GOOD, {"tokens": [1, 2], "lossmask": [0, 1]}])
    assert main([str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{p}:2: unknown field 'lossmask' (did you mean 'loss_mask'?)" in err[0], err
