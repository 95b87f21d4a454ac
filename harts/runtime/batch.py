"""``harts.pack``: one microbatch as device tensors, with prefix sharing (HARTS) or without (baseline).

The planning layout (``harts.planning.layout``) is numpy; this module turns it into tensors once per
microbatch so the model never walks a tree. With ``prefix_sharing=False`` the same type describes the
trajectory-wise packed batch (every trajectory its own varlen sequence, no sharing), which the model
runs through its ordinary packed path: the baseline HARTS is measured against.

Legend: P physical rows (compact rows + alignment padding), N trajectories, S semantic positions,
S' = S - N nonterminal semantic positions (those with a next-token target), U distinct (row, target) pairs
of those positions, Q input sequences,
E emitted boundary states, w conv width.
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from harts.data.trajectory import RolloutBatch, Trajectory, as_token_arrays
from harts.env import ENV
from harts.planning.layout import later


@dataclass(frozen=True, eq=False)
class KDARound:
    """One packed KDA call: input positions gather physical rows (replay positions read ancestors)."""

    cu_seqlens: torch.Tensor  # [n+1] long, input offsets incl. replay
    cu_seqlens_cpu: torch.Tensor  # same on the host (no device sync to read lengths)
    max_seqlen: int
    gather: torch.Tensor  # [T_r] physical row of every input position
    output_positions: torch.Tensor  # [C_r] input positions that produce outputs
    phys_start: int  # outputs fill physical rows [phys_start, phys_end) in order
    phys_end: int
    init_source: torch.Tensor  # [n] long, index into the flat emitted-state list, -1 = zero state
    has_init: bool
    emit_seq: torch.Tensor  # [E_r] long, local sequence of each requested boundary state
    emit_chunk: torch.Tensor  # [E_r] long, sequence-local chunk whose start state is requested
    # The gather as pieces (``round_pieces``): sequence n reads replay_sizes[n] ancestor rows (``replay_rows``, in
    # order) and then own_sizes[n] rows of [phys_start, phys_end), in order. None: only the gather describes it
    # (the no-replay ablation's segments)
    own_sizes: tuple[int, ...] | None = None
    replay_sizes: tuple[int, ...] = ()
    replay_rows: torch.Tensor | None = None  # [sum replay_sizes] long
    replay_positions: torch.Tensor | None = None  # [sum replay_sizes] long, their input positions

    @property
    def num_states(self) -> int:
        return int(self.emit_seq.shape[0])


@dataclass(frozen=True, eq=False)
class CompactBatch:
    """Plan + layout of one microbatch as tensors, plus the original per-trajectory metadata.

    ``prefix_sharing`` False: rows are the semantic positions in original order and ``cu_seqlens`` the
    trajectory boundaries (the baseline); the KDA/MLA/conv views below are then unused.
    """

    prefix_sharing: bool
    chunk_size: int | None  # KDA chunk size the plan was made for (None: trajectory-wise, not needed)
    conv_width: int  # short-convolution width of the ancestor windows
    num_rows: int  # compact rows (work), excluding padding
    input_ids: torch.Tensor  # [P] long
    position_ids: torch.Tensor  # [P] long
    multiplicity: torch.Tensor  # [P] long, q_c (0 for padding)
    logprob_rows: torch.Tensor  # [S'] long, physical row of each nonterminal semantic position
    logprob_targets: torch.Tensor  # [S'] long, its next token
    logprob_offsets: tuple[int, ...]  # N+1, trajectory i's entries in logprob_rows
    trajectories: tuple[Trajectory, ...]  # original metadata, unchanged
    # baseline (prefix_sharing=False)
    cu_seqlens: torch.Tensor | None = None  # [N+1] long
    cu_seqlens_cpu: torch.Tensor | None = None  # the same on the host (stays there in .to): read by the kernels
    max_seqlen: int = 0
    # compact (prefix_sharing=True)
    # Positions that read the same row and predict the same token have the same log-prob: one per distinct
    # (row, target) pair, i.e. per child row of the trie (``logprob_pairs``), U <= P of them
    logprob_pair_rows: torch.Tensor | None = None  # [U] long, the pair's row
    logprob_pair_targets: torch.Tensor | None = None  # [U] long, its target
    logprob_pair_of: torch.Tensor | None = None  # [S'] long, the pair of each nonterminal semantic position
    conv_pred: torch.Tensor | None = None  # [P, w] physical rows 0..w-1 steps back on the path, -1 = none
    conv_cu_seqlens: torch.Tensor | None = None  # [Q+1] sequences' output blocks in physical rows
    conv_context: torch.Tensor | None = None  # [Q, w-1] ancestor rows before each block (oldest first), -1 = none
    rounds: tuple[KDARound, ...] = ()
    num_states: int = 0
    mla_q_rows: torch.Tensor | None = None  # [C]
    mla_q_is_identity: bool = True
    mla_kv_rows: torch.Tensor | None = None  # [sum_q e_q]
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # The same MLA visibility read in place (harts.ops.attention.tree): key k visible to query q iff
    # mla_row[k] >= 0 and mla_row[k] <= mla_row[q] < mla_row_end[k]
    mla_row: torch.Tensor | None = None  # [P] trie row of each physical row (DFS preorder), -1 for padding
    mla_row_end: torch.Tensor | None = None  # [P] exclusive end of that row's trie subtree, -1 for padding
    mla_block_size: int = 128  # rows per block of mla_block_counts
    kda_output_perm: torch.Tensor | None = None  # rounds' concatenated outputs -> physical order (no-replay)
    replay: bool = True  # False only for the fidelity ablation (see pack)
    cp: object | None = None  # harts.runtime.cp.ContextParallel when sharded over a CP group
    vocab_size: int | None = None  # token ids were checked against this vocab size in pack (None: not checked)
    stats: dict = field(default_factory=dict)
    # Objects derived from the layout on first use (MLA block counts; per device, the block mask shared by all
    # MLA layers)
    derived: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ sizes and helpers
    @property
    def mla_block_counts(self) -> torch.Tensor | None:
        """[nb, nb] int32 visible (query, key) pairs per block pair of ``mla_block_size`` physical rows
        (harts.planning.layout.mla_block_counts), counted on first use: only the FlexAttention path reads
        them, so packing does not pay for them. None for a trajectory-wise batch."""
        counts = self.derived.get("mla_block_counts")
        if counts is None and "mla_block_counts_of" in self.derived:
            counts = self.derived["mla_block_counts"] = torch.as_tensor(self.derived["mla_block_counts_of"](),
                                                                        dtype=torch.int32)
        return counts

    @property
    def mla_split_plan(self):
        """Where the cuDNN split of the MLA views reads each view's keys (``harts.ops.attention.split.split_plan``:
        long runs of contiguous ancestor rows in place, the rest gathered), built on the host on first use and
        shared by every MLA layer. None for a trajectory-wise batch."""
        plan = self.derived.get("mla_split_plan")
        if plan is None and "mla_split_plan_of" in self.derived:
            plan = self.derived["mla_split_plan"] = self.derived["mla_split_plan_of"]()
        return plan

    @property
    def num_phys(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trajectories(self) -> int:
        return len(self.logprob_offsets) - 1

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def split(self, values_S: torch.Tensor) -> list[torch.Tensor]:
        """Per-trajectory views of a tensor over nonterminal semantic positions (e.g. log-probs): its first
        dimension must be S', the length of ``logprob_rows`` (what ``model.logprobs(batch)`` returns)."""
        o = self.logprob_offsets
        got = f"{values_S.shape[0]} entries along dim 0" if getattr(values_S, "ndim", 0) else "no dim 0"
        if not getattr(values_S, "ndim", 0) or values_S.shape[0] != o[-1]:
            raise ValueError(f"CompactBatch.split: values has {got}, expected {o[-1]} entries (one per nonterminal "
                             "semantic position, as model.logprobs(batch) returns)")
        return [values_S[o[i] : o[i + 1]] for i in range(len(o) - 1)]

    def semantic(self, name: str, *, dtype=torch.float64, default: float | None = None) -> torch.Tensor:
        """A per-token metadata field, aligned with ``logprob_rows`` (entry t+1 of each trajectory, i.e.
        the metadata of the predicted token). Scalar ``advantage`` broadcasts. Missing fields raise
        unless ``default`` is given."""
        parts = []
        for i, t in enumerate(self.trajectories):
            arr = t.token_advantages() if name == "advantages" else getattr(t, name)
            if arr is None:
                if default is None:
                    raise KeyError(f"trajectory {i} has no {name!r}")
                arr = np.full(len(t), default, dtype=np.float64)
            parts.append(np.asarray(arr)[1:])
        flat = np.concatenate(parts) if parts else np.zeros(0)
        return torch.as_tensor(flat, dtype=dtype, device=self.device)

    def local_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-row tensor (all rows without context parallelism)."""
        return t if self.cp is None else self.cp.own_rows(t)

    def context_parallel(self, group) -> "CompactBatch":
        """This batch sharded over a context-parallel group (Ulysses style, see harts.runtime.cp):
        each rank keeps its share of the physical rows; the views stay whole."""
        if not self.prefix_sharing:
            raise ValueError("context parallelism is implemented for HARTS batches (prefix_sharing=True)")
        from harts.runtime.cp import ContextParallel

        return replace(self, cp=ContextParallel.create(group, self.num_phys))

    def to(self, device, non_blocking: bool = False) -> "CompactBatch":
        """Move every index tensor to ``device`` (the host copies of cu_seqlens stay on the CPU). Only a device:
        the tensors are indices, whose dtype is fixed; the model's dtype is the model's own."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"CompactBatch.to({device}): expected a device such as 'cuda' or torch.device('cuda:0'), "
                            "got a dtype; the batch holds index tensors, so cast the model instead (model.to(dtype))")
        if not isinstance(device, (str, int, torch.device)) or isinstance(device, bool):
            raise TypeError(f"CompactBatch.to({device!r}): expected a device such as 'cuda' or torch.device('cuda:0'), "
                            f"got {type(device).__name__}")

        def mv(x):
            return x.to(device, non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x

        changes = {f.name: mv(getattr(self, f.name)) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor) and f.name not in _HOST_BATCH_FIELDS}
        changes["rounds"] = tuple(
            replace(r, **{f.name: mv(getattr(r, f.name)) for f in fields(r)
                          if isinstance(getattr(r, f.name), torch.Tensor) and f.name not in _HOST_FIELDS})
            for r in self.rounds)
        return replace(self, **changes)


