"""Per-step metrics: one readable console line and a JSONL record (rank 0), optionally TensorBoard.

Throughput counts raw tokens (what the trajectory-wise baseline would process) and compact rows (what
HARTS actually runs); compression = raw / compact. MFU counts the model FLOPs of the rows actually run,
6 * (active non-embedding params + LM head) * compact rows (recomputation excluded, attention-score
FLOPs excluded), against the accelerator's bf16 peak (torchtitan's table); on a CPU it is not reported.
"""
from __future__ import annotations

import json
import math
import os
import resource

import torch

__all__ = ["MetricsLogger", "peak_memory_gib", "expert_balance"]


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)


def expert_balance(counts_LE: torch.Tensor) -> dict:
    """max/mean expert load per MoE layer (1 = perfectly balanced), averaged and worst over layers."""
    if counts_LE.numel() == 0:
        return {}
    c = counts_LE.double()
    ratio = c.max(dim=1).values / c.mean(dim=1).clamp_min(1e-12)
    return {"expert_load_max_over_mean": float(ratio.mean()), "expert_load_worst_layer": float(ratio.max())}


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        a = abs(v)
        return f"{v:.3e}" if (a and (a < 1e-3 or a >= 1e5)) else f"{v:.4f}"
    return str(v)


class MetricsLogger:
    def __init__(self, folder: str, *, rank: int, enable_tensorboard: bool = False, tb_folder: str = "tb",
                 color: bool = True):
        self.rank = rank
        self.path = None
        self.tb = None
        self.color = color
        if rank != 0:
            return
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "metrics.jsonl")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(folder, tb_folder))

    def truncate(self, step: int) -> int:
        """Keep the records of steps <= ``step`` (the resumed checkpoint's; 0 = a fresh run) so a resumed
        run does not duplicate the steps it trains again; returns how many records were dropped."""
        if self.rank != 0 or not os.path.exists(self.path):
            return 0
        with open(self.path) as f:
            lines = f.readlines()
        keep = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                pass  # a torn last line of a killed run: dropped with the later steps
        if len(keep) != len(lines):
            with open(self.path, "w") as f:
                f.writelines(keep)
        return len(lines) - len(keep)

    def log(self, rec: dict) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])
        keys = [("loss", "loss"), ("reward", "reward"), ("logp_gap", "gap"), ("grad_norm", "gnorm"),
                ("raw_tok_s", "raw tok/s"),
                ("compact_tok_s", "compact tok/s"), ("compression", "compr"), ("step_s", "step s"),
                ("data_wait_s", "wait s"), ("plan_s", "plan s"), ("mfu", "mfu%"), ("peak_mem_gib", "mem GiB"),
                ("expert_load_max_over_mean", "load max/mean")]
        parts = [f"step {rec['step']:>4}"]
        for k, label in keys:
            if k in rec and rec[k] is not None:
                v = rec[k] * 100 if k == "mfu" else rec[k]
                parts.append(f"{label} {_fmt(v)}")
        line = "  ".join(parts)
        print(f"\033[36m{line}\033[0m" if self.color else line, flush=True)  # colour only on a terminal

    def close(self):
        if self.tb is not None:
            self.tb.close()
