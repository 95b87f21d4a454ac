"""JSONL round trip and bad-input errors that name the offending line and field."""
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
                          loss_weights=[1, 1, 0.5], reward=1.0, group_id=3, tag="x"),
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
    ],
)
def test_bad_input_names_line_and_field(tmp_path, bad, field, fragment):
    p = _write(tmp_path, [GOOD, GOOD, bad])
    with pytest.raises(TrajectoryError) as e:
        read_jsonl(p)
    msg = str(e.value)
    assert "line 3" in msg and f"'{field}'" in msg and fragment in msg, msg


def test_token_beyond_vocab_names_line_and_field(tmp_path):
    p = _write(tmp_path, [GOOD, {"tokens": [1, 2, 1000]}])
    read_jsonl(p)  # fine without a vocabulary
    with pytest.raises(TrajectoryError) as e:
        read_jsonl(p, vocab_size=1000)
    msg = str(e.value)
    assert "line 2" in msg and "'tokens'" in msg and "1000 >= vocab size 1000" in msg


def test_structural_errors(tmp_path):
    with pytest.raises(TrajectoryError, match="line 2: invalid JSON"):
        read_jsonl(_write(tmp_path, [GOOD, "{not json"]))
    with pytest.raises(TrajectoryError, match="line 1: expected a JSON object"):
        read_jsonl(_write(tmp_path, ["[1, 2]"]))
    with pytest.raises(TrajectoryError, match="line 2: empty line"):
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
