"""Compact execution runtime: ``pack`` a microbatch into a ``CompactBatch`` and run the model on it."""
from harts.runtime.batch import CompactBatch, KDARound, pack
from harts.runtime.compact import check_batch, compact_hidden, hidden_states, logprobs
from harts.runtime.padded import PaddedBatch, PaddedLayout, logprobs_and_entropies, pack_padded, unpack_padded

__all__ = ["CompactBatch", "KDARound", "pack", "check_batch", "compact_hidden", "hidden_states", "logprobs",
           "PaddedBatch", "PaddedLayout", "pack_padded", "unpack_padded", "logprobs_and_entropies"]