# Round fields read on the host by the kernels' argument checks: kept on the CPU to avoid device syncs.
_HOST_FIELDS = ("cu_seqlens_cpu", "emit_seq", "emit_chunk")
_HOST_BATCH_FIELDS = ("cu_seqlens_cpu",)


def _split_plan(*args, **kw):
    from harts.ops.attention.split import split_plan

    return split_plan(*args, **kw)


def _t(a) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long)


def _trajectories(trajectories) -> tuple[Trajectory, ...]:
    if isinstance(trajectories, RolloutBatch):
        return trajectories.trajectories
    out = []
    arrays = as_token_arrays(trajectories)
    for t, a in zip(trajectories, arrays):
        out.append(t if isinstance(t, Trajectory) else Trajectory(tokens=a))
    return tuple(out)


def _int_arg(name: str, value, minimum: int = 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"pack: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"pack: {name}={value} must be >= {minimum}")
    return int(value)


def _model_geometry(config, chunk_size, conv_width, vocab_size):
    """(chunk_size, conv_width, vocab_size) from ``config`` and the explicit arguments, which must agree."""
    chunk_size, conv_width = _int_arg("chunk_size", chunk_size), _int_arg("conv_width", conv_width)
    vocab_size = _int_arg("vocab_size", vocab_size)
    if config is None:
        return chunk_size, 4 if conv_width is None else conv_width, vocab_size
    cfg = getattr(config, "config", config)  # a model or its config
    missing = [a for a in ("layout_geometry", "vocab_size") if not hasattr(cfg, a)]
    if missing:
        raise TypeError(f"pack: config must be a model config (LingConfig, Qwen35Config) or a model with .config; "
                        f"{type(config).__name__} has no {', '.join(missing)}")
    want_chunk, want_conv = cfg.layout_geometry
    out = []
    for name, given, want in (("chunk_size", chunk_size, want_chunk), ("conv_width", conv_width, want_conv),
                              ("vocab_size", vocab_size, cfg.vocab_size)):
        want = int(want)
        if given is not None and given != want:
            raise ValueError(f"pack: {name}={given} disagrees with the model's {name}={want} "
                             f"({type(cfg).__name__}); drop {name} (the model's value is used) or build the "
                             f"model with {name}={given}")
        out.append(want)
    return tuple(out)


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, threads, pool)
_POOL_LOCK = threading.Lock()


