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

__all__ = ["MetricsLogger", "StepSums", "peak_memory_gib", "expert_balance"]


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


class StepSums:
    """One step's metric sums by name, the MoE assignment counts and the non-finite flags of every rank, in
    one float64 buffer that one all-reduce over the world sums: metrics and counts from one rank per tensor-
    parallel group (TP replicas hold the same values; the others contribute zeros), flags from every rank
    (so all ranks see every bad rank and stop together). Everything stays on the device until ``reduce``,
    which makes the step's one host read.

    Flags: ``bad[kind, rank]`` = 1 + the first microbatch id whose loss (kind 0) or accumulated gradients
    (kind 1) are non-finite on that rank, 0 if none; the gradient check is the sum of the gradients' norms."""

    NAMES = ("loss", "policy_loss", "kl", "clip_frac", "router_loss", "positions",
             "probe_good_logp", "probe_good_n", "probe_bad_logp", "probe_bad_n")

    def __init__(self, device, *, world: int, rank: int, counts_shape: tuple[int, int] | None):
        self.world, self.rank = world, rank
        self.values = torch.zeros(len(self.NAMES), dtype=torch.float64, device=device)
        self.counts = None if counts_shape is None else torch.zeros(counts_shape, dtype=torch.float64, device=device)
        self.bad = torch.zeros(2, world, dtype=torch.float64, device=device)
        self.grads_by_stage = False  # pipeline: gradients are checked once per stage, flagged as stage + 1

    def add(self, **terms) -> None:
        """Add named terms (0-d tensors or floats) to the sums."""
        for k, v in terms.items():
            self.values[self.NAMES.index(k)] += v

    def add_counts(self, counts_LE: torch.Tensor) -> None:
        self.counts += counts_LE.to(torch.float64)

    def flag(self, kind: int, mb_id: int, value: torch.Tensor) -> None:
        """Record microbatch ``mb_id`` as this rank's first bad one of ``kind`` if ``value`` is non-finite."""
        cur = self.bad[kind, self.rank]
        cand = torch.where(torch.isfinite(value.detach()), 0.0, float(mb_id + 1)).to(torch.float64)
        self.bad[kind, self.rank] = torch.where(cur > 0, cur, cand)

    def reduce(self, group_is_world: bool, contribute: bool) -> dict:
        """Sum over all ranks (``group_is_world``: a process group exists) with one all-reduce; metrics and
        counts count only where ``contribute``. Returns the named sums; counts stay on the device."""
        import torch.distributed as dist

        parts = [self.values] + ([self.counts.flatten()] if self.counts is not None else []) + [self.bad.flatten()]
        buf = torch.cat(parts)
        if not contribute:
            buf[: buf.numel() - self.bad.numel()] = 0
        if group_is_world:
            dist.all_reduce(buf)
        n, nc = self.values.numel(), 0 if self.counts is None else self.counts.numel()
        if self.counts is not None:
            self.counts = buf[n:n + nc].view_as(self.counts)
        host = buf.tolist()
        self.bad_host = [host[n + nc:n + nc + self.world], host[n + nc + self.world:]]
        return dict(zip(self.NAMES, host[:n]))

    def nonfinite(self) -> str | None:
        """After ``reduce``: where the step went non-finite ("non-finite loss in microbatch 3 on rank 1; ..."),
        or None."""
        where = [f"non-finite loss in microbatch {int(v) - 1} on rank {r}" for r, v in enumerate(self.bad_host[0]) if v]
        grads = "non-finite gradients of pipeline stage {} on rank {}" if self.grads_by_stage else \
            "non-finite gradients in microbatch {} on rank {}"
        where += [grads.format(int(v) - 1, r) for r, v in enumerate(self.bad_host[1]) if v]
        return "; ".join(where) or None


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
                ("raw_tok_s", "raw tok/s"), ("compact_tok_s", "compact tok/s"), ("compression", "compr"),
                ("step_s", "step s"), ("data_wait_s", "wait s"), ("plan_s", "plan s"), ("mfu", "mfu%"),
                ("peak_mem_gib", "mem GiB"), ("expert_load_max_over_mean", "load max/mean")]
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
