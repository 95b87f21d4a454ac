"""Synthetic agentic rollout trees shaped like coding-agent (SWE-bench) workloads.

We have no real agentic rollouts on these machines, so planners, kernels and benchmarks run on trees
drawn from a small generative model of a coding agent (docs/workloads.md describes it in full):

* a tree starts from a long shared task prompt (system prompt, issue text, repository context);
* a trajectory is a sequence of turns, each an assistant message (tool call) followed by a tool output;
  tool outputs are long and heavy-tailed, assistant messages short;
* a tree grows leaf by leaf: a new trajectory forks off an existing one, at a turn boundary (parallel
  exploration, a different next action) or inside an assistant message (a retry of a partially sampled
  message), late rather than early (agents share the prompt and early exploration), and then continues
  with its own turns to a length near its parent's;
* a step holds several independent trees (tasks).

Only the token sequences matter to HARTS, so tokens are uniform random ids; a fork's first new token is
forced to differ from its parent's token at that position so that every generated fork is a real fork.
Metadata follows the agent model: loss mask 1 on assistant tokens and 0 on prompt and tool tokens; a
scalar reward per trajectory; group id = tree id (GRPO groups the trajectories of one task).

CLI: ``python -m harts.data.synthetic --preset swe-step --seed 0 --scale 1 --out step.jsonl``
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from harts.data.trajectory import RolloutBatch, Trajectory


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of the generative model (all lengths in tokens; lognormal = (median, sigma))."""

    trees: tuple[int, int]  # number of trees per step at scale 1, uniform in [lo, hi]
    leaves_median: float  # trajectories per tree ~ lognormal(leaves_median, leaves_sigma), clipped
    leaves_sigma: float
    leaves_range: tuple[int, int]
    prompt: tuple[float, float]  # shared task prompt length
    prompt_range: tuple[int, int]
    path_len: tuple[float, float]  # target length of a tree's first trajectory
    path_range: tuple[int, int]
    assistant: tuple[float, float]  # assistant message length
    assistant_range: tuple[int, int]
    tool: tuple[float, float]  # tool output length
    tool_range: tuple[int, int]
    fork_beta: tuple[float, float]  # fork position as a fraction of the parent's turns ~ Beta(a, b)
    fork_inside_turn: float  # probability that a fork lies inside an assistant message (a retry)
    child_len_sigma: float  # a branch's new suffix = parent's remaining suffix * lognormal(1, sigma)
    vocab_size: int = 157184


PRESETS: dict[str, WorkloadSpec] = {
    # One RL step of SWE-like agentic rollouts, calibrated to the paper's Tables 2 and 4 (docs/workloads.md).
    "swe-step": WorkloadSpec(
        trees=(90, 150),
        leaves_median=12.0,
        leaves_sigma=0.35,
        leaves_range=(4, 64),
        prompt=(5000.0, 0.45),
        prompt_range=(1500, 16000),
        path_len=(25000.0, 0.30),
        path_range=(8000, 60000),
        assistant=(220.0, 0.8),
        assistant_range=(8, 3000),
        tool=(900.0, 1.0),
        tool_range=(16, 12000),
        fork_beta=(12.3, 1.2),
        fork_inside_turn=0.3,
        child_len_sigma=0.5,
    ),
    # The same shape at 1/32 of the lengths and a few trees: CPU-sized planner and runtime tests
    # (the analogue of capacity 65,536 is 2,048).
    "swe-small": WorkloadSpec(
        trees=(6, 10),
        leaves_median=10.0,
        leaves_sigma=0.4,
        leaves_range=(2, 24),
        prompt=(160.0, 0.45),
        prompt_range=(40, 500),
        path_len=(840.0, 0.30),
        path_range=(250, 2800),
        assistant=(10.0, 0.6),
        assistant_range=(2, 90),
        tool=(28.0, 0.9),
        tool_range=(2, 380),
        fork_beta=(8.0, 1.2),
        fork_inside_turn=0.3,
        child_len_sigma=0.5,
        vocab_size=4096,
    ),
    # A handful of short trajectories for model-level CPU tests (small vocabulary for toy models).
    "tiny": WorkloadSpec(
        trees=(2, 3),
        leaves_median=3.0,
        leaves_sigma=0.3,
        leaves_range=(2, 4),
        prompt=(24.0, 0.3),
        prompt_range=(8, 48),
        path_len=(80.0, 0.25),
        path_range=(40, 160),
        assistant=(6.0, 0.5),
        assistant_range=(2, 16),
        tool=(10.0, 0.6),
        tool_range=(2, 30),
        fork_beta=(2.0, 1.5),
        fork_inside_turn=0.4,
        child_len_sigma=0.5,
        vocab_size=256,
    ),
}