def pack_threads() -> int:
    """Worker threads of pack's pool: ``HARTS_PACK_THREADS`` if set, else one per spare core, at most three (as
    many passes as can run at once). More threads than cores only contend: on 2 cores one worker packs faster
    than two."""
    if ENV.pack_threads is not None:
        try:
            n = int(ENV.pack_threads)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"HARTS_PACK_THREADS={ENV.pack_threads!r}: expected a number of threads >= 0 (0: pack "
                             "on its caller's thread alone)")
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(3, cores - 1)


def pack_pool() -> ThreadPoolExecutor | None:
    """The threads that run pack's independent passes beside its own (the input checks, the log-prob views and
    pairs, the convolution's predecessor rows; ``pack_threads()`` of them), or None for none. numpy releases the
    GIL in these passes, so they overlap. One pool per process: a forked child (a data-loader worker) makes its
    own, since the parent's threads do not exist there."""
    global _POOL
    n = pack_threads()
    if n == 0:
        return None
    with _POOL_LOCK:
        if _POOL is None or _POOL[:2] != (os.getpid(), n):
            _POOL = (os.getpid(), n, ThreadPoolExecutor(max_workers=n, thread_name_prefix="harts-pack"))
        return _POOL[2]


def _checked(checks) -> None:
    """Raise the first failed input check's error (as if raised here, not during another error)."""
    for result in checks:
        try:
            result()
        except Exception as e:
            raise e from None


