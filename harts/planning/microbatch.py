"""Prefix-aware microbatch, DP-replica and slot planning (paper 3.2): ``plan_microbatches``.

Candidates (all with K a multiple of D, capacity-feasible, nonempty), in tie-break order:
  * N <= 512: the exact contiguous DP of Eq. 9 for every K in the Eq. 8 range;
  * N > 512: the natural partition evolved to every sampled K (budget 32);
  * the trie-aware greedy candidate (Eq. 10, 8 plans, small-eliminated, DP-aligned, one chosen);
  * refined anchors: the greedy one for N <= 512; for N > 512 also the lowest-work base candidate and
    the remaining base candidate whose K is closest to the greedy K (at most three distinct);
  * default mode only, N > 512 (a deliberate addition to the paper, see docs/planner.md): the exact DP
    partitions for every Eq. 8 target and the refined lowest-work one, when the banded DP fits its
    budget. ``exact_threshold=512`` gives the paper's rule literally.
Each candidate gets the greedy DP-replica/slot schedule and the winner minimises J of Eq. 4
lexicographically (ties: the earlier candidate in the order above), so the additions can only lower J.

CLI: ``python -m benchmarks.plan_microbatches_cli --input F.jsonl --dp D --capacity T [--json OUT]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from harts.data.trajectory import as_token_arrays
from harts.planning.checks import integer_arg, require, require_all
from harts.planning.exact_dp import dp_size, exact_partitions, first_feasible_start
from harts.planning.greedy import best_greedy, relabel
from harts.planning.heuristic import evolve_natural, sample_targets
from harts.planning.natural import cuts_to_owner, k_range, natural_partition
from harts.planning.prefix_cost import PrefixIndex, build_prefix_index
from harts.planning.refine import refine
from harts.planning.schedule import assign_slots, objective, slot_imbalances, step_imbalance

N0 = 512  # exact-search threshold
MAX_ANCHORS = 3
# Default mode above N0: the exact DP is added when it is cheap. Its cost is at most K (N+1) B cells (the
# ragged DP visits only the feasible ones, ~1/3 of them on swe-step: a full step counts <= 1.4e7 cells and
# takes 3.5-8 ms), so 1e8 cells bounds it well under 0.1 s; (N+1) B bounds its per-row cell arrays (memory).
EXACT_CELL_BUDGET = 100_000_000
EXACT_ROW_BUDGET = 1 << 21

Candidate = tuple[str, np.ndarray, "np.ndarray | None"]  # (label, owner by position, cuts or None)


class PlanningError(ValueError):
    """Bad planner input or an infeasible request; the message names the offending item."""


@dataclass(frozen=True, eq=False)
class MicrobatchPlan:
    """A fully instantiated plan. Microbatch ids are slot-major: id = slot * D + replica.

    ``microbatches[i]``: original trajectory indices (ascending) of microbatch i; ``replicas[d]``: the
    microbatch ids replica d runs, in slot order; ``work[i]``: compact work C of microbatch i;
    ``objective``: J = (total work, slot-critical work, max replica work)."""

    microbatches: list
    replicas: list
    work: list
    objective: tuple
    capacity: int = 0
    dp_degree: int = 0
    candidate: str = field(default="", compare=False)  # which candidate won (diagnostics only)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def num_slots(self) -> int:
        return len(self.microbatches) // max(self.dp_degree, 1)

    def slots(self) -> np.ndarray:
        """[K/D, D] microbatch ids."""
        return np.asarray(self.replicas, dtype=np.int64).T.reshape(self.num_slots, self.dp_degree)

    def slot_imbalances(self) -> np.ndarray:
        return slot_imbalances(np.asarray(self.work, dtype=np.int64), self.slots())

    def step_imbalance(self) -> float:
        return step_imbalance(np.asarray(self.work, dtype=np.int64), self.slots())

    def validate(self, trajectories=None) -> None:
        """Check every guarantee; raises ValueError naming the offending microbatch, replica or trajectory.
        With ``trajectories`` also recompute each microbatch's work from its tokens (sort + adjacent LCP, Eq. 5)."""
        k, d = len(self.microbatches), self.dp_degree
        require(isinstance(d, (int, np.integer)) and d >= 1 and k >= d,
                lambda: f"need at least D = {d} microbatches (D >= 1), got {k}")
        require(k % d == 0, lambda: f"K = {k} microbatches is not a multiple of D = {d}")
        for i, mb in enumerate(self.microbatches):
            require(len(mb) > 0, lambda: f"microbatch {i} is empty")
        members = [i for mb in self.microbatches for i in mb]
        n = len(members)
        seen = np.bincount(np.asarray(members, dtype=np.int64), minlength=n) if n else np.zeros(0, np.int64)
        require(all(0 <= i < n for i in members),
                lambda: f"trajectory {next(i for i in members if not 0 <= i < n)} is not in [0, {n})")
        require_all(seen == 1, lambda t: f"trajectory {t} is in {int(seen[t])} microbatches, expected exactly one")
        require(len(self.work) == k, lambda: f"{len(self.work)} work entries for {k} microbatches")
        for i, w in enumerate(self.work):
            require(0 < w <= self.capacity, lambda: f"microbatch {i}: work {w} is not in (0, capacity {self.capacity}]")
        require(len(self.replicas) == d, lambda: f"{len(self.replicas)} replicas, expected D = {d}")
        for r, ids in enumerate(self.replicas):
            require(len(ids) == k // d, lambda: f"replica {r} runs {len(ids)} microbatches, expected K/D = {k // d}")
        placed = [i for r in self.replicas for i in r]
        require(all(0 <= i < k for i in placed),
                lambda: f"microbatch id {next(i for i in placed if not 0 <= i < k)} is not in [0, {k})")
        runs = np.bincount(np.asarray(placed, dtype=np.int64), minlength=k)
        require_all(runs == 1, lambda i: f"microbatch {i} is on {int(runs[i])} replicas, expected exactly one")
        work = np.asarray(self.work, dtype=np.int64)
        w = work[np.asarray(self.replicas, dtype=np.int64)]  # [D, K/D]
        j = (int(work.sum()), int(w.max(axis=0).sum()), int(w.sum(axis=1).max()))
        require(tuple(self.objective) == j, lambda: f"objective {tuple(self.objective)} != recomputed {j}")
        if trajectories is not None:
            arrays = as_token_arrays(trajectories)
            require(len(arrays) == n, lambda: f"plan covers {n} trajectories, got {len(arrays)}")
            for i, mb in enumerate(self.microbatches):
                got = build_prefix_index([arrays[t] for t in mb]).total_work
                require(got == self.work[i], lambda: f"microbatch {i}: work {self.work[i]} != recomputed {got}")

    def to_dict(self) -> dict:
        return {
            "microbatches": [list(map(int, mb)) for mb in self.microbatches],
            "replicas": [list(map(int, r)) for r in self.replicas],
            "work": [int(w) for w in self.work],
            "objective": [int(v) for v in self.objective],
        }


# ------------------------------------------------------------------------------------ planning


def check_inputs(lengths: np.ndarray, dp_degree, capacity) -> None:
    """Planner inputs: dp_degree and capacity are ints or numpy integers >= 1 (TypeError for a float or a
    string, PlanningError below 1), at least D trajectories, none longer than the capacity."""
    where = "plan_microbatches"
    dp_degree = integer_arg(dp_degree, "dp_degree", where=where, error=PlanningError)
    capacity = integer_arg(capacity, "capacity", where=where, error=PlanningError)
    n = lengths.shape[0]
    if n == 0:
        raise PlanningError(f"{where}: no trajectories to plan (empty input)")
    if n < dp_degree:
        raise PlanningError(f"{n} trajectories cannot fill {dp_degree} DP replicas (need at least one each)")
    over = np.flatnonzero(lengths > capacity)
    if over.shape[0]:
        i = int(over[0])
        raise PlanningError(
            f"trajectory {i} has {int(lengths[i])} tokens, more than the microbatch capacity {capacity}"
            + (f" ({over.shape[0]} trajectories exceed it)" if over.shape[0] > 1 else "")
        )


def candidates(index: PrefixIndex, dp: int, capacity: int, exact_threshold: int | None = None) -> list[Candidate]:
    """All candidate groupings as (label, owner by position, cuts or None), in tie-break order.

    ``exact_threshold`` None (default): the paper's N0 = 512, and for N > N0 the banded exact DP's
    partitions and the refined lowest-work one are *added* after the paper's candidates when the DP fits
    ``EXACT_CELL_BUDGET`` / ``EXACT_ROW_BUDGET``. J is a minimum over all candidates and the paper's come
    first (they win ties), so this never raises J above the literal rule. An int: exactly the paper's
    rule with that N0 (512 = the paper as written), no additions."""
    n = index.n
    n0 = N0 if exact_threshold is None else exact_threshold
    natural = natural_partition(index, capacity)
    targets = k_range(index.total_work, capacity, dp, natural.shape[0] - 1, n)
    base: list[Candidate] = []
    if n <= n0:
        for k, cuts in sorted(exact_partitions(index, capacity, targets).items()):
            base.append((f"exact K={k}", cuts_to_owner(cuts, n), cuts))
    else:
        for k, cuts in sorted(evolve_natural(index, natural, capacity, sample_targets(targets)).items()):
            base.append((f"evolved K={k}", cuts_to_owner(cuts, n), cuts))
    out = list(base)
    greedy = best_greedy(index, capacity, dp)
    anchors: list[tuple[str, np.ndarray]] = []
    if greedy is not None:
        out.append(("greedy", greedy, None))
        anchors.append(("greedy", greedy))
        if n > n0 and base:
            works = [int(index.interval_work(c[:-1], c[1:]).sum()) for _, _, c in base]
            low = int(np.argmin(works))
            anchors.append(base[low][:2])
            kg = int(greedy.max()) + 1
            rest = [i for i in range(len(base)) if i != low]
            if rest:
                near = min(rest, key=lambda i: (abs(base[i][2].shape[0] - 1 - kg), i))
                anchors.append(base[near][:2])
    for label, owner in anchors[:MAX_ANCHORS]:
        out.append((f"refined {label}", refine(index, owner, capacity), None))
    if exact_threshold is None and n > n0:
        out.extend(exact_additions(index, capacity, targets))
    return out


def exact_additions(index: PrefixIndex, capacity: int, targets: list[int]) -> list[Candidate]:
    """The default mode's extra candidates above N0: exact DP partitions for every Eq. 8 target and the
    refined lowest-work one, or nothing when the DP would exceed the cell/row budget."""
    first = first_feasible_start(index, capacity)
    cells, row = dp_size(index, capacity, targets, first)
    if cells > EXACT_CELL_BUDGET or row > EXACT_ROW_BUDGET:
        return []
    out: list[Candidate] = []
    for k, cuts in sorted(exact_partitions(index, capacity, targets, first).items()):
        out.append((f"exact K={k} (above N0)", cuts_to_owner(cuts, index.n), cuts))
    if out:
        low = min(range(len(out)), key=lambda i: (int(index.interval_work(out[i][2][:-1], out[i][2][1:]).sum()), i))
        out.append((f"refined {out[low][0]}", refine(index, out[low][1], capacity), None))
    return out


def plan_index(index: PrefixIndex, dp: int, capacity: int,
               exact_threshold: int | None = None) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, tuple]:
    """Best candidate under J: (label, owner by position, work per group, slots [K/D, D], J)."""
    best = None
    seen: set[bytes] = set()
    for label, owner, cuts in candidates(index, dp, capacity, exact_threshold):
        if cuts is None:
            owner = relabel(owner)  # contiguous owners from cuts are already canonical
        key = owner.tobytes()
        if key in seen:
            continue
        seen.add(key)
        k = int(owner[-1] if cuts is not None else owner.max()) + 1
        if k % dp:
            continue
        work = index.interval_work(cuts[:-1], cuts[1:]) if cuts is not None else index.owner_work(owner, k)
        if work.max() > capacity:
            raise RuntimeError(f"planner bug: candidate {label} exceeds capacity {capacity} ({int(work.max())})")
        if best is not None and int(work.sum()) > best[4][0]:
            continue  # J is lexicographic and total work comes first: this one cannot win
        slots = assign_slots(work, dp)
        j = objective(work, slots)
        if best is None or j < best[4]:
            best = (label, owner, work, slots, j)
    if best is None:
        raise PlanningError(
            f"no DP-compatible plan: {index.n} trajectories cannot form a multiple of D = {dp} capacity-feasible "
            f"nonempty microbatches at capacity {capacity}"
        )
    return best


