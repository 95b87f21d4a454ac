"""The float64 debug-training settings shared by the trainer tests (one place to change them)."""

COMMON = """
[ling]
preset = "ling3-tiny-debug"
num_hidden_layers = 4
backend = "reference"
dtype = "float64"
[harts]
capacity = 64
[data]
preset = "tiny"
max_length = 40
reward = "learnable"
prefetch = 1
[rl]
z_loss_coef = 1e-3
aux_loss_coef = 1e-3
expert_bias_rate = 1e-2
[optimizer]
lr = 1e-3
implementation = "foreach"
weight_decay = 0.0
[lr_scheduler]
warmup_steps = 0
"""