def _check_vocab(arrays, vocab_size: int) -> None:
    for i, a in enumerate(arrays):
        if a.shape[0] and a.max() >= vocab_size:
            j = int(np.flatnonzero(a >= vocab_size)[0])
            raise ValueError(f"pack: trajectory {i} position {j}: token id {int(a[j])} is out of range for "
                             f"vocab_size={vocab_size}")


def pack(trajectories, *, config=None, chunk_size: int | None = None, prefix_sharing: bool = True,
         conv_width: int | None = None, vocab_size: int | None = None, pad_to_multiple: int = 1,
         replay: bool = True, mla_block_size: int = 128, plan=None) -> CompactBatch:
    """Plan (paper 3.3) and lay out one microbatch; ``prefix_sharing=False`` gives the baseline batch.

    The plan depends on the model: its KDA chunk size fixes the chunk grid that replay restores, its
    short-convolution width the ancestor windows. Pass ``config=model.config`` (a ``LingConfig``, or the
    model itself) and both come from the model, with ``vocab_size`` for a token-id range check. Without
    ``config``, ``chunk_size`` (required with prefix sharing) and ``conv_width`` (default 4) are taken
    as given; explicit values that disagree with ``config`` raise. A batch planned for another chunk size
    or convolution width gives wrong log-probs, so the model refuses it (``check_batch``). The
    trajectory-wise batch (``prefix_sharing=False``) uses neither; the model then runs its own chunk size.

    ``replay=False`` is the fidelity ablation of paper 5.4 (never for training): instead of the planned
    rounds, every fork-free segment is its own KDA sequence, started from its parent segment's final
    state (the exact state at the fork, passed directly), so a branch's chunk grid starts at the fork
    instead of being restored by replaying [a(p), p). Identical in real arithmetic; in finite precision
    the chunkwise kernels round differently, which is what the fidelity benchmark measures.

    ``mla_block_size``: rows per block of the MLA block-sparsity counts (``mla_block_counts``) that the
    fast tree attention's block mask is built from (128, FlexAttention's block, unless testing).

    ``plan``: the microbatch's call plan (``harts.planning.calls.plan_calls(trajectories, chunk_size=...)``), made
    earlier, e.g. where the microbatch is planned, so that pack only lays it out; checked against the
    trajectories and the chunk size (a ValueError names the first trajectory that differs). Without it pack plans.
    """
    mla_block_size = _int_arg("mla_block_size", mla_block_size)
    chunk_size, conv_width, vocab_size = _model_geometry(config, chunk_size, conv_width, vocab_size)
    if chunk_size is None and prefix_sharing:
        raise TypeError("pack: the KDA chunk size is required with prefix sharing: pass config=model.config "
                        "(or chunk_size=model.config.kda_chunk_size)")
    trajs = _trajectories(trajectories)
    if not trajs:
        raise ValueError("pack: empty microbatch (no trajectories)")
    arrays = [t.tokens for t in trajs]
    pool = pack_pool() if prefix_sharing else None
    # The checks of the inputs run beside the layout; their errors, which name the offending trajectory, are
    # raised before anything a bad input broke (``_checked``).
    checks = [later(pool, _check_vocab, arrays, vocab_size)] if vocab_size is not None else []
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    lp_offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths - 1, out=lp_offsets[1:])
    if not prefix_sharing:
        if plan is not None:
            raise ValueError("pack: the trajectory-wise batch (prefix_sharing=False) takes no call plan")
        return _pack_trajectory_wise(trajs, arrays, lengths, lp_offsets, chunk_size, conv_width, vocab_size)

    from harts.planning.calls import plan_calls
    from harts.planning.layout import build_layout, mla_block_counts

    if plan is None:
        plan = plan_calls(arrays, chunk_size=chunk_size)
    else:
        checks.append(later(pool, check_plan_matches, plan, arrays, lengths, chunk_size))
    try:
        lay = build_layout(plan, conv_width=conv_width, pad_to_multiple=pad_to_multiple, executor=pool)
    except Exception:
        _checked(checks)
        raise
    _checked(checks)
    from harts.ops.tree_conv import predecessor_index

    pairs = later(pool, logprob_pairs, lay.logprob_next_rows, lay.parent_phys, lay.tokens)
    conv_pred = later(pool, predecessor_index, lay.parent_phys, conv_width)
    rounds = []
    for r in lay.rounds:
        own_sizes, replay_sizes, replay_rows = round_pieces(r.cu_seqlens, r.is_output, r.gather, r.phys_start)
        rounds.append(KDARound(
            cu_seqlens=_t(r.cu_seqlens), cu_seqlens_cpu=_t(r.cu_seqlens), max_seqlen=int(r.max_seqlen),
            gather=_t(r.gather), output_positions=_t(r.output_positions),
            phys_start=int(r.phys_start), phys_end=int(r.phys_end), init_source=_t(r.init_source),
            has_init=bool((r.init_source >= 0).any()), emit_seq=_t(r.emit_seq), emit_chunk=_t(r.emit_chunk),
            own_sizes=own_sizes, replay_sizes=replay_sizes, replay_rows=_t(replay_rows),
            replay_positions=_t(np.flatnonzero(~r.is_output))))
    C, P = lay.num_rows, lay.num_phys
    pair_rows, pair_targets, pair_of = pairs()
    perm = None
    if not replay:
        rounds, perm, n_states = _segment_rounds(plan.trie, lay.phys_of_row, chunk_size)
    return CompactBatch(
        prefix_sharing=True, chunk_size=chunk_size, conv_width=conv_width, vocab_size=vocab_size, num_rows=C,
        input_ids=_t(lay.tokens), position_ids=_t(lay.position_ids), multiplicity=_t(lay.multiplicity),
        logprob_rows=_t(lay.logprob_rows), logprob_targets=_t(lay.logprob_targets),
        logprob_offsets=tuple(int(x) for x in lay.logprob_offsets), trajectories=trajs,
        logprob_pair_rows=_t(pair_rows), logprob_pair_targets=_t(pair_targets), logprob_pair_of=_t(pair_of),
        conv_pred=_t(conv_pred()),
        conv_cu_seqlens=_t(lay.seq_cu_seqlens), conv_context=_t(lay.conv_context),
        rounds=tuple(rounds), num_states=lay.num_states if replay else n_states,
        kda_output_perm=perm, replay=replay,
        mla_q_rows=_t(lay.mla_q_rows), mla_q_is_identity=bool(np.array_equal(lay.mla_q_rows, np.arange(P))),
        mla_kv_rows=_t(lay.mla_kv_rows), cu_seqlens_q=_t(lay.cu_seqlens_q), cu_seqlens_k=_t(lay.cu_seqlens_k),
        max_seqlen_q=int(lay.max_seqlen_q), max_seqlen_k=int(lay.max_seqlen_k),
        mla_row=_t(lay.row_of_phys), mla_row_end=_t(lay.mla_row_end), mla_block_size=mla_block_size,
        derived={"mla_block_counts_of": functools.partial(mla_block_counts, lay, mla_block_size),
                 "mla_split_plan_of": functools.partial(_split_plan, lay.cu_seqlens_q, lay.cu_seqlens_k,
                                                        lay.mla_kv_rows, num_keys=P)},
        stats={"raw_tokens": int(lengths.sum()), "compact_rows": C, "phys_rows": P,
               "kda_calls": lay.num_rounds, "kda_sequences": lay.num_sequences,
               "replay_tokens": lay.replay_tokens, "boundary_states": lay.num_states,
               "mla_kv_rows": lay.mla_kv_tokens, "logprob_pairs": int(pair_rows.shape[0])},
    )


