"""Environments for online RL: a small interface for your own, and a lookup-tool task that a small
randomly initialised Ling model learns in minutes on CPU.

Your environment is two pure functions (``Environment``): ``reset(seed) -> (state, prompt tokens)`` and
``step(state, action tokens) -> Turn`` (observation tokens the environment inserts, the turn's reward,
whether the episode is over, the next state). States are values that ``step`` never mutates, so the
branches of a rollout tree that leave one state each continue from it: ``harts.rl.rollout`` forks the
model's decoding state and reuses the environment state as is. The agent's turn ends at one of
``stop_ids`` or after ``max_action_tokens`` tokens. Agent tokens are trained on (loss_mask 1), prompt
and observation tokens are not (loss_mask 0); the trajectory's reward is the sum of its turns' rewards.

``LookupTask`` (multi-turn, one tool)::

    prompt  <bos> ASK key_k CALL          the question: which value does key k hold?
    agent   key_j                         the tool call's argument (a key token)
    env     OBS value_table[j] ANS        the tool's answer, or OBS ERR ANS for a non-key argument
    agent   value_v                       the final answer

The table is a random permutation drawn per episode, so no policy can answer from its weights: it must
call the tool with the asked key and copy the value the tool returns. Each agent turn scores
``0.5 * exact + 0.5 * closeness`` with closeness = max(0, 1 - |token - target| / width); the episode's
reward is the mean of the two turns' scores (in [0, 1]). Why it is learnable from random weights in
minutes: closeness is dense (an untrained model over 512 ids puts about a quarter of its draws within
``width`` = 64 ids of the target, so nearly every GRPO group has reward differences to learn from), and
its first lesson is only to move output mass into the key and value ranges; the exact term then asks for
copying a token seen 1 to 3 positions earlier (the key in the prompt, the value in the observation),
which the short convolution and the MLA layer can read directly. A random policy scores about 0.06; a
policy that always lands in the right range about 0.55; one that copies both tokens 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["Turn", "Environment", "LookupTask", "make_task", "TASKS"]


@dataclass(frozen=True)
class Turn:
    """The environment's answer to one agent turn."""

    observation: tuple[int, ...] = ()  # tokens inserted after the action (loss_mask 0)
    reward: float = 0.0
    done: bool = False
    state: Any = None  # the state the next turn starts from


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment with a programmatic reward (see the module docstring)."""

    max_action_tokens: int
    stop_ids: tuple[int, ...]

    def reset(self, seed: int) -> tuple[Any, Sequence[int]]:
        ...

    def step(self, state: Any, action: Sequence[int]) -> Turn:
        ...


@dataclass(frozen=True)
class LookupTask:
    """The lookup-tool task (module docstring). Token ids: specials 3..7, keys ``key_base`` + [0, n),
    values ``value_base`` + [0, n); all must lie below the model's vocab size."""

    num_keys: int = 8
    width: float = 64.0
    bos: int = 1
    ask: int = 3
    call: int = 4
    obs: int = 5
    ans: int = 6
    err: int = 7
    key_base: int = 64
    value_base: int = 192
    max_action_tokens: int = 1
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_keys < 2:
            raise ValueError(f"LookupTask.num_keys = {self.num_keys} must be >= 2")
        if not self.width > 0:
            raise ValueError(f"LookupTask.width = {self.width} must be > 0")
        keys = range(self.key_base, self.key_base + self.num_keys)
        values = range(self.value_base, self.value_base + self.num_keys)
        if set(keys) & set(values) or set(keys) & self.specials() or set(values) & self.specials():
            raise ValueError("LookupTask: key, value and special token ids must not overlap")

    def specials(self) -> set[int]:
        return {self.bos, self.ask, self.call, self.obs, self.ans, self.err}

    def vocab_needed(self) -> int:
        return max(self.key_base, self.value_base) + self.num_keys

    def reset(self, seed: int):
        rng = np.random.default_rng(seed)
        key = int(rng.integers(self.num_keys))
        table = tuple(int(v) for v in rng.permutation(self.num_keys))
        return ("call", key, table), (self.bos, self.ask, self.key_base + key, self.call)

    def _score(self, token: int, target: int) -> float:
        close = max(0.0, 1.0 - abs(token - target) / self.width)
        return 0.5 * float(token == target) + 0.5 * close

    def step(self, state, action):
        if len(action) != 1:
            raise ValueError(f"LookupTask: an action is one token, got {len(action)}")
        phase, key, table = state
        a = int(action[0])
        if phase == "call":
            j = a - self.key_base
            shown = self.value_base + table[j] if 0 <= j < self.num_keys else self.err
            return Turn((self.obs, shown, self.ans), 0.5 * self._score(a, self.key_base + key), False,
                        ("answer", key, table))
        if phase == "answer":
            return Turn((), 0.5 * self._score(a, self.value_base + table[key]), True, None)
        raise ValueError(f"LookupTask: step after the episode ended (state {state!r})")


TASKS = {"lookup": LookupTask}


def make_task(name: str, **kwargs) -> Environment:
    """A built-in task by name (``online.task``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)
