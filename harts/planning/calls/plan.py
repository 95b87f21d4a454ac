"""The value a minimum-call plan is (paper 3.3): rounds of packed input sequences, their replay intervals,
initial states and emitted boundary states, as numpy arrays in a frozen dataclass.

Legend: G segments, Q input sequences (all rounds), R rounds (= num_calls), E emitted boundary states.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.planning.calls.validate import validate_plan
from harts.planning.segments import SegmentTree

ZERO_STATE = -1  # state source of a sequence that starts from the zero state (position 0)


@dataclass(frozen=True, eq=False)
class CallPlan:
    """The linear-attention schedule of one microbatch: rounds of packed input sequences.

    Sequences are numbered round-major (global id q; round r holds q in round_offsets[r]:round_offsets[r+1]).
    Sequence q covers positions [replay_start, end) of the path to its last segment (a leaf): positions
    [replay_start, start) are replay (state updates only), [start, end) produce outputs. It starts from the
    zero state (init_sequence == -1, then replay_start == 0) or from the state at position replay_start
    emitted by sequence init_sequence of an earlier round, at that sequence's local chunk
    (replay_start - its replay_start) / B. ``emit_chunks[emit_offsets[q]:emit_offsets[q+1]]`` are the
    sequence-local chunk indices whose start states q must return (sorted, unique, >= 1).
    """

    chunk_size: int
    tree: SegmentTree
    t_pre: np.ndarray  # [G] Eq. (14) per segment
    t_in: np.ndarray  # [G] Eq. (13) per segment
    direct_child: np.ndarray  # [G] chosen direct continuation (-1 for a leaf)
    segment_sequence: np.ndarray  # [G] the sequence that outputs the segment
    round_offsets: np.ndarray  # [R+1]
    seq_round: np.ndarray  # [Q]
    seq_first_segment: np.ndarray  # [Q]
    seq_last_segment: np.ndarray  # [Q] a leaf
    seq_replay_start: np.ndarray  # [Q] a = a(start)
    seq_start: np.ndarray  # [Q] s
    seq_end: np.ndarray  # [Q] e
    seq_init: np.ndarray  # [Q] global id of the emitting sequence, or ZERO_STATE
    emit_offsets: np.ndarray  # [Q+1]
    emit_chunks: np.ndarray  # [E] sequence-local chunk indices
    seq_trajectory: np.ndarray  # [Q] a trajectory whose path holds [0, end) (-1 without a trie)
    trie: object = None  # the CompactTrie the plan was made for (None for bare segment trees)

    # ------------------------------------------------------------------ sizes
    @property
    def num_calls(self) -> int:
        """Sequential packed linear-attention calls per layer (= rounds)."""
        return int(self.round_offsets.shape[0] - 1)

    @property
    def num_sequences(self) -> int:
        return int(self.seq_round.shape[0])

    @property
    def replay_tokens(self) -> int:
        """R of Eq. (15), as realised by the plan: total replay positions over all sequences."""
        return int((self.seq_start - self.seq_replay_start).sum())

    @property
    def num_emitted_states(self) -> int:
        return int(self.emit_chunks.shape[0])

    def sequences_per_round(self) -> list[int]:
        return np.diff(self.round_offsets).tolist()

    def seq_local_index(self) -> np.ndarray:
        """Index of each sequence within its round."""
        return np.arange(self.num_sequences) - self.round_offsets[self.seq_round]

    def init_chunk(self) -> np.ndarray:
        """[Q] the emitter-local chunk index of each sequence's initial state (-1 for the zero state)."""
        src = self.seq_init
        has = src >= 0
        out = np.full(self.num_sequences, -1, dtype=np.int64)
        out[has] = (self.seq_replay_start[has] - self.seq_replay_start[src[has]]) // self.chunk_size
        return out

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        local = self.seq_local_index().tolist()
        rounds: list[list[dict]] = [[] for _ in range(self.num_calls)]
        traj = self.seq_trajectory.tolist()
        a, s, e = self.seq_replay_start.tolist(), self.seq_start.tolist(), self.seq_end.tolist()
        src, rnd = self.seq_init.tolist(), self.seq_round.tolist()
        eo, ec = self.emit_offsets.tolist(), self.emit_chunks.tolist()
        for q in range(self.num_sequences):
            j = src[q]
            rounds[rnd[q]].append(
                {
                    "trajectory": traj[q],
                    "replay_start": a[q],
                    "start": s[q],
                    "end": e[q],
                    "init_state": None if j < 0 else {"round": rnd[j], "sequence": local[j]},
                    "emit_chunks": ec[eo[q] : eo[q + 1]],
                }
            )
        return {"num_calls": self.num_calls, "replay_tokens": self.replay_tokens, "rounds": rounds}

    def summary(self) -> dict:
        return {
            "chunk_size": self.chunk_size,
            "segments": self.tree.num_segments,
            "trees": self.tree.num_trees,
            "num_calls": self.num_calls,
            "replay_tokens": self.replay_tokens,
            "sequences": self.num_sequences,
            "sequences_per_round": self.sequences_per_round(),
            "emitted_states": self.num_emitted_states,
        }

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check every guarantee of the plan; raises ValueError naming the offending item and its values."""
        validate_plan(self)



def assemble_plan(tree, B, t_pre, t_in, direct, seq_of, s_round, s_first, s_last, s_src, s_a, state_seq, state_pos,
                  *, trie, leaf_trajectory, seq_named_by_first=False) -> CallPlan:
    """Renumber sequences round-major (by first segment within a round) and build the plan arrays.

    Sequences come in as creation ids 0..Q-1 (or, with ``seq_named_by_first``, as their first segment).
    """
    rnd = np.asarray(s_round, dtype=np.int64)
    Q = rnd.shape[0]
    if seq_named_by_first:
        cid = np.full(tree.num_segments, -1, dtype=np.int64)
        cid[np.asarray(s_first, dtype=np.int64)] = np.arange(Q, dtype=np.int64)
        seq_of = cid[np.asarray(seq_of, dtype=np.int64)]
        state_seq = cid[np.asarray(state_seq, dtype=np.int64)].tolist()
    order = np.lexsort((np.asarray(s_first, dtype=np.int64), rnd))  # new id -> creation id
    new_of = np.empty(Q, dtype=np.int64)
    new_of[order] = np.arange(Q, dtype=np.int64)
    R = int(rnd.max()) + 1
    round_offsets = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(np.bincount(rnd, minlength=R), out=round_offsets[1:])

    first = np.asarray(s_first, dtype=np.int64)[order]
    last = np.asarray(s_last, dtype=np.int64)[order]
    a = np.asarray(s_a, dtype=np.int64)[order]
    # State ids -> emitting sequence (new numbering).
    st_seq = new_of[np.asarray(state_seq, dtype=np.int64)] if state_seq else np.zeros(0, dtype=np.int64)
    st_pos = np.asarray(state_pos, dtype=np.int64)
    src_c = np.asarray(s_src, dtype=np.int64)[order]
    seq_init = np.where(src_c >= 0, st_seq[np.maximum(src_c, 0)] if st_seq.shape[0] else -1, ZERO_STATE)
    # Emits per sequence: chunk (pos - a_emitter) / B, sorted.
    if st_seq.shape[0]:
        chunk = (st_pos - a[st_seq]) // B
        key = np.lexsort((chunk, st_seq))
        emit_seq, emit_chunks = st_seq[key], chunk[key]
    else:
        emit_seq = emit_chunks = np.zeros(0, dtype=np.int64)
    emit_offsets = np.zeros(Q + 1, dtype=np.int64)
    np.cumsum(np.bincount(emit_seq, minlength=Q), out=emit_offsets[1:])

    start = tree.start[first]
    end = tree.end[last]
    if leaf_trajectory is not None:
        seq_traj = leaf_trajectory[last]
    else:
        seq_traj = np.full(Q, -1, dtype=np.int64)
    return CallPlan(
        chunk_size=B,
        tree=tree,
        t_pre=t_pre,
        t_in=t_in,
        direct_child=np.asarray(direct, dtype=np.int64),
        segment_sequence=new_of[np.asarray(seq_of, dtype=np.int64)],
        round_offsets=round_offsets,
        seq_round=rnd[order],
        seq_first_segment=first,
        seq_last_segment=last,
        seq_replay_start=a,
        seq_start=start,
        seq_end=end,
        seq_init=seq_init.astype(np.int64),
        emit_offsets=emit_offsets,
        emit_chunks=emit_chunks.astype(np.int64),
        seq_trajectory=np.asarray(seq_traj, dtype=np.int64),
        trie=trie,
    )
