"""The float64 debug-training settings shared by the trainer tests (one place to change them), and the
PPO JSONL steps several of them train on."""
import json

import numpy as np

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


def write_ppo_steps(folder, seed: int) -> list:
    """Two JSONL steps of the tiny workload (generator seeds ``seed`` and ``seed + 1``), truncated to 40
    tokens, each trajectory with a data advantage and random old/ref log-probs around log(1/512)."""
    from harts.data.synthetic import generate

    paths = []
    for k in range(2):
        rng = np.random.default_rng(k)
        path = folder / f"step{k}.jsonl"
        with open(path, "w") as f:
            for t in generate("tiny", seed=seed + k).trajectories:
                L = min(len(t), 40)
                f.write(json.dumps({"tokens": t.tokens[:L].tolist(), "loss_mask": t.loss_mask[:L].tolist(),
                                    "advantage": float(rng.normal()), "group_id": int(t.group_id),
                                    "old_logprobs": (np.log(1 / 512) + 0.5 * rng.normal(size=L)).tolist(),
                                    "ref_logprobs": (np.log(1 / 512) + 0.3 * rng.normal(size=L)).tolist()}) + "\n")
        paths.append(path)
    return paths