def round_pieces(cu_seqlens: np.ndarray, is_output: np.ndarray, gather: np.ndarray, phys_start: int):
    """(own_sizes, replay_sizes, replay_rows) of one planned round: its input is, sequence by sequence, replay
    positions (ancestor rows, ``replay_rows`` in order) and then the sequence's own rows, the next ones of
    [phys_start, phys_end). Why pieces: a round's outputs are then the own pieces of the kernel's output (its
    backward a concatenation, where a gather of the output positions scatters with atomic index_adds), and the
    rounds' inputs of a tensor need only its own ranges and the replay rows (``harts.runtime.compact``'s
    ``_RoundInputs`` writes their gradient once). Checked against the layout's gather (a ValueError names the
    first position that disagrees)."""
    lens = np.diff(cu_seqlens)
    outs = np.concatenate([[0], np.cumsum(is_output, dtype=np.int64)])
    own = outs[cu_seqlens[1:]] - outs[cu_seqlens[:-1]]
    replay = lens - own
    pos = np.arange(gather.shape[0], dtype=np.int64) - np.repeat(cu_seqlens[:-1], lens)
    expect_out = pos >= np.repeat(replay, lens)
    expect_rows = np.where(expect_out, phys_start + np.cumsum(expect_out) - 1, gather)
    bad = (expect_out != is_output) | (expect_rows != gather)
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise ValueError(f"round_pieces: input position {t} (row {int(gather[t])}, output {bool(is_output[t])}) is "
                         f"not where replay-then-own sequences over rows from {phys_start} put it")
    return tuple(int(x) for x in own), tuple(int(x) for x in replay), gather[~is_output]


