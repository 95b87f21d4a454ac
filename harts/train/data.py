"""Rollout steps -> this rank's packed microbatches, prepared by a background worker.

For step s every rank loads the *whole* step (synthetic seed + s, or the s-th JSONL file), computes
GRPO advantages and the loss normalisers over it, and runs the deterministic microbatch planner
(numpy, no randomness, no dependence on rank): every rank gets the same plan without communication,
then packs (call planner + layout, ``harts.pack``) only its DP replica's microbatches. Planning on every
rank instead of planning on rank 0 and broadcasting keeps a collective and a serialisation off the
step's critical path and lets each rank's worker run ahead independently; the cost is planning D times
(milliseconds at our sizes, and in a background thread). The trainer verifies agreement with one
all-reduce of a plan hash per step.

Context parallelism: the planner's capacity is per CP group (a microbatch's physical rows are split
over its cp ranks), so every CP rank of a DP replica plans, packs (padded to a multiple of cp) and
receives the same microbatches, then keeps its share of the rows (``CompactBatch.context_parallel``)
and the predicted positions those rows produce (``Microbatch.own_positions``).

Online mode (``online.enabled``): step s's trajectories are rollout trees that the trainer's current policy
samples when the step is built (``StepBuilder.online``; no prefetch, the policy changes every step).

With ``harts.enabled = false`` the same trajectories are grouped trajectory-wise (LPT on raw lengths,
capacity in raw tokens) and packed without prefix sharing: the baseline through the same trainer.

Legend: N trajectories of the step, K microbatches, D DP replicas, S predicted positions.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from harts.data.trajectory import Trajectory
from harts.planning.microbatch import MicrobatchPlan, PlanningError
from harts.rl.advantages import no_signal_reason, with_grpo_advantages
from harts.rl.losses import StepNormalizer, microbatch_coefficients, step_normalizer
from harts.runtime.batch import CompactBatch, pack

__all__ = ["Microbatch", "StepData", "StepBuilder", "Prefetcher", "plan_trajectory_wise", "truncate", "reward_mode"]

log = logging.getLogger("harts.train")


@dataclass
class Microbatch:
    index: int  # microbatch id in the plan
    slot: int
    batch: CompactBatch
    coeff: torch.Tensor  # [S] float64, c_s (harts.rl.losses); [S_own] under context parallelism
    adv: torch.Tensor  # [S] float64 (or [S_own])
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    own: torch.Tensor | None = None  # [S_own] long: positions whose rows this CP rank holds (None = all)

    def to(self, device, dtype) -> "Microbatch":
        mv = lambda t: None if t is None else t.to(device=device, dtype=dtype, non_blocking=True)
        own = None if self.own is None else self.own.to(device, non_blocking=True)
        return dataclasses.replace(self, batch=self.batch.to(device, non_blocking=True), coeff=mv(self.coeff),
                                   adv=mv(self.adv), old_logp=mv(self.old_logp), ref_logp=mv(self.ref_logp), own=own)

    def select(self, values_S: torch.Tensor) -> torch.Tensor:
        """This CP rank's entries of a per-position tensor (log-probs, targets); all without CP."""
        return values_S if self.own is None else values_S.index_select(0, self.own)

    def own_positions(self) -> "Microbatch":
        """Restrict the per-position metadata to the positions whose rows this CP rank holds.

        The runtime returns log-probs as partial vectors (other ranks' positions are zero). The
        objective is evaluated on own positions only, so every position is counted by exactly one CP
        rank and the group's losses add up to the full loss: masking zeros instead would be wrong for
        PPO and KL, where l(log p = 0) != 0."""
        cp = self.batch.cp
        if cp is None:
            return self
        lo, hi = cp.row_range
        rows = self.batch.logprob_rows
        own = ((rows >= lo) & (rows < hi)).nonzero().squeeze(1)
        pick = lambda t: None if t is None else t.index_select(0, own)
        return dataclasses.replace(self, coeff=pick(self.coeff), adv=pick(self.adv), old_logp=pick(self.old_logp),
                                   ref_logp=pick(self.ref_logp), own=own)


