"""Gated DeltaNet rounds with differentiable chunk-boundary states.

``chunk_gdn_round`` is the Triton fast path (fla-core 0.6.0's Gated DeltaNet pieces plus our two
boundary-state scans in ``harts.kernels.kda_round`` with their scalar-gate switch);
``chunk_gdn_round_reference`` is the exact pure-torch path with the same contract (any chunk size,
float64 on CPU). Both take q, k at the key heads and the per-head scalar log decay g [1, T, HV].
"""
from harts.ops.gdn_round.naive import check_gdn_round_inputs, chunk_gdn_round_reference

__all__ = ["chunk_gdn_round", "chunk_gdn_round_reference", "check_gdn_round_inputs"]


def __getattr__(name):
    # The fast path imports fla and triton; keep that cost out of reference-only users.
    if name in ("chunk_gdn_round", "ChunkGDNRoundFunction"):
        from harts.ops.gdn_round import chunk

        return getattr(chunk, name)
    raise AttributeError(f"module 'harts.ops.gdn_round' has no attribute {name!r}")
