"""Helpers shared by the test files: test files import from here, never from each other.

- Processes: ``free_port``, ``spawn_ranks`` (a test's worker on several gloo ranks), ``torchrun`` (train.py
  on N gloo CPU processes), ``torchrun_many`` (several trainer runs in one set of N gloo processes). The ranks
  of ``spawn_ranks`` and ``torchrun_many`` are forked from a server that has imported torch and the trainer
  once (``_rank_context``).
- Trainer runs: ``COMMON`` (the float64 debug-training settings, one place to change them), ``DIST_BASE``
  (``COMMON`` plus the distributed tests' steps, checkpoints and HF export), ``write_ppo_steps`` (JSONL steps
  with old/ref log-probs), ``records`` / ``weights`` (a run's metrics and exported weights),
  ``one_process_reference`` and ``assert_same_run`` (a layout equals the one-process run).
- Models and rollout trees: ``make_model`` (float64 debug Ling, non-zero expert bias), ``fork_tree``.
- Planner inputs: ``tree_specs`` (a hypothesis strategy of small forests with forks near chunk boundaries)
  and ``trajectories_from_spec``, ``figure2`` (the paper's Figure 2 trajectories).
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512  # the debug preset's vocabulary


# ---------------------------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports: torch and the trainer take ~5 s of CPU to import, paid once by the fork server
# instead of once per rank (eight ranks on two cores: ~20 s before the first collective).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "harts.train.config", "harts.train.trainer", "harts.models.ling", "harts.models.qwen35", "tests.helpers"]


def _rank_context():
    """Ranks are forked from a ``forkserver`` that has imported ``_PRELOAD`` (started on first use, with this
    process's environment: one intra-op thread and, without CUDA, the Triton interpreter, as a spawned or
    torchrun-launched rank had). Each rank is still its own process, its own gloo rank, and runs no code of
    another rank or of this process; it takes this process's current environment and directory (as a spawned
    process does) before the worker runs."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(target, env: dict, cwd: str, log: str, rank: int, world: int, port: int, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    target(rank, world, port, *args)