def check_plan_matches(plan, arrays, lengths_N: np.ndarray, chunk_size: int) -> None:
    """A call plan handed to ``pack`` must be the plan of these trajectories at this chunk size: its trie holds the
    same trajectories, in order, token for token (one vectorised comparison, far cheaper than planning again)."""
    from harts.planning.calls import CallPlan

    if not isinstance(plan, CallPlan):
        raise TypeError(f"pack: plan must be a CallPlan (harts.planning.calls.plan_calls), got {type(plan).__name__}")
    if plan.chunk_size != chunk_size:
        raise ValueError(f"pack: the plan was made for chunk_size={plan.chunk_size}, the batch needs {chunk_size}")
    trie = plan.trie
    if trie is None:
        raise ValueError("pack: the plan has no trie (a bare segment-tree plan); plan the trajectories with "
                         "plan_calls")
    if trie.num_trajectories != len(arrays):
        raise ValueError(f"pack: the plan is of {trie.num_trajectories} trajectories, the batch has {len(arrays)}")
    plan_lengths = np.diff(trie.offsets)
    if not np.array_equal(plan_lengths, lengths_N):
        n = int(np.flatnonzero(plan_lengths != lengths_N)[0])
        raise ValueError(f"pack: trajectory {n} has {int(lengths_N[n])} tokens, the plan's {int(plan_lengths[n])}")
    differ = trie.tokens[trie.row_of_position] != np.concatenate(arrays)
    if differ.any():
        s = int(np.flatnonzero(differ)[0])
        n = int(np.searchsorted(trie.offsets, s, side="right") - 1)
        raise ValueError(f"pack: trajectory {n} differs from the plan's at position {s - int(trie.offsets[n])}")


