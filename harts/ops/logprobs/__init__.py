"""Compact log-probs through the LM head (fused fast path and pure-torch reference)."""
from harts.ops.logprobs.naive import compact_logprobs_reference

__all__ = ["compact_logprobs", "compact_logprobs_reference"]


def __getattr__(name):
    # The fast path imports triton; keep that cost out of reference-only users.
    if name in ("compact_logprobs", "CompactLogprobsFunction"):
        from harts.ops.logprobs import fused

        return getattr(fused, name)
    raise AttributeError(f"module 'harts.ops.logprobs' has no attribute {name!r}")