def _run_ranks(target, world: int, args: tuple, timeout: float, env: dict | None = None, cwd=None) -> None:
    """Runs ``target(rank, world, port, *args)`` on ``world`` ranks and waits for all of them; a nonzero exit
    code, or a rank still running after ``timeout`` seconds, fails the test (the other ranks are killed) with
    the tail of each rank's output."""
    import tempfile
    import time
    from multiprocessing.connection import wait

    ctx, port = _rank_context(), free_port()
    env, cwd = {**os.environ, **(env or {})}, str(cwd or os.getcwd())
    with tempfile.TemporaryDirectory(prefix="ranks_") as logs:
        procs = [ctx.Process(target=_rank_main, args=(target, env, cwd, f"{logs}/rank{r}.log", r, world, port, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline, running = time.monotonic() + timeout, list(procs)
        while running and time.monotonic() < deadline:
            for s in wait([p.sentinel for p in running], timeout=deadline - time.monotonic()):
                p = next(p for p in running if p.sentinel == s)
                p.join()
                running.remove(p)
                if p.exitcode != 0:  # the others may wait in a collective for this rank: stop them
                    deadline = 0
        for p in running:
            p.kill()
            p.join()
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            out = [Path(logs, f"rank{r}.log") for r in range(world)]
            tails = "\n".join(f"--- rank {r} (exit code {p.exitcode}; negative: killed after {timeout} s or after "
                              f"another rank failed):\n{out[r].read_text()[-4000:] if out[r].exists() else ''}"
                              for r, p in enumerate(procs))
            raise AssertionError(f"ranks {bad} failed\n{tails}")


def spawn_ranks(target, world: int, *args, timeout: float = 300) -> None:
    """Runs ``target(rank, world, port, *args)`` in ``world`` processes and waits for them; any nonzero exit
    code fails the test. ``target`` must be a module-level function (it is pickled by name)."""
    _run_ranks(target, world, args, timeout)


def torchrun(cfg: Path, out: Path, *extra: str, nproc: int = 2, env: dict | None = None) -> None:
    """``train.py --config cfg --job.dump_folder=out *extra`` on ``nproc`` gloo processes (one thread each)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "train.py"), "--config", str(cfg), f"--job.dump_folder={out}", *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def torchrun_many(runs: list[tuple[Path, Path, list[str], dict]], nproc: int) -> None:
    """Several trainer runs ``(config, out folder, extra arguments, environment)`` one after another on the
    same ``nproc`` gloo processes, which start and join the process group once (the environment torchrun
    gives its workers: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT, one thread each). Each run
    builds its own Trainer (meshes, model, optimizer, checkpointer) from its own config, as train.py does;
    only the process group is shared."""
    spec = Path(runs[0][1]).parent / f"runs_{'_'.join(Path(r[1]).name for r in runs)}.json"
    spec.write_text(json.dumps([dict(config=str(c), out=str(o), args=list(a), env=dict(e)) for c, o, a, e in runs]))
    _run_ranks(_trainer_rank, nproc, (str(spec),), timeout=900, env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
               cwd=ROOT)


def _trainer_rank(rank: int, world: int, port: int, spec: str) -> None:
    """One rank of ``torchrun_many``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run_many(spec)


def _run_many(spec: str) -> None:
    """The worker of ``torchrun_many`` (one rank): each run of the spec file in turn."""
    import torch.distributed as dist

    from harts.train.config import parse_args
    from harts.train.trainer import Trainer

    for run in json.loads(Path(spec).read_text()):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"run: {run['out']} {' '.join(run['args'])}", flush=True)
        saved = {k: os.environ.get(k) for k in run["env"]}
        os.environ.update(run["env"])
        try:
            trainer = Trainer(parse_args(["--config", run["config"], f"--job.dump_folder={run['out']}", *run["args"]]))
            trainer.train()
            trainer.checkpointer.close()  # Trainer.close() would also end the process group the next run uses
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- trainer runs

COMMON = """
[model]
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
[activation_checkpoint]
mode = "none"
"""

# Three steps: step 2 is the first whose loss depends on an optimizer update; a run killed after step 2's
# checkpoint and resumed computes step 3 from restored weights, optimizer moments and data position.
DIST_STEPS = 3
DIST_BASE = COMMON + f"""[training]
steps = {DIST_STEPS}
[metrics]
log_freq = 1
disable_color_printing = true
[checkpoint]
export_hf = true
folder = "ckpt"
interval = 2
keep_latest_k = 0
last_save_model_only = false
"""


def write_ppo_steps(folder: Path, seed: int) -> list[Path]:
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


def records(out: Path) -> list[dict]:
    """The run's metrics.jsonl records, one per logged step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict:
    """The run's final weights as exported to HF safetensors."""
    from safetensors.torch import load_file

    return load_file(str(out / "ckpt" / "hf" / "model-00001-of-00001.safetensors"))


def one_process_reference(d: Path, **over):
    """Writes ``DIST_BASE`` to ``d/base.toml`` and trains it in this process into ``d/one``: the run every
    layout must equal. Returns (config path, run folder)."""
    from harts.train.config import load_config
    from harts.train.trainer import Trainer

    cfg = d / "base.toml"
    cfg.write_text(DIST_BASE)
    one = d / "one"
    Trainer(load_config(str(cfg), **{"job.dump_folder": str(one), "checkpoint.enable": False, **over})).train()
    return cfg, one


def assert_same_run(ref: Path, got: Path, rel: float = 1e-10, wrel: float = 1e-9,
                    keys=("loss", "policy_loss", "router_loss", "grad_norm")) -> None:
    """Two float64 runs of the same steps: every step's ``keys`` to ``rel`` relative, and every final weight
    (the expert bias included) to ``wrel`` of that tensor's largest magnitude."""
    a, b = records(ref), records(got)
    assert [r["step"] for r in b] == [r["step"] for r in a] and a, ([r["step"] for r in a], [r["step"] for r in b])
    for ra, rb in zip(a, b):
        for k in keys:
            assert abs(ra[k] - rb[k]) <= rel * max(abs(ra[k]), 1e-30), (ra["step"], k, ra[k], rb[k])
    wa, wb = weights(ref), weights(got)
    assert wa.keys() == wb.keys()
    for k in wa:
        scale = wa[k].abs().max().item()
        assert (wa[k] - wb[k]).abs().max().item() <= wrel * max(scale, 1e-12), k


# ---------------------------------------------------------------------------------- models and rollout trees

def make_model(chunk_size: int, recompute: bool = False, seed: int = 0):
    """The float64 debug Ling on the reference ops, with a non-zero expert bias (so grouped routing with the
    bias is exercised)."""
    from harts.models.ling import LingConfig, LingForCausalLM
    from harts.train.parallelize import apply_ac

    cfg = LingConfig.preset("ling3-tiny-debug", backend="reference", kda_chunk_size=chunk_size)
    torch.manual_seed(seed)
    model = LingForCausalLM(cfg).double()
    apply_ac(model, "full" if recompute else "none")
    for i, m in enumerate(model.moe_layers()):
        m.gate.expert_bias.copy_(torch.linspace(-0.05, 0.05, cfg.num_experts, dtype=torch.float32).roll(i))
    return model


def fork_tree(B: int, rng: np.random.Generator) -> list[list[int]]:
    """Forks at B-1, B, B+1 and 2B+1 (deeper), fan-out 4 at one fork, a prefix trajectory, a duplicate,
    a single-token trajectory and a second, unrelated tree."""
    root = rng.integers(0, VOCAB, 3 * B + 5).tolist()

    def branch(p, n):
        if p < len(root):
            first = (root[p] + 1 + int(rng.integers(0, VOCAB - 1))) % VOCAB  # differs from the root at p
        else:
            first = int(rng.integers(0, VOCAB))
        return root[:p] + [first] + rng.integers(0, VOCAB, n - 1).tolist()

    trajs = [root, branch(B - 1, 6), branch(B, 5), branch(B + 1, 2 * B), branch(2 * B + 1, 3)]
    trajs += [branch(B + 1, 4) for _ in range(2)]  # fan-out 4 at position B + 1
    trajs += [root[: B + 3], list(trajs[1]), root[:1]]
    other = rng.integers(0, VOCAB, B + 7).tolist()
    trajs += [other, other[: B // 2] + [(other[B // 2] + 1) % VOCAB] * 3]
    return trajs


# ------------------------------------------------------------------------------------------ planner inputs

def trajectories_from_spec(spec, *, extra_prefixes=(), duplicates=()):
    """spec: list of trees; a tree node is (length, [children]). Returns token lists.

    Sibling segments differ in their first token and trees in their root token, so build_trie recovers
    exactly these segments. ``extra_prefixes`` (leaf index, cut) adds a trajectory ending inside a path;
    ``duplicates`` repeats leaves.
    """
    leaves = []

    def walk(node, prefix, first_tok):
        length, kids = node
        toks = prefix + [first_tok] + [0] * (length - 1)
        if not kids:
            leaves.append(toks)
        for k, child in enumerate(kids):
            walk(child, toks, k + 1)

    for t, tree in enumerate(spec):
        walk(tree, [], 100 + t)
    out = list(leaves)
    for leaf_idx, cut in extra_prefixes:
        leaf = leaves[leaf_idx % len(leaves)]
        out.append(leaf[: max(1, cut % len(leaf) + 1)])
    for leaf_idx in duplicates:
        out.append(list(leaves[leaf_idx % len(leaves)]))
    return out


@st.composite
def tree_specs(draw, max_internal=6):
    """Small forests with forks biased to B-1, B, B+1 (and 2B +- 1), fan-out 2..4."""
    B = draw(st.sampled_from([2, 3, 4, 5, 8]))
    budget = {"internal": draw(st.integers(1, max_internal))}

    def length_at(start):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            return draw(st.integers(1, 2 * B + 2))
        # Target a fork position near the next or next-but-one chunk boundary.
        m = start // B + draw(st.integers(1, 2))
        target = m * B + draw(st.sampled_from([-1, 0, 1]))
        return target - start if target > start else draw(st.integers(1, B))

    def node(start, depth):
        L = length_at(start)
        if depth < 5 and budget["internal"] > 0 and draw(st.integers(0, 3)) > 0:
            budget["internal"] -= 1
            k = draw(st.integers(2, 4))
            return (L, [node(start + L, depth + 1) for _ in range(k)])
        return (L, [])

    n_trees = draw(st.sampled_from([1, 1, 2, 3]))
    spec = [node(0, 0) for _ in range(n_trees)]
    prefixes = draw(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=2))
    dups = draw(st.lists(st.integers(0, 50), max_size=2))
    return B, trajectories_from_spec(spec, extra_prefixes=prefixes, duplicates=dups)


def figure2(B):
    """Paper Figure 2: v0 forks into v1, v2 at p1 = B-1; v1 forks into v3, v4 at p2 = B+1."""
    v0 = [9] * (B - 1)
    v1 = [1, 0]
    return [v0 + v1 + [3, 0, 0], v0 + v1 + [4, 0], v0 + [2, 0, 0, 0, 0]]


def drop_replay(batch):
    """A deliberately wrong handoff: sequences that replay [a(p), p) skip it and start at p from S_a."""
    from dataclasses import replace

    from harts.runtime.batch import round_pieces

    rounds = []
    for r in batch.rounds:
        cu = r.cu_seqlens_cpu.tolist()
        keep = torch.zeros(cu[-1], dtype=torch.bool)
        keep[r.output_positions] = True
        emits = set(r.emit_seq.tolist())
        for n in range(len(cu) - 1):
            if n in emits:  # keep emitting sequences intact so later state ids stay valid
                keep[cu[n]:cu[n + 1]] = True
        lens = [int(keep[cu[n]:cu[n + 1]].sum()) for n in range(len(cu) - 1)]
        new_cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.long)
        out = torch.zeros(cu[-1], dtype=torch.bool)
        out[r.output_positions] = True
        own, replay, replay_rows = round_pieces(new_cu.numpy(), out[keep].numpy(), r.gather[keep].numpy(),
                                                r.phys_start)
        rounds.append(replace(r, cu_seqlens=new_cu, cu_seqlens_cpu=new_cu, gather=r.gather[keep],
                              output_positions=torch.nonzero(out[keep]).flatten(),
                              max_seqlen=max(lens), own_sizes=own,
                              replay_sizes=replay, replay_rows=torch.as_tensor(replay_rows),
                              replay_positions=torch.nonzero(~out[keep]).flatten()))
    return replace(batch, rounds=tuple(rounds))


def count_in_place_rounds(monkeypatch, chunk_mod) -> dict:
    """Counts, in the returned dict, the fast rounds' outputs written into the caller's rows (``chunk_fwd_o`` of
    ``chunk_mod``, a round op's module, called with ``out``) and the per-row gradients the rounds wrote in place
    (``harts.runtime.compact._GradRows`` handed a buffer to ``_RoundInputs``)."""
    import harts.runtime.compact as compact

    in_place = {"out": 0, "grad": 0}
    fwd_o, take = chunk_mod.chunk_fwd_o, compact._GradRows.take

    def counted_fwd_o(*a, out=None):
        in_place["out"] += out is not None
        return fwd_o(*a, out=out)

    def counted_take(self):
        in_place["grad"] += self.buf is not None
        return take(self)

    monkeypatch.setattr(chunk_mod, "chunk_fwd_o", counted_fwd_o)
    monkeypatch.setattr(compact._GradRows, "take", counted_take)
    return in_place