def plan_from_arrays(arrays: list[np.ndarray], *, dp_degree: int, capacity: int,
                     exact_threshold: int | None = None) -> MicrobatchPlan:
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    check_inputs(lengths, dp_degree, capacity)
    dp_degree, capacity = int(dp_degree), int(capacity)
    if exact_threshold is not None:
        exact_threshold = integer_arg(exact_threshold, "exact_threshold", where="plan_microbatches", minimum=0,
                                      error=PlanningError)
    index = build_prefix_index(arrays)
    label, owner, work, slots, j = plan_index(index, dp_degree, capacity, exact_threshold)
    k = work.shape[0]
    # Slot-major ids: microbatch slots[s, d] becomes s * D + d.
    new_id = np.empty(k, dtype=np.int64)
    new_id[slots.ravel()] = np.arange(k, dtype=np.int64)
    owner_orig = np.empty(index.n, dtype=np.int64)
    owner_orig[index.order] = new_id[owner]
    members = np.argsort(owner_orig, kind="stable")
    counts = np.bincount(owner_orig, minlength=k)
    microbatches = [m.tolist() for m in np.split(members, np.cumsum(counts)[:-1])]
    work_new = np.empty(k, dtype=np.int64)
    work_new[new_id] = work
    replicas = [list(range(d, k, dp_degree)) for d in range(dp_degree)]
    return MicrobatchPlan(
        microbatches=microbatches,
        replicas=replicas,
        work=work_new.tolist(),
        objective=tuple(int(v) for v in j),
        capacity=int(capacity),
        dp_degree=int(dp_degree),
        candidate=label,
    )


