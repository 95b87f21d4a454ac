"""The HARTS trainer: ``torchrun --nproc_per_node N train.py --config configs/X.toml [--section.key=value]``.

Submodules: ``config`` (torchtitan 0.2.2 JobConfig extended with our sections), ``model`` (the policy
module the parallelisms wrap), ``parallelize`` (mesh, TP, EP, activation checkpointing, compile, FSDP2),
``data`` (rollout steps, planning and packing in a background worker), ``trainer`` (the step loop),
``metrics``, ``checkpoint``, ``profiler``. Importing this package does not import torchtitan; ``config``
and ``trainer`` do.
"""
