"""What the model families share above and around their layers: the causal-LM surface (``causal_lm``:
forward, log-probs, router statistics, HF checkpoints through the family registry), the decoder stack
(``stack``: packed or compact batches, the layer loop), parameter init by name (``init``), incremental
decoding (``generate``), chunked log-probs (``logprobs``), and torch.compile / selective checkpointing as
the layers' execution engine (``compile``). Each family's own layers live in ``harts.models.ling`` and
``harts.models.qwen35``."""
