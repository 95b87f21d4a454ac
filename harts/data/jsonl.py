"""JSONL rollout files, schema version 1: one trajectory (one root-to-leaf path of a rollout tree) per line.

The schema (docs/byo-rollouts.md is its user-facing page; ``FIELDS`` is the one source of truth):

- ``tokens``: required, non-empty list of token ids, ``0 <= id < vocab``.
- ``loss_mask``: list of 0/1, one per token; 1 = the token is a training target (an assistant / policy
  token), 0 = context only (prompt, tool output). Required for training: there is no safe default (all
  ones would train on the prompt and tool outputs, all zeros on nothing), so a file without it is an error
  rather than a guess. Values other than 0 and 1 are errors; per-token weights go into ``loss_weights``.
- ``loss_weights``: list of finite numbers >= 0, one per token, multiplying the mask (default 1).
- ``advantages`` (list, one per token) or ``advantage`` (number): the RL advantage, for
  ``rl.advantages = "data"``; not both.
- ``old_logprobs``, ``ref_logprobs``: lists, one per token; entry t is log p(tokens[t] | tokens[:t]) under
  the rollout (PPO's old) policy or the reference policy; entry 0 is never used.
- ``reward`` (number) and ``group_id`` (integer): GRPO's group-relative advantage inputs.
- ``meta``: any JSON object, kept unread in ``Trajectory.extra`` (ids, task names, ...).
- ``schema_version``: optional; if given it must be 1.

Any other key is an error with the nearest known name suggested (a misspelt ``lossmask`` would otherwise
be silently ignored). What the objective needs on top (``reward`` and ``group_id`` for GRPO, ``old_logprobs``
for PPO, ...) comes from ``requirements()``. Every error names ``file:line`` (1-based) and the field;
nothing is dropped or truncated.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Mapping

from harts.data.trajectory import RolloutBatch, Trajectory, TrajectoryError, did_you_mean

__all__ = ["SCHEMA_VERSION", "FIELDS", "requirements", "parse_line", "read_jsonl", "write_jsonl", "did_you_mean"]

SCHEMA_VERSION = 1

# field -> its type as the docs state it
FIELDS: dict[str, str] = {
    "tokens": "list of integers, 0 <= id < vocab (required)",
    "loss_mask": "list of 0/1 as long as tokens (required for training)",
    "loss_weights": "list of numbers >= 0 as long as tokens",
    "advantages": "list of numbers as long as tokens",
    "advantage": "number",
    "old_logprobs": "list of numbers as long as tokens",
    "ref_logprobs": "list of numbers as long as tokens",
    "reward": "number",
    "group_id": "integer",
    "meta": "JSON object, kept unread",
    "schema_version": f"integer, {SCHEMA_VERSION} if given",
}

# required-field key -> the fields any one of which satisfies it
_ALTERNATIVES = {"advantage(s)": ("advantage", "advantages")}


def requirements(*, objective: str = "grpo", advantages: str = "grpo", old_logprobs: str = "data",
                 kl_coef: float = 0.0, reward_from_data: bool = True) -> tuple[dict[str, str], dict[str, str]]:
    """(required, forbidden): field -> the setting that requires (forbids) it, for training with these RL
    settings (the names of harts.train.config's ``rl`` section). ``reward_from_data=False``: the trainer
    computes the reward itself (``data.reward = "learnable"``)."""
    req = {"tokens": "the schema", "loss_mask": "training (no default: see docs/byo-rollouts.md)"}
    forbidden = {}
    if advantages == "grpo":
        if reward_from_data:
            req["reward"] = "rl.advantages = 'grpo' with data.reward = 'data'"
        req["group_id"] = "rl.advantages = 'grpo'"
        for f in ("advantage", "advantages"):
            forbidden[f] = ("rl.advantages = 'grpo' (it computes the advantages; set rl.advantages = 'data' "
                            "to use these)")
    elif advantages == "data":
        req["advantage(s)"] = "rl.advantages = 'data'"
    if objective == "ppo" and old_logprobs == "data":
        req["old_logprobs"] = "rl.objective = 'ppo' with rl.old_logprobs = 'data'"
    if kl_coef > 0:
        req["ref_logprobs"] = f"rl.kl_coef = {kl_coef}"
    return req, forbidden


def parse_line(text: str, *, lineno: int, vocab_size: int | None = None, where: str | None = None,
               required: Mapping[str, str] | None = None, forbidden: Mapping[str, str] | None = None) -> Trajectory:
    """One line of a rollout file, validated against the schema (and ``required`` / ``forbidden`` fields:
    field -> the reason, as ``requirements()`` gives them). ``where`` prefixes errors (default 'line N')."""
    where = where or f"line {lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TrajectoryError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TrajectoryError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in obj:
        if key not in FIELDS:
            hint = did_you_mean(key, FIELDS) or f"; the schema's fields: {', '.join(FIELDS)}"
            raise TrajectoryError(f"{where}: unknown field '{key}'{hint} (free-form data goes into 'meta')")
    version = obj.pop("schema_version", SCHEMA_VERSION)
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise TrajectoryError(f"{where}: field 'schema_version' is {version!r}; this HARTS reads schema version "
                              f"{SCHEMA_VERSION}")
    for key, why in (required or {"tokens": "the schema"}).items():
        if not any(obj.get(f) is not None for f in _ALTERNATIVES.get(key, (key,))):
            raise TrajectoryError(f"{where}: field '{key}' is missing (required by {why})")
    for key, why in (forbidden or {}).items():
        if obj.get(key) is not None:
            raise TrajectoryError(f"{where}: field '{key}' is not used under {why}")
    if "tokens" not in obj:
        raise TrajectoryError(f"{where}: field 'tokens' is missing")
    meta = obj.pop("meta", None)
    if meta is not None and not isinstance(meta, dict):
        raise TrajectoryError(f"{where}: field 'meta' must be a JSON object, got {type(meta).__name__}")
    tokens = obj.pop("tokens")
    return Trajectory.create(tokens, where=where, vocab_size=vocab_size, extra=meta, **obj)


def read_jsonl(path: str | os.PathLike, *, vocab_size: int | None = None, required: Mapping[str, str] | None = None,
               forbidden: Mapping[str, str] | None = None) -> RolloutBatch:
    """Every line of ``path`` through ``parse_line``; errors are prefixed ``path:line``. Trajectory i of the
    result is line i + 1 (empty lines are errors, so the two never drift apart)."""
    trajs = []
    name = os.fspath(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TrajectoryError(f"{name}: cannot read the rollout file ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{name}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TrajectoryError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                      "rollout files are UTF-8 JSON, one object per line") from None
            if not line.strip():
                raise TrajectoryError(f"{where}: empty line (one trajectory per line)")
            trajs.append(parse_line(line, lineno=lineno, vocab_size=vocab_size, where=where, required=required,
                                    forbidden=forbidden))
    if not trajs:
        raise TrajectoryError(f"{name}: no trajectories")
    return RolloutBatch(tuple(trajs), vocab_size=vocab_size)


def write_jsonl(path: str | os.PathLike, trajectories: Iterable[Trajectory]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_json_dict(), separators=(",", ":")))
            f.write("\n")