def plan_microbatches(trajectories, *, dp_degree: int, capacity: int,
                      exact_threshold: int | None = None) -> MicrobatchPlan:
    """Plan microbatch membership, DP replicas and slots for one step (paper 3.2).

    ``trajectories``: a RolloutBatch, Trajectory objects or token-id sequences. Raises PlanningError (a
    ValueError) for a trajectory longer than ``capacity`` (named), dp_degree or capacity < 1, empty input,
    fewer trajectories than DP replicas, or when no DP-compatible plan exists.

    ``exact_threshold``: None (default) plans like the paper with N0 = 512 and, above N0, also offers the
    exact contiguous DP's partitions (Eq. 9) as candidates whenever the banded DP is within budget (about
    10 ms at N ~ 1,900); J is minimised over all candidates, so this is never worse than the paper's rule.
    An int N0 reproduces the paper's rule literally with that threshold (512 = the paper; a huge value =
    exact DP instead of the sampled-K evolution at every N)."""
    integer_arg(dp_degree, "dp_degree", where="plan_microbatches", error=PlanningError)
    integer_arg(capacity, "capacity", where="plan_microbatches", error=PlanningError)
    arrays = as_token_arrays(trajectories)
    return plan_from_arrays(arrays, dp_degree=dp_degree, capacity=capacity, exact_threshold=exact_threshold)
