"""JSONL rollout files: one trajectory per line, ``{"tokens": [...], ...metadata}``.

Fields: ``tokens`` (required, non-empty list of non-negative integers); per-token ``loss_mask``,
``advantages``, ``old_logprobs``, ``ref_logprobs``, ``loss_weights`` (lists as long as ``tokens``);
scalar ``advantage``, ``reward``; integer ``group_id``. Other keys are kept in ``Trajectory.extra``.
Every error names the line (1-based) and the field; nothing is dropped or truncated.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

from harts.data.trajectory import RolloutBatch, Trajectory, TrajectoryError


def parse_line(text: str, *, lineno: int, vocab_size: int | None = None) -> Trajectory:
    where = f"line {lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TrajectoryError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TrajectoryError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "tokens" not in obj:
        raise TrajectoryError(f"{where}: field 'tokens' is missing")
    tokens = obj.pop("tokens")
    return Trajectory.create(tokens, where=where, vocab_size=vocab_size, **obj)


def read_jsonl(path: str | os.PathLike, *, vocab_size: int | None = None) -> RolloutBatch:
    trajs = []
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                raise TrajectoryError(f"{os.fspath(path)}: line {lineno}: empty line (one trajectory per line)")
            try:
                trajs.append(parse_line(line, lineno=lineno, vocab_size=vocab_size))
            except TrajectoryError as e:
                raise TrajectoryError(f"{os.fspath(path)}: {e}") from None
    if not trajs:
        raise TrajectoryError(f"{os.fspath(path)}: no trajectories")
    return RolloutBatch(tuple(trajs), vocab_size=vocab_size)


def write_jsonl(path: str | os.PathLike, trajectories: Iterable[Trajectory]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_json_dict(), separators=(",", ":")))
            f.write("\n")