@dataclass
class StepData:
    step: int  # 1-based training step
    microbatches: list[Microbatch]  # this replica's, in slot order
    plan: MicrobatchPlan
    normalizer: StepNormalizer
    stats: dict = field(default_factory=dict)
    plan_hash: int = 0


def truncate(t: Trajectory, n: int) -> Trajectory:
    if len(t) <= n:
        return t
    ch = {f.name: getattr(t, f.name)[:n] for f in dataclasses.fields(t)
          if isinstance(getattr(t, f.name), np.ndarray)}
    return dataclasses.replace(t, **ch)


def pad_rows(batch: CompactBatch, multiple: int) -> CompactBatch:
    """Pad a trajectory-wise batch to a multiple of ``multiple`` rows: the padding rows form one extra
    sequence (so every sequence mixer stays within its own rows), have multiplicity 0 (no router
    statistics) and no log-prob positions."""
    P = batch.num_phys
    pad = -P % multiple
    if pad == 0:
        return batch
    z = torch.zeros(pad, dtype=torch.long)
    cu, cu_cpu = (None if c is None else torch.cat([c, c[-1:] + pad]) for c in (batch.cu_seqlens, batch.cu_seqlens_cpu))
    return dataclasses.replace(
        batch, input_ids=torch.cat([batch.input_ids, z]),
        position_ids=torch.cat([batch.position_ids, torch.arange(pad)]),
        multiplicity=torch.cat([batch.multiplicity, z]), cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
        max_seqlen=max(batch.max_seqlen, pad))


def reward_mode(data_cfg) -> str:
    """'data' or 'learnable': what ``data.reward`` (possibly 'auto') means for this ``data.source``: 'auto'
    uses the rollouts' own rewards from JSONL files and the learnable reward on synthetic rollouts."""
    if data_cfg.reward != "auto":
        return data_cfg.reward
    return "data" if data_cfg.source == "jsonl" else "learnable"


