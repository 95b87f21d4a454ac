"""The HARTS trainer: ``torchrun --nproc_per_node N train.py --config configs/X.toml [--section.key=value]``.

Submodules: ``config`` (torchtitan 0.2.2 JobConfig extended with our sections), ``model`` (the policy
module the parallelisms wrap), ``parallelize`` (mesh, TP, EP, activation checkpointing, compile, FSDP2),
``pipeline`` (pipeline-parallel stages and schedules), ``data`` (rollout steps, planning and packing in a
background worker), ``trainer`` (setup, the step loop, checkpoints through torchtitan's CheckpointManager,
the profiler hook and the HF export), ``metrics`` and ``bf16_adamw`` (AdamW for bf16 weights with fp32
master bits). Importing this package does not import torchtitan; ``config`` and ``trainer`` do.
"""