def _lognormal(rng: np.random.Generator, median_sigma: tuple[float, float], lo: int, hi: int) -> int:
    median, sigma = median_sigma
    return int(np.clip(round(median * np.exp(sigma * rng.standard_normal())), lo, hi))


@dataclass
class _Path:
    tokens: np.ndarray  # int64 token ids
    assistant: np.ndarray  # bool, True on assistant tokens (loss mask)
    turn_starts: np.ndarray  # int64, position where each turn's assistant message starts


def _grow(rng, spec: WorkloadSpec, prefix: _Path | None, fork: int, target: int, prompt_len: int) -> _Path:
    """Continue ``prefix[:fork]`` (or a fresh prompt) with turns until about ``target`` tokens."""
    pieces, masks = [], []
    if prefix is None:
        pieces.append(rng.integers(0, spec.vocab_size, prompt_len))
        masks.append(np.zeros(prompt_len, dtype=bool))
        length, starts = prompt_len, []
    else:
        pieces.append(prefix.tokens[:fork])
        masks.append(prefix.assistant[:fork])
        length = fork
        starts = prefix.turn_starts[prefix.turn_starts < fork].tolist()
    first_new = True
    # Forked strictly inside an assistant message: the retry first finishes that message.
    in_turn = prefix is not None and 0 < fork < prefix.tokens.shape[0] and bool(
        prefix.assistant[fork] and prefix.assistant[fork - 1])
    while first_new or length < target:
        if in_turn:  # finish the assistant message we forked inside of (a retry), then its tool output
            a = max(1, _lognormal(rng, spec.assistant, *spec.assistant_range) // 2)
            in_turn = False
        else:
            starts.append(length)
            a = _lognormal(rng, spec.assistant, *spec.assistant_range)
        t = _lognormal(rng, spec.tool, *spec.tool_range)
        toks = rng.integers(0, spec.vocab_size, a + t)
        if first_new and prefix is not None and fork < prefix.tokens.shape[0]:
            # A real fork: the first new token differs from the parent's token at this position.
            toks[0] = (prefix.tokens[fork] + 1 + rng.integers(0, spec.vocab_size - 1)) % spec.vocab_size
        m = np.zeros(a + t, dtype=bool)
        m[:a] = True
        pieces.append(toks)
        masks.append(m)
        length += a + t
        first_new = False
    # Trajectories end where their budget runs out (context limit or the agent's final message), so
    # the last turn is cut at the target rather than overshooting by a whole (heavy-tailed) turn.
    end = max(target, (fork if prefix is not None else prompt_len) + 1)
    tokens, mask = np.concatenate(pieces)[:end], np.concatenate(masks)[:end]
    turn_starts = np.asarray(starts, dtype=np.int64)
    return _Path(tokens, mask, turn_starts[turn_starts < end])


def _fork_point(rng, spec: WorkloadSpec, parent: _Path, prompt_len: int) -> int:
    """Late fork: at a turn boundary, or inside an assistant message (a retry)."""
    starts = parent.turn_starts[parent.turn_starts >= prompt_len]
    if starts.shape[0] == 0:
        return int(rng.integers(prompt_len // 2, parent.tokens.shape[0]))
    # The fork lands at a Beta-distributed fraction of the parent's turns (turn index, not tokens:
    # picking the turn that contains a token fraction would favour the longest tool outputs).
    k = min(int(rng.beta(*spec.fork_beta) * starts.shape[0]), starts.shape[0] - 1)
    pos = int(starts[k])
    if rng.random() < spec.fork_inside_turn:
        end = pos + 1
        while end < parent.tokens.shape[0] and parent.assistant[end]:
            end += 1
        if end - pos > 1:
            pos = int(rng.integers(pos + 1, end))
    return min(pos, parent.tokens.shape[0] - 1)


def generate_tree(rng: np.random.Generator, spec: WorkloadSpec) -> list[_Path]:
    leaves = int(np.clip(round(spec.leaves_median * np.exp(spec.leaves_sigma * rng.standard_normal())),
                         *spec.leaves_range))
    prompt_len = _lognormal(rng, spec.prompt, *spec.prompt_range)
    target = max(_lognormal(rng, spec.path_len, *spec.path_range), prompt_len + 1)
    paths = [_grow(rng, spec, None, 0, target, prompt_len)]
    while len(paths) < leaves:
        parent = paths[int(rng.integers(0, len(paths)))]
        fork = _fork_point(rng, spec, parent, prompt_len)
        # The new branch replaces the parent's remaining suffix with one of similar length.
        sigma = spec.child_len_sigma  # mean-one lognormal factor, so lengths do not drift over generations
        suffix = (parent.tokens.shape[0] - fork) * np.exp(sigma * rng.standard_normal() - sigma**2 / 2)
        # Cap at the preset's longest path so no trajectory outgrows the microbatch capacity.
        target = min(fork + max(int(suffix), 1), max(spec.path_range[1], fork + 1))
        paths.append(_grow(rng, spec, parent, fork, target, prompt_len))
    return paths


def generate(preset: str | WorkloadSpec, *, seed: int = 0, scale: float = 1.0, metadata: bool = True) -> RolloutBatch:
    """One step of synthetic agentic rollouts.

    ``scale`` multiplies the number of trees (the shape of each tree is unchanged). With ``metadata``
    each trajectory carries a loss mask (assistant tokens), a scalar reward and its tree as group id.
    """
    spec = PRESETS[preset] if isinstance(preset, str) else preset
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rng = np.random.default_rng(seed)
    lo, hi = spec.trees
    n_trees = max(1, int(round(scale * rng.integers(lo, hi + 1))))
    trajs: list[Trajectory] = []
    for tree in range(n_trees):
        paths = generate_tree(rng, spec)
        rewards = rng.random(len(paths)) < 0.4  # binary task success
        for p, r in zip(paths, rewards):
            if metadata:
                trajs.append(Trajectory(tokens=p.tokens, loss_mask=p.assistant.astype(np.float64),
                                        reward=float(r), group_id=tree))
            else:
                trajs.append(Trajectory(tokens=p.tokens, group_id=tree))
    return RolloutBatch(tuple(trajs), vocab_size=spec.vocab_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.data.synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="swe-step", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--out", required=True, help="output JSONL file (one trajectory per line)")
    ap.add_argument("--no-metadata", action="store_true", help="tokens and group ids only")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    batch = generate(args.preset, seed=args.seed, scale=args.scale, metadata=not args.no_metadata)
    t_gen = time.perf_counter() - t0
    from harts.data.jsonl import write_jsonl

    write_jsonl(args.out, batch)
    print(f"{args.preset} seed={args.seed} scale={args.scale}: {len(batch)} trajectories, "
          f"{batch.num_tokens:,} tokens, generated in {t_gen:.2f}s, written to {args.out} "
          f"in {time.perf_counter() - t0 - t_gen:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