def learnable_reward(t: Trajectory, vocab_size: int) -> float:
    """Fraction of the trajectory's loss tokens whose id is below vocab/2 (0.5 if it has none)."""
    m = np.ones(len(t), dtype=bool) if t.loss_mask is None else t.loss_mask > 0
    m[0] = False
    return float((t.tokens[m] < vocab_size // 2).mean()) if m.any() else 0.5


def plan_trajectory_wise(lengths, *, dp_degree: int, capacity: int) -> MicrobatchPlan:
    """Baseline grouping: the fewest K (a multiple of D) for which longest-first assignment to the
    least-loaded microbatch fits ``capacity`` raw tokens; slots pair microbatches of similar size."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.shape[0]
    if n < dp_degree:
        raise PlanningError(f"{n} trajectories cannot fill {dp_degree} DP replicas")
    if lengths.max() > capacity:
        i = int(np.argmax(lengths > capacity))
        raise PlanningError(f"trajectory {i} has {int(lengths[i])} tokens, more than the microbatch capacity "
                            f"{capacity}")
    order = np.argsort(-lengths, kind="stable")
    k = max(dp_degree, -(-int(np.ceil(lengths.sum() / capacity)) // dp_degree) * dp_degree)
    while True:
        load = np.zeros(k, dtype=np.int64)
        owner = np.empty(n, dtype=np.int64)
        for i in order:
            b = int(np.argmin(load))
            owner[i], load[b] = b, load[b] + lengths[i]
        if load.max() <= capacity and (load > 0).all():
            break
        k += dp_degree
        if k > n:
            raise PlanningError(f"no trajectory-wise plan fits capacity {capacity} with D = {dp_degree}")
    by_size = np.argsort(-load, kind="stable")  # slot s holds the s-th group of D largest
    new_id = np.empty(k, dtype=np.int64)
    new_id[by_size] = np.arange(k)
    owner = new_id[owner]
    work = np.bincount(owner, weights=lengths, minlength=k).astype(np.int64)
    mbs = [np.flatnonzero(owner == i).tolist() for i in range(k)]
    replicas = [list(range(d, k, dp_degree)) for d in range(dp_degree)]
    w = work[np.asarray(replicas)]
    j = (int(work.sum()), int(w.max(axis=0).sum()), int(w.sum(axis=1).max()))
    return MicrobatchPlan(microbatches=mbs, replicas=replicas, work=work.tolist(), objective=j,
                          capacity=int(capacity), dp_degree=int(dp_degree), candidate="trajectory-wise LPT")


class StepBuilder:
    """Everything for step s on one DP replica; pure function of (config, s), identical on every rank."""

    def __init__(self, cfg, *, dp_degree: int, dp_rank: int, vocab_size: int, chunk_size: int, conv_width: int,
                 row_multiple: int = 1, cp_group=None, min_slots: int = 1):
        self.cfg, self.D, self.d = cfg, dp_degree, dp_rank
        self.min_slots = min_slots  # microbatches each DP rank needs (pipeline stages), see plan()
        self._told_fill = False
        self.row_multiple = row_multiple  # context and sequence parallelism split each microbatch's rows evenly
        self.cp_group = cp_group  # every CP rank of a replica packs the same microbatches, then keeps its rows
        self.vocab_size, self.chunk_size, self.conv_width = vocab_size, chunk_size, conv_width
        # online mode: the trainer sets ``online`` (step -> harts.rl.rollout.Rollouts, sampled from its policy)
        self.online, self.online_stats = None, {}
        self.reward = "data" if cfg.online.enabled else reward_mode(cfg.data)
        self._told_reward = self._told_no_signal = False
        self.reward_vocab = vocab_size  # the learnable reward splits these ids in half
        if cfg.data.source == "synthetic":
            from harts.data.synthetic import PRESETS

            self.reward_vocab = PRESETS[cfg.data.preset].vocab_size  # the ids the generator draws from

    def path(self, step: int) -> str:
        """The JSONL file of step ``step`` (jsonl source): the files of ``data.path`` in order, cycled
        (``data.fixed_step`` applies to synthetic data; one file gives the same rollouts every step)."""
        dc = self.cfg.data
        return dc.path[(step - 1) % len(dc.path)]

    def check_files(self, rank: int = 0, world: int = 1) -> tuple[int, int, tuple[int, str] | None]:
        """Reads distinct files of ``data.path`` as their steps will read them (the schema, the fields the
        objective needs, loss tokens, the replica count, ``harts.capacity``), so that a bad file stops the run
        before step 1 instead of when its step comes. ``rank`` / ``world``: this process checks every world-th
        distinct file from the rank-th on (the processes of a run share the work). Returns (files, trajectories,
        the first error as (index of its file in data.path, message naming file:line and the field or setting)
        or None); checking stops at the first error."""
        first_step: dict[str, int] = {}
        for i, p in enumerate(self.cfg.data.path):
            first_step.setdefault(p, i + 1)
        files = trajectories = 0
        for step in list(first_step.values())[rank::world]:
            try:
                trajs = self.load(step)
                self.normalizer(step, trajs)
                self._check_count(step, trajs)
                self._check_capacity(step, trajs)
            except (ValueError, OSError) as e:
                return files, trajectories, (step - 1, str(e))
            files, trajectories = files + 1, trajectories + len(trajs)
        return files, trajectories, None

    def normalizer(self, step: int, trajs) -> StepNormalizer:
        """The step's loss normalisers; an error names the step's file."""
        try:
            return step_normalizer(trajs)
        except ValueError as e:
            where = self.path(step) if self.cfg.data.source == "jsonl" else f"step {step}"
            raise ValueError(f"{where}: {e}") from None

    def where(self, step: int, i: int) -> str:
        """Trajectory ``i`` of step ``step`` for error messages: ``file:line`` for JSONL data."""
        if self.cfg.online.enabled:
            return f"step {step}, online rollout {i}"
        if self.cfg.data.source == "jsonl":
            return f"{self.path(step)}:{i + 1}"
        return f"step {step}, synthetic trajectory {i}"

    def load(self, step: int) -> tuple[Trajectory, ...]:
        dc, rl = self.cfg.data, self.cfg.rl
        if self.cfg.online.enabled:
            if self.online is None:
                raise RuntimeError("online.enabled: the step builder has no policy to sample from (set "
                                   "StepBuilder.online, as the trainer does)")
            rollouts = self.online(step)
            trajs, self.online_stats = rollouts.trajectories, dict(rollouts.stats)
        elif dc.source == "synthetic":
            from harts.data.synthetic import PRESETS, generate

            if PRESETS[dc.preset].vocab_size > self.vocab_size:
                raise ValueError(f"data.preset {dc.preset!r} has vocab {PRESETS[dc.preset].vocab_size} > the model's "
                                 f"{self.vocab_size}")
            seed = dc.seed + (1 if dc.fixed_step else step)
            trajs = generate(dc.preset, seed=seed, scale=dc.scale).trajectories
        else:
            from harts.data.jsonl import read_jsonl, requirements

            required, forbidden = requirements(objective=rl.objective, advantages=rl.advantages,
                                               old_logprobs=rl.old_logprobs, kl_coef=rl.kl_coef,
                                               reward_from_data=self.reward == "data")
            trajs = read_jsonl(self.path(step), vocab_size=self.vocab_size, required=required,
                               forbidden=forbidden).trajectories
        if dc.max_length > 0:
            trajs = tuple(truncate(t, dc.max_length) for t in trajs)
        if self.reward == "learnable":
            told = self._told_reward or os.environ.get("RANK", "0") != "0"
            if dc.source == "jsonl" and not told and any(t.reward is not None for t in trajs):
                self._told_reward = True
                log.warning("data.reward = 'learnable' replaces the rewards in %s (set data.reward = 'data' or "
                            "'auto' to train on them)", self.path(step))
            trajs = tuple(dataclasses.replace(t, reward=learnable_reward(t, self.reward_vocab)) for t in trajs)
        if rl.advantages == "grpo":
            trajs = with_grpo_advantages(trajs, std_normalize=rl.std_normalize, eps=rl.adv_eps)
            why = None if self._told_no_signal else no_signal_reason(trajs)
            if why is not None:
                self._told_no_signal = True  # once per run
                if os.environ.get("RANK", "0") == "0":
                    where = self.path(step) if dc.source == "jsonl" and not self.cfg.online.enabled else f"step {step}"
                    log.warning("%s: every GRPO advantage is 0, so the policy gradient is 0 and the step learns "
                                "nothing: %s; GRPO compares the rewards of trajectories of one prompt, so give each "
                                "group_id several trajectories with different rewards, or set rl.advantages = "
                                "'data' with your own advantages", where, why)
        else:
            for i, t in enumerate(trajs):
                if t.token_advantages() is None:
                    raise ValueError(f"{self.where(step, i)}: no 'advantage(s)', which rl.advantages = 'data' needs")
        return trajs

    def plan_at(self, trajs, capacity: int) -> MicrobatchPlan:
        h = self.cfg.harts
        if h.enabled:
            from harts.planning.microbatch import plan_microbatches

            return plan_microbatches(trajs, dp_degree=self.D, capacity=capacity, exact_threshold=h.exact_threshold)
        return plan_trajectory_wise([len(t) for t in trajs], dp_degree=self.D, capacity=capacity)

    def plan(self, trajs) -> MicrobatchPlan:
        """The step's plan at ``harts.capacity``; under pipeline parallelism (``min_slots`` = stages), at the
        largest capacity that still gives every DP rank ``min_slots`` microbatches, found by bisection
        between the smallest capacity that plans (from the longest trajectory up) and ``harts.capacity``.
        Larger microbatches share more, so the largest such capacity is kept; pipeline stages still compute
        only a microbatch's own rows (harts.train.pipeline pads the transfers alone)."""
        cap = self.cfg.harts.capacity
        plan = self.plan_at(trajs, cap)
        if plan.num_slots >= self.min_slots:
            return plan
        # compact rows of a microbatch holding one trajectory alone <= its length; a capacity that small can
        # still be infeasible (the baseline needs a multiple of D microbatches), so grow it until it plans
        lo_ok, best = max(len(t) for t in trajs), None
        while best is None:
            try:
                best = self.plan_at(trajs, lo_ok)
            except PlanningError:
                if lo_ok >= cap:
                    raise
                lo_ok = min(cap, lo_ok + max(1, lo_ok // 8))
        if best.num_slots < self.min_slots:  # too few trajectories: the fullest split there is
            return best
        hi_bad = cap
        while hi_bad - lo_ok > max(1, lo_ok // 64):  # to within 1.6 % of the largest capacity that fills
            mid = (lo_ok + hi_bad) // 2
            try:
                p = self.plan_at(trajs, mid)
            except PlanningError:
                p = None
            if p is not None and p.num_slots >= self.min_slots:
                lo_ok, best = mid, p
            else:
                hi_bad = mid
        (log.debug if self._told_fill else log.info)(
            "pipeline of %d stages: planned at capacity %d instead of harts.capacity = %d (%d microbatches per DP "
            "rank; harts.fill_pipeline)", self.min_slots, lo_ok, cap, best.num_slots)
        self._told_fill = True
        return best

    def _check_count(self, step: int, trajs) -> None:
        """Every data-parallel replica needs a trajectory of the step (its microbatches pair up with the others')."""
        if len(trajs) < self.D:
            where = self.path(step) if self.cfg.data.source == "jsonl" and not self.cfg.online.enabled \
                else f"step {step}"
            raise PlanningError(f"{where}: {len(trajs)} trajector{'y' if len(trajs) == 1 else 'ies'} for {self.D} "
                                "data-parallel replicas, which need at least one each; write at least "
                                f"{self.D} trajectories per step or run fewer data-parallel ranks (torchrun "
                                "--nproc_per_node, parallelism.data_parallel_shard_degree)")

    def _check_capacity(self, step: int, trajs) -> None:
        """A trajectory longer than ``harts.capacity`` fits no microbatch (alone, its compact rows are its
        length): name it and the setting, instead of the planner's 0-based index."""
        cap = self.cfg.harts.capacity
        lengths = np.fromiter((len(t) for t in trajs), dtype=np.int64, count=len(trajs))
        over = np.flatnonzero(lengths > cap)
        if over.shape[0]:
            i = int(over[0])
            more = f" ({over.shape[0]} trajectories do)" if over.shape[0] > 1 else ""
            raise PlanningError(f"{self.where(step, i)}: trajectory of {int(lengths[i])} tokens exceeds harts.capacity "
                                f"= {cap}{more}; raise --harts.capacity to at least {int(lengths.max())} or cut "
                                "trajectories with --data.max_length")

    def build(self, step: int) -> StepData:
        t0 = time.perf_counter()
        trajs = self.load(step)
        t1 = time.perf_counter()
        norm = self.normalizer(step, trajs)
        self._check_count(step, trajs)
        self._check_capacity(step, trajs)
        try:
            plan = self.plan(trajs)
        except PlanningError as e:
            raise PlanningError(f"step {step}: {e} (harts.capacity = {self.cfg.harts.capacity}, {self.D} DP "
                                "replicas)") from None
        t2 = time.perf_counter()
        rl, mbs = self.cfg.rl, []
        need_old = rl.objective == "ppo" and rl.old_logprobs == "data"
        for slot, mb_id in enumerate(plan.replicas[self.d]):
            sub = [trajs[i] for i in plan.microbatches[mb_id]]
            batch = pack(sub, chunk_size=self.chunk_size, prefix_sharing=self.cfg.harts.enabled,
                         conv_width=self.conv_width, vocab_size=self.vocab_size, pad_to_multiple=self.row_multiple)
            if not batch.prefix_sharing and self.row_multiple > 1:
                batch = pad_rows(batch, self.row_multiple)
            if self.cp_group is not None:
                batch = batch.context_parallel(self.cp_group)
            coeff = torch.from_numpy(microbatch_coefficients(sub, norm, rl.loss_norm))
            mbs.append(Microbatch(
                index=mb_id, slot=slot, batch=batch, coeff=coeff, adv=batch.semantic("advantages"),
                old_logp=self._field(batch, "old_logprobs", step, mb_id) if need_old else None,
                ref_logp=self._field(batch, "ref_logprobs", step, mb_id) if rl.kl_coef > 0 else None).own_positions())
        t3 = time.perf_counter()
        rewards = [t.reward for t in trajs if t.reward is not None]
        stats = {"raw_tokens": int(sum(len(t) for t in trajs)), "compact_rows": int(sum(plan.work)),
                 "trajectories": len(trajs), "microbatches": plan.num_microbatches,
                 "reward": float(np.mean(rewards)) if rewards else float("nan"),
                 "load_s": t1 - t0, "plan_s": t2 - t1, "pack_s": t3 - t2,
                 "local_rows": int(sum(m.batch.num_rows for m in mbs))}
        if self.cfg.online.enabled:  # what sampling measured (entropy, generated tokens, seconds)
            stats.update({k: v for k, v in self.online_stats.items() if k not in stats})
        digest = hashlib.blake2b(json.dumps(plan.to_dict()).encode(), digest_size=7).digest()
        return StepData(step=step, microbatches=mbs, plan=plan, normalizer=norm, stats=stats,
                        plan_hash=int.from_bytes(digest, "little"))

    @staticmethod
    def _field(batch: CompactBatch, name: str, step: int, mb_id: int) -> torch.Tensor:
        try:
            return batch.semantic(name)
        except KeyError as e:
            raise ValueError(f"step {step}, microbatch {mb_id}: {e.args[0]} (needed by the objective)") from None


class Prefetcher:
    """Builds steps [start, end] in a background thread, ``depth`` ahead of the training loop.

    Stateful for the checkpoint manager: its state is the next step to build, so a resumed run
    continues with exactly the step data it would have seen."""

    def __init__(self, builder: StepBuilder, *, start: int, end: int, depth: int):
        self.builder, self.next_step, self.end, self.depth = builder, start, end, depth
        self._q: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # Stateful
    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, sd: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load the data state before the first step")
        self.next_step = int(sd["next_step"])

    def _run(self, start: int):
        try:
            for s in range(start, self.end + 1):
                item = self.builder.build(s)
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # surfaced in the training loop with the step it belongs to
            self._q.put(e)

    def get(self) -> tuple[StepData, float]:
        """The next step's data and the seconds the loop waited for it."""
        t0 = time.perf_counter()
        if self.depth <= 0:
            item = self.builder.build(self.next_step)
        else:
            if self._thread is None:
                self._q = queue.Queue(maxsize=self.depth)
                self._thread = threading.Thread(target=self._run, args=(self.next_step,), daemon=True,
                                                name="harts-prefetch")
                self._thread.start()
            item = self._q.get()
            if isinstance(item, BaseException):
                # the worker's own exception, unwrapped: its message names the file:line or setting, and
                # train.py prints it as one line (the note shows in tracebacks only)
                item.add_note(f"raised in the data worker thread while preparing step {self.next_step}")
                raise item
        self.next_step = item.step + 1
        return item, time.perf_counter() - t0

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
