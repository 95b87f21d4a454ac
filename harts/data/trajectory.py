"""Trajectories and rollout batches: the semantic input of HARTS (paper 2.1).

A trajectory is one root-to-leaf path of a rollout tree, with the per-token RL metadata the objective
needs. Prefix sharing never merges training targets: two trajectories that share a prefix keep their
own labels, masks, advantages and log-probs; only hidden states and logits are shared (through the
compact trie, ``harts.data.trie``).

Per-token metadata arrays are aligned with ``tokens`` (length L). Log-prob style fields follow the
usual RL convention: entry t refers to the prediction of token t from the prefix tokens[:t]; entry 0
is therefore never used by the loss (there is nothing to predict it from) but is kept so every array
has the same length as ``tokens``.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

# Per-token metadata fields (each an array of length len(tokens)) and their dtypes.
PER_TOKEN_FIELDS: dict[str, type] = {
    "loss_mask": np.float64,
    "advantages": np.float64,
    "old_logprobs": np.float64,
    "ref_logprobs": np.float64,
    "loss_weights": np.float64,
}
# Scalar metadata fields.
SCALAR_FIELDS = ("advantage", "reward", "group_id")


def did_you_mean(name: str, known) -> str:
    """' (did you mean 'x'?)' for the closest known name, '' when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class TrajectoryError(ValueError):
    """Invalid trajectory input; the message names the offending trajectory (or line) and field."""


