"""Rollout trees sampled from the policy: every turn of every live branch forks into k branches.

``rollout_trees`` resets one episode per seed, feeds the prompts, and for turn t forks every live branch
into ``branching[t]`` (the model's decoding state with ``DecodeCache.fork``, the environment's state as
is), samples each branch's action, asks the environment, and feeds the observation. So the tree of an
episode shares its prompt and every earlier turn, and each shared prefix is decoded once. After the last
entry of ``branching`` branches continue one each (k = 1) until the episode ends or ``max_turns``.

Every leaf becomes one ``Trajectory`` (the objects the JSONL path produces, docs/byo-rollouts.md):
tokens, loss_mask 1 on agent tokens and 0 on prompt and observation tokens, old_logprobs (the policy's
log-probs at temperature 1 of the agent tokens, 0 elsewhere), the summed reward, and the episode's
index as group_id (GRPO's group: the leaves of one tree).

Legend: B live branches, E episodes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from harts.data.trajectory import Trajectory
from harts.models.common.generate import DecodeCache, Sampling, feed, feed_sequences, sample

__all__ = ["rollout_trees", "Rollouts"]


@dataclass
class _Branch:
    episode: int
    state: object
    tokens: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    logp: list = field(default_factory=list)
    reward: float = 0.0

    def copy(self) -> "_Branch":
        return _Branch(self.episode, self.state, list(self.tokens), list(self.mask), list(self.logp), self.reward)


@dataclass
class Rollouts:
    """A step's trajectories and what their sampling measured."""

    trajectories: tuple[Trajectory, ...]
    stats: dict


def rollout_trees(model, env, seeds, branching, *, sampling: Sampling = Sampling(),
                  generator: torch.Generator | None = None, max_turns: int = 16, group_offset: int = 0) -> Rollouts:
    """One rollout tree per episode seed (module docstring). ``model``: a whole causal LM (Ling-3.0 or
    Qwen3.5-MoE; harts.models.common.generate decodes either). ``branching``: branches per turn, e.g. (4, 2).
    Stats: mean reward, mean entropy of the policy at the sampled tokens, generated and fed tokens,
    seconds."""
    seeds = [int(s) for s in seeds]
    branching = tuple(int(k) for k in branching)
    if not seeds:
        raise ValueError("rollout_trees: no episode seeds")
    if not branching or any(k < 1 for k in branching):
        raise ValueError(f"rollout_trees: branching = {branching} must be a non-empty list of counts >= 1")
    if max_turns < 1:
        raise ValueError(f"rollout_trees: max_turns = {max_turns} must be >= 1")
    t0 = time.perf_counter()
    training = model.training
    model.eval()
    V = model.config.vocab_size
    fed = 0
    leaves: list[_Branch] = []
    entropy: list[float] = []
    try:
        branches, prompts = [], []
        for e, s in enumerate(seeds):
            state, prompt = env.reset(s)
            prompt = [int(x) for x in prompt]
            _check_ids(prompt, V, f"episode {e} (seed {s}): prompt")
            branches.append(_Branch(e, state, list(prompt), [0.0] * len(prompt), [0.0] * len(prompt)))
            prompts.append(prompt)
        cache = DecodeCache.empty(model, len(seeds))
        feed_sequences(model, cache, prompts)
        fed += sum(len(p) for p in prompts)
        for turn in range(max_turns):
            k = branching[turn] if turn < len(branching) else 1
            if k > 1:
                cache = cache.fork(np.repeat(np.arange(len(branches)), k))
                branches = [b.copy() for b in branches for _ in range(k)]
            acting = list(range(len(branches)))
            actions = [[] for _ in branches]
            for i in range(env.max_action_tokens):
                rows_M, _ = cache._rows(acting)
                tok, _, lp, ent = sample(cache.logits.index_select(0, rows_M), sampling, generator)
                entropy += ent.tolist()
                for m, b in enumerate(acting):
                    actions[b].append(int(tok[m]))
                    branches[b].tokens.append(int(tok[m]))
                    branches[b].mask.append(1.0)
                    branches[b].logp.append(float(lp[m]))
                feed(model, cache, tok, acting)
                fed += len(acting)
                acting = [b for m, b in enumerate(acting) if int(tok[m]) not in env.stop_ids]
                if not acting:
                    break
            go_on, obs = [], []
            for b, br in enumerate(branches):
                res = env.step(br.state, tuple(actions[b]))
                br.reward += float(res.reward)
                o = [int(x) for x in res.observation]
                _check_ids(o, V, f"episode {br.episode} (seed {seeds[br.episode]}), turn {turn}: observation")
                br.tokens += o
                br.mask += [0.0] * len(o)
                br.logp += [0.0] * len(o)
                br.state = res.state
                if res.done or turn == max_turns - 1:
                    leaves.append(br)
                else:
                    go_on.append(b)
                    obs.append(o)
            if not go_on:
                break
            cache = cache.fork(go_on)
            branches = [branches[b] for b in go_on]
            feed_sequences(model, cache, obs)
            fed += sum(len(o) for o in obs)
    finally:
        model.train(training)
    leaves.sort(key=lambda br: br.episode)  # stable: each tree's leaves in branch order
    trajs = tuple(Trajectory.create(np.asarray(br.tokens), loss_mask=np.asarray(br.mask),
                                    old_logprobs=np.asarray(br.logp), reward=br.reward,
                                    group_id=group_offset + br.episode, vocab_size=V,
                                    where=f"rollout of episode {br.episode} (seed {seeds[br.episode]})",
                                    extra={"seed": seeds[br.episode]})
                  for br in leaves)
    rewards = [br.reward for br in leaves]
    stats = {"reward": float(np.mean(rewards)), "entropy": float(np.mean(entropy)) if entropy else float("nan"),
             "generated_tokens": len(entropy), "decoded_tokens": fed, "rollout_s": time.perf_counter() - t0,
             "raw_tokens": int(sum(len(t) for t in trajs))}
    return Rollouts(trajs, stats)


def _check_ids(ids, vocab_size: int, where: str) -> None:
    bad = [x for x in ids if not 0 <= x < vocab_size]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} is out of range for vocab_size={vocab_size}")
