"""KDA rounds with differentiable chunk-boundary states.

``chunk_kda_round`` is the Triton fast path (fla-core 0.6.0 kernels plus our two state-recurrence
kernels in ``harts.kernels.kda_round``); ``chunk_kda_round_reference`` is the exact pure-torch path
with the same contract (any chunk size, float64 on CPU).
"""
from harts.ops.kda_round.naive import chunk_kda_round_reference, kda_gate_reference

__all__ = ["chunk_kda_round", "chunk_kda_round_reference", "kda_gate_reference"]


def __getattr__(name):
    # The fast path imports fla and triton; keep that cost out of reference-only users.
    if name in ("chunk_kda_round", "ChunkKDARoundFunction"):
        from harts.ops.kda_round import chunk

        return getattr(chunk, name)
    raise AttributeError(f"module 'harts.ops.kda_round' has no attribute {name!r}")