@dataclass(frozen=True, eq=False)
class Trajectory:
    """One root-to-leaf path: token ids plus optional per-token and scalar RL metadata."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    advantages: np.ndarray | None = None
    old_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    loss_weights: np.ndarray | None = None
    advantage: float | None = None
    reward: float | None = None
    group_id: int | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def create(cls, tokens, *, where: str = "trajectory", vocab_size: int | None = None, extra: dict | None = None,
               **meta) -> "Trajectory":
        """Validated constructor; ``where`` names the item in error messages (e.g. "rollouts.jsonl:7").

        ``meta``: the per-token and scalar fields by name; anything else is an error (a misspelt field
        would otherwise be dropped). ``extra``: free-form data, kept unread. ``loss_mask`` holds 0/1 only
        (a mask, not a weight: weights go into ``loss_weights``, which must be >= 0)."""
        toks = _as_token_array(tokens, where=where, vocab_size=vocab_size)
        kwargs: dict = {}
        if extra is not None and not isinstance(extra, dict):
            raise TrajectoryError(f"{where}: 'extra' must be a dict, got {type(extra).__name__}")
        extra = dict(extra or {})
        known = (*PER_TOKEN_FIELDS, *SCALAR_FIELDS)
        for name, value in meta.items():
            if name not in known:
                raise TrajectoryError(f"{where}: unknown field '{name}'{did_you_mean(name, known)}; known: "
                                      f"{', '.join(known)}")
            if value is None:
                continue
            if name in PER_TOKEN_FIELDS:
                kwargs[name] = _as_per_token(value, len(toks), where=where, name=name)
            elif name in ("advantage", "reward"):
                kwargs[name] = _as_float(value, where=where, name=name)
            elif name == "group_id":
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise TrajectoryError(f"{where}: field 'group_id' must be an integer, got {value!r}")
                kwargs[name] = int(value)
        if "advantages" in kwargs and "advantage" in kwargs:
            raise TrajectoryError(f"{where}: give either per-token 'advantages' or scalar 'advantage', not both")
        return cls(tokens=toks, extra=extra, **kwargs)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def token_advantages(self) -> np.ndarray | None:
        """Per-token advantages, broadcasting a scalar ``advantage`` if that is what was given."""
        if self.advantages is not None:
            return self.advantages
        if self.advantage is not None:
            return np.full(len(self), self.advantage, dtype=np.float64)
        return None

    def to_json_dict(self) -> dict:
        out: dict = {"tokens": self.tokens.tolist()}
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value.tolist()
        for name in SCALAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.extra:
            out["meta"] = self.extra
        return out


@dataclass(frozen=True, eq=False)
class RolloutBatch:
    """The trajectories of one training step (or one microbatch), in their original order."""

    trajectories: tuple[Trajectory, ...]
    vocab_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "trajectories", tuple(self.trajectories))

    @classmethod
    def from_tokens(cls, token_lists: Iterable[Sequence[int]], *, vocab_size: int | None = None) -> "RolloutBatch":
        trajs = [
            Trajectory.create(t, where=f"trajectory {i}", vocab_size=vocab_size) for i, t in enumerate(token_lists)
        ]
        return cls(tuple(trajs), vocab_size=vocab_size)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return RolloutBatch(self.trajectories[i], vocab_size=self.vocab_size)
        return self.trajectories[i]

    def subset(self, indices: Sequence[int]) -> "RolloutBatch":
        return RolloutBatch(tuple(self.trajectories[i] for i in indices), vocab_size=self.vocab_size)

    @property
    def token_arrays(self) -> list[np.ndarray]:
        return [t.tokens for t in self.trajectories]

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(t) for t in self.trajectories), dtype=np.int64, count=len(self.trajectories))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def as_token_arrays(trajectories) -> list[np.ndarray]:
    """Accept a RolloutBatch, Trajectory objects or raw token sequences; return int64 arrays.

    Raw sequences are validated (non-empty, non-negative integers) with errors naming the index.
    """
    if isinstance(trajectories, RolloutBatch):
        return trajectories.token_arrays
    out = []
    for i, t in enumerate(trajectories):
        if isinstance(t, Trajectory):
            out.append(t.tokens)
        else:
            out.append(_as_token_array(t, where=f"trajectory {i}"))
    return out


def replace(traj: Trajectory, **changes) -> Trajectory:
    return dataclasses.replace(traj, **changes)


# --------------------------------------------------------------------------- validation helpers


def _as_token_array(tokens, *, where: str, vocab_size: int | None = None) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise TrajectoryError(f"{where}: field 'tokens' must be one-dimensional, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise TrajectoryError(f"{where}: field 'tokens' must hold integers, got dtype {tokens.dtype}")
        arr = tokens.astype(np.int64, copy=False)
    else:
        if isinstance(tokens, (str, bytes, dict)) or not hasattr(tokens, "__len__"):
            raise TrajectoryError(f"{where}: field 'tokens' must be a list of integers, got {type(tokens).__name__}")
        j = _first_bool(tokens)
        if j is not None:
            raise TrajectoryError(f"{where}: field 'tokens' position {j}: token must be a non-negative integer, got "
                                  f"{tokens[j]!r}")
        try:
            arr = np.asarray(tokens) if len(tokens) else np.zeros(0, dtype=np.int64)
        except (ValueError, OverflowError):
            arr = np.asarray(tokens, dtype=object)
        if arr.dtype.kind not in "iu" or arr.ndim != 1:  # slow path only to name the offending position
            for j, tok in enumerate(tokens):
                if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                    raise TrajectoryError(
                        f"{where}: field 'tokens' position {j}: token must be a non-negative integer, got {tok!r}"
                    )
                if tok < 0:
                    raise TrajectoryError(f"{where}: field 'tokens' position {j}: negative token id {tok}")
                if tok >= 2**63:
                    limit = f" (the vocab size is {vocab_size})" if vocab_size is not None else ""
                    raise TrajectoryError(f"{where}: field 'tokens' position {j}: token id {tok} is out of range, far "
                                          f"too large for a token id{limit}")
            raise TrajectoryError(f"{where}: field 'tokens' must be a flat list of integers")
        arr = arr.astype(np.int64, copy=False)
    if arr.shape[0] == 0:
        raise TrajectoryError(f"{where}: field 'tokens' is empty (a trajectory needs at least one token)")
    if arr.min() < 0:
        j = int(np.flatnonzero(arr < 0)[0])
        raise TrajectoryError(f"{where}: field 'tokens' position {j}: negative token id {int(arr[j])}")
    if vocab_size is not None and arr.max() >= vocab_size:
        j = int(np.flatnonzero(arr >= vocab_size)[0])
        raise TrajectoryError(
            f"{where}: field 'tokens' position {j}: token id {int(arr[j])} >= vocab size {vocab_size}"
        )
    return arr


def _first_bool(values) -> int | None:
    """Index of the first JSON true/false in a list (numpy would take it as 1/0), None if there is none."""
    if isinstance(values, (list, tuple)):
        for j, x in enumerate(values):
            if isinstance(x, (bool, np.bool_)):
                return j
    return None


def _as_per_token(value, length: int, *, where: str, name: str) -> np.ndarray:
    j = _first_bool(value)
    if j is not None:
        what = "0 or 1" if name == "loss_mask" else "a number"
        raise TrajectoryError(f"{where}: field '{name}' position {j} is {str(value[j]).lower()}; it must be {what}")
    try:
        arr = np.asarray(value, dtype=PER_TOKEN_FIELDS[name])
    except (TypeError, ValueError) as e:
        raise TrajectoryError(f"{where}: field '{name}' must be a list of numbers ({e})") from None
    if arr.ndim != 1:
        raise TrajectoryError(f"{where}: field '{name}' must be a flat list, got shape {arr.shape}")
    if arr.shape[0] != length:
        raise TrajectoryError(
            f"{where}: field '{name}' has length {arr.shape[0]} but 'tokens' has length {length}"
        )
    if not np.all(np.isfinite(arr)):
        j = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise TrajectoryError(f"{where}: field '{name}' position {j} is not finite ({arr[j]})")
    if name == "loss_mask" and not np.all((arr == 0) | (arr == 1)):
        j = int(np.flatnonzero((arr != 0) & (arr != 1))[0])
        raise TrajectoryError(f"{where}: field 'loss_mask' position {j} is {arr[j]:g}; a mask holds 0 or 1 "
                              "(per-token weights go into 'loss_weights')")
    if name in ("old_logprobs", "ref_logprobs") and arr.max() > 0:
        j = int(np.flatnonzero(arr > 0)[0])
        raise TrajectoryError(f"{where}: field '{name}' position {j} is {arr[j]:g}; a log-probability is <= 0 "
                              "(log p of the token, not p or a logit)")
    if name == "loss_weights" and arr.min() < 0:
        j = int(np.flatnonzero(arr < 0)[0])
        raise TrajectoryError(f"{where}: field 'loss_weights' position {j} is {arr[j]:g}; weights must be >= 0")
    return arr


def _as_float(value, *, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TrajectoryError(f"{where}: field '{name}' must be a number, got {value!r}")
    v = float(value)
    if not np.isfinite(v):
        raise TrajectoryError(f"{where}: field '{name}' is not finite ({v})")
    return v