def logprob_pairs(next_rows_S: np.ndarray, parent_phys_P: np.ndarray, tokens_P: np.ndarray):
    """(pair_rows [U], pair_targets [U], pair_of [S']): the distinct (row, target) pairs of the log-prob
    positions. Position t of a trajectory reads row r(t) and predicts the token of row r(t+1) (``next_rows_S``,
    the layout's ``logprob_next_rows``), a child of r(t) in the trie; so the child row names the pair (row = its
    parent, target = its token), and the pairs are the child rows, in physical order. Why: every position of a
    shared prefix has the same log-prob (same hidden row, same target), so the log-prob op's per-position work
    (target logits, and their gradient terms [S', D] in fp32) is done once per pair and expanded by ``pair_of``:
    U is at most the physical rows, S' grows with every trajectory that shares the prefix.

    Every row with a parent is some position's next row (a trie row at depth d >= 1 is position d of each
    trajectory through it), so the pairs are the rows with a parent, found without a pass over the S'
    positions; a row that no position reached would only add an unused pair. ``pair_rows[pair_of]`` and
    ``pair_targets[pair_of]`` are the layout's ``logprob_rows`` and ``logprob_targets`` whenever its parent
    pointers follow the trie, which ``ExecutionLayout.validate`` checks (with the log-prob rows, next rows and
    targets themselves); pack does not check it again over every position."""
    child_U = np.flatnonzero(parent_phys_P >= 0)
    index_P = np.full(parent_phys_P.shape[0], -1, dtype=np.int64)
    index_P[child_U] = np.arange(child_U.size, dtype=np.int64)
    return parent_phys_P[child_U], tokens_P[child_U], index_P[next_rows_S]


def _pack_trajectory_wise(trajs, arrays, lengths, lp_offsets, chunk_size, conv_width, vocab_size) -> CompactBatch:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    S = int(offsets[-1])
    positions = np.arange(S, dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    tokens = np.concatenate(arrays)
    nonterminal = positions < np.repeat(lengths - 1, lengths)
    rows = np.flatnonzero(nonterminal)
    return CompactBatch(
        prefix_sharing=False, chunk_size=chunk_size, conv_width=conv_width, vocab_size=vocab_size, num_rows=S,
        input_ids=_t(tokens), position_ids=_t(positions), multiplicity=torch.ones(S, dtype=torch.long),
        logprob_rows=_t(rows), logprob_targets=_t(tokens[rows + 1]),
        logprob_offsets=tuple(int(x) for x in lp_offsets), trajectories=trajs,
        cu_seqlens=_t(offsets), cu_seqlens_cpu=_t(offsets), max_seqlen=int(lengths.max()),
        stats={"raw_tokens": S, "compact_rows": S, "phys_rows": S, "kda_calls": 1,
               "kda_sequences": len(arrays), "replay_tokens": 0, "boundary_states": 0, "mla_kv_rows": S},
    )


def _segment_rounds(trie, phys_of_row: np.ndarray, B: int):
    """No-replay schedule: one sequence per trie segment, round = segment depth, each segment started
    from its parent's final state. Returns (rounds, output permutation, number of states)."""
    G = trie.num_segments
    depth = np.zeros(G, dtype=np.int64)
    for g in range(G):  # parents precede children (preorder)
        p = trie.segment_parent[g]
        depth[g] = depth[p] + 1 if p >= 0 else 0
    has_child = np.zeros(G, dtype=bool)
    has_child[trie.segment_parent[trie.segment_parent >= 0]] = True
    state_of_seg = np.full(G, -1, dtype=np.int64)
    rounds, cat_rows, n_states = [], [], 0
    for d in range(int(depth.max()) + 1):
        segs = np.flatnonzero(depth == d)
        lens = trie.segment_end[segs] - trie.segment_start[segs]
        cu = np.zeros(len(segs) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        gather = np.concatenate([phys_of_row[trie.segment_start[g]:trie.segment_end[g]] for g in segs])
        parents = trie.segment_parent[segs]
        init = np.where(parents >= 0, state_of_seg[np.maximum(parents, 0)], -1)
        emit = np.flatnonzero(has_child[segs])
        state_of_seg[segs[emit]] = n_states + np.arange(len(emit))
        n_states += len(emit)
        rounds.append(KDARound(
            cu_seqlens=_t(cu), cu_seqlens_cpu=_t(cu), max_seqlen=int(lens.max()), gather=_t(gather),
            output_positions=_t(np.arange(int(cu[-1]))), phys_start=0, phys_end=0,
            init_source=_t(init), has_init=bool((init >= 0).any()), emit_seq=_t(emit),
            emit_chunk=_t(-(-lens[emit] // B))))  # chunk == number of chunks: the end state
        cat_rows.append(gather)
    cat = np.concatenate(cat_rows)
    perm = np.empty_like(cat)
    perm[cat] = np.arange(cat.shape[0])
    return tuple(rounds), _t(perm), n_states
