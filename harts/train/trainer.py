"""The HARTS RL trainer: setup (mesh, model, parallelisms, optimizer, checkpoint) and the step loop.

One step = the planner's microbatches of this DP replica, in slot order: forward (log-probs of every
predicted position), per-token objective, backward, with gradients accumulating across microbatches;
then DP reductions of metrics and MoE counts, gradient clipping, optimizer and LR steps, and the
expert-bias update. Every rank runs the same number of slots (the plan gives K/D per replica), which
FSDP2 and expert parallelism need because their collectives pair up across ranks. Under context
parallelism the CP ranks of a replica run the same slots on their shares of the rows and evaluate the
objective on the predicted positions of their own rows; metric sums and MoE counts are reduced over
DP x CP, gradients by FSDP2 over dp_shard x cp. In online mode (``online.enabled``, one process) each
step's trajectories are rollout trees sampled from this model just before the step (harts.rl.online).

From torchtitan 0.2.2: JobConfig/ConfigManager, ParallelDims, build_optimizers (OptimizersContainer),
build_lr_schedulers, CheckpointManager (DCP), get_peak_flops, maybe_enable_amp and GarbageCollection (automatic
collection off, a collection every ``training.gc_freq`` steps). Ours: applying the
parallelisms to the one model (harts.train.parallelize), gradient clipping (one mesh-aware norm), EP
dispatch, the data worker and planner integration, the objectives and their normalisation, metrics,
the NaN/Inf check, the profiler hook, the step hooks (harts.train.hooks: debugging dumps) and the HF export.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from harts.rl.losses import LossConfig, token_losses
from harts.train import parallelize as par
from harts.train.data import Prefetcher, StepBuilder, StepData
from harts.train.hooks import StepHooks, hooks_from_config
from harts.train.metrics import MetricsLogger, StepSums, expert_balance, peak_memory_gib
from harts.train.model import (
    DTYPES,
    build_policy,
    init_sharded,
    is_qwen35,
    model_config,
    router_term,
    state_dict_adapter,
)

log = logging.getLogger("harts.train")

__all__ = ["Trainer", "TrainState", "NonFiniteError", "RunDirError"]


class NonFiniteError(FloatingPointError):
    """A step's loss or gradients are NaN or Inf on some rank (the step is not applied)."""


class RunDirError(ValueError):
    """The output folder does not fit the run asked for (e.g. it holds a finished run)."""


@dataclasses.dataclass
class TrainState:
    step: int = 0
    # load fractions f_LE of the last step's global MoE counts (the balance loss's detached factor);
    # all ones before the first step (then sum_E f_E P_E = 1 for every token: no gradient)
    moe_f: torch.Tensor | None = None

    def state_dict(self) -> dict:
        sd = {"step": torch.tensor(self.step, dtype=torch.int64)}
        if self.moe_f is not None:
            sd["moe_f"] = self.moe_f
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        if "moe_f" in sd and self.moe_f is not None:
            self.moe_f.copy_(sd["moe_f"])


class _DropDCPTracebacks(logging.Filter):
    """Drops the warnings with tracebacks that torch.distributed.checkpoint logs on the root logger while it
    fails to read a checkpoint (the error that follows says what failed, once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "distributed/checkpoint" in record.pathname.replace(os.sep, "/"))


def _checkpoint_failure(e: BaseException, rank: int) -> str:
    """The cause of a failed checkpoint load in one short line: DCP's exception wraps every rank's (with its
    traceback); this rank's, else the first."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = (failures.get(rank) or next(iter(failures.values())))[0]
    lines = str(e).strip().splitlines()
    msg = lines[0].rstrip(".") if lines else type(e).__name__ + (" (a file ends early)" if isinstance(e, EOFError)
                                                                 else "")
    if msg.startswith("metadata is None"):  # DCP read neither the global nor the rank's metadata file
        why = msg.partition("global metadata read failed: ")[2].partition("; rank local")[0]
        msg = f"its .metadata does not load ({why or msg})"
    return msg if len(msg) <= 300 else msg[:297] + "..."


def _norms_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the gradients' 2-norms: finite iff every gradient is (multi-tensor kernels accumulating in
    fp64; no fp64 copy of 7.9B gradient elements per microbatch just to look for a NaN)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).sum()


class Trainer:
    def __init__(self, cfg, hooks: StepHooks | None = None):
        if hooks is not None and not isinstance(hooks, StepHooks):
            raise TypeError(f"Trainer: hooks = {hooks!r} must be a harts.train.hooks.StepHooks")
        self.cfg = cfg
        self.hooks = hooks if hooks is not None else hooks_from_config(cfg.debug)
        self._init_distributed()
        self._check_dump_folder()
        dc, lc, pc = cfg.debug, cfg.model, cfg.parallelism
        seed = dc.seed if dc.seed is not None else 0
        torch.manual_seed(seed)
        if dc.deterministic:
            torch.use_deterministic_algorithms(True)
        self.model_cfg = model_config(lc)
        if is_qwen35(self.model_cfg):
            self._check_qwen35()
        self.dims = par.build_parallel_dims(pc, self.world_size, self.device.type)
        d = self.dims
        batch_mesh = d.get_optional_mesh("batch") if self.world_size > 1 else None
        self.dp_degree = batch_mesh.size() if batch_mesh is not None else 1
        self.dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
        # context parallelism: the CP ranks of a replica share its microbatches (each holds a share of the
        # rows and positions); metric sums and MoE counts are summed over every rank but TP replicas (StepSums)
        self.cp_group = d.get_mesh("cp").get_group() if d.cp > 1 else None

        self.dtype = DTYPES[lc.dtype]
        self.model = build_policy(self.model_cfg, device=self.device, dtype=self.dtype, seed=lc.init_seed,
                                  on_meta=lc.init_on_meta)
        self.n_moe = len(self.model.moe_layers())  # of the whole model (a pipeline stage has fewer)
        self.sp = pc.enable_sequence_parallel and d.tp > 1
        if d.cp > 1:
            self._check_cp()
        self.pp_group, self.pp_rank = None, 0
        if d.pp > 1:
            from harts.train.pipeline import prune_to_stage

            pp_mesh = d.get_mesh("pp")
            self.pp_group, self.pp_rank = pp_mesh.get_group(), pp_mesh.get_local_rank()
            self.stage_io = prune_to_stage(self.model, self.pp_rank, d.pp)
        self._parallelize()
        if lc.init_on_meta:
            init_sharded(self.model, self.device, lc.init_seed)

        from torchtitan.components.lr_scheduler import build_lr_schedulers
        from torchtitan.components.optimizer import build_optimizers

        ocfg = cfg.optimizer
        if self.device.type != "cuda" and ocfg.implementation == "fused" and self.dtype == torch.float64:
            ocfg = dataclasses.replace(ocfg, implementation="foreach")
        if d.tp > 1 and not d.fsdp_enabled and ocfg.implementation != "for-loop":
            # TP without FSDP mixes DTensor and plain parameters, which foreach/fused kernels refuse
            log.info("optimizer: TP without FSDP -> implementation 'for-loop'")
            ocfg = dataclasses.replace(ocfg, implementation="for-loop")
        # the expert bias is a buffer: no optimizer ever sees it
        self.bf16_opt = self.dtype == torch.bfloat16 and ocfg.bf16_update == "fp32_master"
        if self.bf16_opt:
            self.optimizers = self._build_bf16_optimizer(ocfg)
        else:
            self.optimizers = build_optimizers([self.model], ocfg.to_torchtitan(), self.dims)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, cfg.lr_scheduler.to_torchtitan(), cfg.training.steps)

        rl = cfg.rl
        self.loss_cfg = LossConfig(objective=rl.objective, clip_eps=rl.clip_eps,
                                   clip_eps_high=rl.clip_eps_high or None, kl_coef=rl.kl_coef,
                                   normalization=rl.loss_norm)
        chunk_size, conv_width = self.model_cfg.layout_geometry  # the linear mixer's chunk grid and conv width
        self.builder = StepBuilder(cfg, dp_degree=self.dp_degree, dp_rank=self.dp_rank,
                                   vocab_size=self.model_cfg.vocab_size, chunk_size=chunk_size, conv_width=conv_width,
                                   row_multiple=self.row_split, cp_group=self.cp_group,
                                   min_slots=d.pp if cfg.harts.fill_pipeline else 1)
        self.data_checked = self._check_data_files()
        if cfg.online.enabled:  # rollouts sampled from this model when each step is built (harts.rl.online)
            if self.world_size > 1:
                raise ValueError(f"online.enabled = true runs in one process (world size is {self.world_size}): "
                                 "the sampler decodes with the whole, unsharded model")
            from harts.rl.online import OnlineSource

            self.builder.online = OnlineSource(cfg.online, self.model)
        self.loader = Prefetcher(self.builder, start=1, end=cfg.training.steps,
                                 depth=0 if cfg.online.enabled else cfg.data.prefetch)
        self.pipe, self._warned_pp_fill = None, False
        if d.pp > 1:
            from harts.train.pipeline import PipelineRunner

            act = self.mp_param_dtype or self.dtype
            self.pipe = PipelineRunner(self.stage_io, stage=self.pp_rank, pp=d.pp, group=self.pp_group,
                                       device=self.device, schedule=pc.pipeline_parallel_schedule,
                                       rows=cfg.harts.capacity, hidden=self.model_cfg.hidden_size, act_dtype=act,
                                       loss_dtype=torch.promote_types(act, torch.float32), row_split=self.row_split)
        self.state = TrainState()
        if self.n_moe:
            self.state.moe_f = torch.ones(self.n_moe, self.model_cfg.num_experts, dtype=torch.float64,
                                          device=self.device)
        self.dump = cfg.job.dump_folder
        from torchtitan.components.checkpoint import CheckpointManager

        self.checkpointer = CheckpointManager(
            dataloader=self.loader, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.state},
            checkpoint_config=cfg.checkpoint.to_torchtitan(), sd_adapter=None, base_folder=self.dump)
        if lc.load_hf:
            self._load_hf(lc.load_hf)
        self.metrics = MetricsLogger(self.dump, rank=self.rank, enable_tensorboard=cfg.metrics.enable_tensorboard,
                                     tb_folder=cfg.metrics.save_tb_folder,
                                     color=not cfg.metrics.disable_color_printing and sys.stdout.isatty())
        head = self.model_cfg.hidden_size * self.model_cfg.vocab_size
        self.flops_per_row = 6 * (self._whole_model().num_params(active=True, embeddings=False) + head)
        self.peak_flops = None
        if self.device.type == "cuda":
            from torchtitan.tools.utils import get_peak_flops

            self.peak_flops = get_peak_flops(torch.cuda.get_device_name(self.device))
        self.history: list[dict] = []
        if self.rank == 0:
            log.info("job: %s", cfg.job.description)
            log.info("HARTS trainer: world %d (dp %d, tp %d, pp %d, cp %d, ep %d), device %s, dtype %s, "
                     "harts.enabled=%s, model %s (%d layers, %.2fM params%s)", self.world_size, self.dp_degree,
                     d.tp, d.pp, d.cp, d.ep, self.device, lc.dtype, cfg.harts.enabled, lc.preset,
                     self.model_cfg.num_hidden_layers, self._whole_model().num_params() / 1e6,
                     f"; pipeline stage 0 holds {self._stage_params() / 1e6:.2f}M" if d.pp > 1 else "")
            log.info("data: %s", self._describe_data())
            ck = cfg.checkpoint
            log.info("metrics: %s; checkpoints: %s", os.path.join(self.dump, "metrics.jsonl"),
                     f"{self.ckpt_folder} (every {ck.interval} steps and the last)" if ck.enable else "off")

    @property
    def ckpt_folder(self) -> str:
        return os.path.join(self.dump, self.cfg.checkpoint.folder)

    def _describe_data(self) -> str:
        """The start-up summary's data line: source, files, and where the rewards come from."""
        dc, reward = self.cfg.data, self.builder.reward
        if self.cfg.online.enabled:
            o = self.cfg.online
            return (f"online: {o.episodes} rollout trees per step on task {o.task!r} sampled from the policy "
                    f"(branching {list(o.branching)}, temperature {o.temperature:g}, top_p {o.top_p:g}, seed "
                    f"{o.seed}); rewards from the environment")
        if dc.source == "jsonl":
            n = len(dc.path)
            src = f"JSONL, {n} file(s) ({', '.join(dc.path[:3])}{', ...' if n > 3 else ''}), "
            src += "the same file every step" if n == 1 else f"one per step, cycled (step s reads file (s-1) mod {n})"
            if self.data_checked is not None:
                files, trajs, secs = self.data_checked
                src += f", checked before step 1: {files} file(s), {trajs:,} trajectories ({secs:.1f} s)"
        else:
            src = f"synthetic preset {dc.preset!r} (seed {dc.seed}, scale {dc.scale:g})"
            src += ", the first step's rollouts every step (data.fixed_step)" if dc.fixed_step else ""
        if self.cfg.rl.advantages == "data":
            why = "advantages from the data (rl.advantages = 'data')"
        elif reward == "data":
            why = f"rewards from the data (data.reward = {dc.reward!r})"
        else:
            why = (f"learnable reward, replacing any rewards in the data (data.reward = {dc.reward!r}; 'data' "
                   "uses the data's)")
        return f"{src}; {why}"

    def _check_dump_folder(self) -> None:
        """job.dump_folder must be a folder this process can write (checked now, not when the first metrics record
        or checkpoint is written)."""
        folder = self.cfg.job.dump_folder
        probe = os.path.join(folder, f".harts-write-test-{self.rank}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise RunDirError(f"job.dump_folder = {folder!r} is not a writable folder ({e.strerror or e}): set "
                              "--job.dump_folder to a folder this user can write") from None

    def _check_data_files(self) -> tuple[int, int, float] | None:
        """JSONL data (with data.check_files): every file of data.path is read and checked before step 1
        (``StepBuilder.check_files``, the ranks sharing the files), so that a bad file late in the list stops the
        run now instead of hours later. The ranks exchange their findings; every rank raises the error of the
        first bad file in data.path order, so rank 0 prints it. Returns (files, trajectories, seconds), or None
        when nothing was checked."""
        dc = self.cfg.data
        if dc.source != "jsonl" or self.cfg.online.enabled or not dc.check_files:
            return None
        t0 = time.perf_counter()
        rank, world = (self.rank, self.world_size) if self.distributed else (0, 1)
        found = self.builder.check_files(rank, world)
        if self.distributed:
            every = [None] * world
            dist.all_gather_object(every, found)
        else:
            every = [found]
        errors = [f[2] for f in every if f[2] is not None]
        if errors:
            raise ValueError(min(errors)[1])
        return sum(f[0] for f in every), sum(f[1] for f in every), time.perf_counter() - t0

    @property
    def row_split(self) -> int:
        """Row shares of a microbatch: cp (context parallelism) x tp (with sequence parallelism)."""
        return self.dims.cp * (self.dims.tp if self.sp else 1)

    # ------------------------------------------------------------------ setup helpers
    def _check_qwen35(self):
        """Qwen3.5-MoE runs under FSDP2, tensor, expert, context and pipeline parallelism, compiled and with any
        activation checkpointing policy; the settings it has no implementation for are refused here, before any
        mesh or weight is built, rather than failing (or doing nothing) later."""
        cfg = self.cfg
        unsupported = [
            (cfg.rl.expert_bias_rate != 0, f"rl.expert_bias_rate = {cfg.rl.expert_bias_rate!r}",
             "it routes by softmax without an expert bias (aux-loss-free bias updates do not apply); set it to 0 "
             "and balance with rl.aux_loss_coef"),
        ]
        bad = [f"{what} ({why})" for flag, what, why in unsupported if flag]
        if bad:
            raise ValueError(f"config: model.preset = {cfg.model.preset!r} (Qwen3.5-MoE) does not support "
                             + "; ".join(bad))

    def _check_cp(self):
        """Context parallelism splits the heads of each TP rank's sequence mixers over the CP group: Ling's KDA
        and MLA have num_attention_heads heads each; Qwen3.5's GDN splits its key heads and the value heads
        they serve, its gated attention the query heads (the key/value heads cross the exchange at
        lcm(num_key_value_heads, cp) heads, so their count need not divide)."""
        d, mc = self.dims, self.model_cfg
        if not self.cfg.harts.enabled:
            raise ValueError("parallelism.context_parallel_degree > 1 needs harts.enabled = true: context "
                             "parallelism is implemented for HARTS (prefix-shared) batches only")
        names = (("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads") if is_qwen35(mc)
                 else ("num_attention_heads",))
        bad = [f"{n}={getattr(mc, n)}" for n in names if getattr(mc, n) % (d.tp * d.cp)]
        if bad:
            raise ValueError(f"parallelism.context_parallel_degree={d.cp}: {', '.join(bad)} must be divisible by "
                             f"tensor_parallel_degree x context_parallel_degree = {d.tp * d.cp}")

    def _init_distributed(self):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            if local >= n:
                raise RuntimeError(f"LOCAL_RANK={local} but only {n} CUDA devices are visible: NCCL needs one GPU "
                                   "per rank (lower --nproc_per_node or the parallel degrees)")
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if "RANK" in os.environ and not dist.is_initialized():
            from datetime import timedelta

            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=timedelta(seconds=self.cfg.comm.init_timeout_seconds))
        self.distributed = dist.is_initialized() and self.world_size > 1

    def _parallelize(self):
        d, cfg = self.dims, self.cfg
        ignored = set()
        if d.ep > 1:
            ignored = par.apply_ep(self.model, d.get_mesh("ep"), d.get_mesh("tp") if d.tp > 1 else None)
        if d.tp > 1:
            par.apply_tp(self.model, d.get_mesh("tp"), sequence_parallel=self.sp)
        par.apply_ac(self.model, cfg.activation_checkpoint.mode,
                     collectives_in_layers=d.tp > 1 or d.ep > 1 or d.cp > 1)
        if cfg.compile.enable:
            # expert parallelism's dispatch reads host split sizes: the MoE regions break their graph there
            names = par.apply_compile(self.model, cfg.compile.backend, fullgraph=d.ep == 1)
            log.info("compiled %d regions (pre/post around each decoder layer's mixer core, dynamic rows; "
                     "harts.models.common.compile)", len(names))
        self.amp = contextlib.nullcontext()
        self.mp_param_dtype = None
        self.replicated_params, self.replicated_mesh = [], None
        if d.fsdp_enabled or d.dp_replicate > 1:
            mesh = d.get_mesh(["dp_replicate", "fsdp"]) if d.dp_replicate > 1 else d.get_mesh("fsdp")
            mp = {}
            if self.device.type == "cuda" and self.dtype == torch.float32:
                mp = dict(param_dtype=DTYPES[cfg.training.mixed_precision_param],
                          reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce])
            self.mp_param_dtype = mp.get("param_dtype")
            if "param_dtype" not in mp:
                # FSDP2 needs one original dtype per unit; without a cast policy the parameters that stay
                # fp32 next to bf16 weights (A_log, dt_bias) are left replicated, their gradients summed over
                # the FSDP mesh after backward (_sync_replicated_grads)
                odd = [p for p in self.model.parameters() if p.dtype != self.dtype and p not in ignored]
                if odd:
                    ignored = ignored | set(odd)
                    self.replicated_params, self.replicated_mesh = odd, mesh
            rf = {"always": True, "never": False}.get(cfg.parallelism.fsdp_reshard_after_forward, d.pp == 1)
            par.apply_fsdp(self.model, mesh, reshard_after_forward=rf, ignored=ignored, **mp)
        elif self.device.type == "cuda" and self.dtype == torch.float32:
            from torchtitan.distributed.utils import maybe_enable_amp

            self.amp = maybe_enable_amp(d, cfg.training.mixed_precision_param, "cuda")

    def _load_hf(self, path: str) -> None:
        """Start from an HF folder the way torchtitan's ``CheckpointManager`` loads one (``dcp_load`` with
        ``from_hf``): the family's state-dict adapter names this rank's tensors in the folder's layout, DCP's
        HuggingFace storage reader fills them, and ``ModelWrapper`` loads the result. It runs after
        parallelisation, so each rank reads only its own shards (any layout, ``init_on_meta`` included). The
        folder's key set and shapes (safetensors headers) are checked against the whole model first: one error
        lists every missing, unexpected or mis-shaped tensor. A checkpoint resumed from ``checkpoint.folder``
        replaces these weights."""
        import torch.distributed.checkpoint as dcp
        from torchtitan.components.checkpoint import ModelWrapper

        from harts.models.ling.checkpoint import check_hf_keys, hf_checkpoint_shapes

        whole = state_dict_adapter(self.model_cfg, path).to_hf(self._whole_model().state_dict())
        check_hf_keys({k: tuple(v.shape) for k, v in whole.items()}, hf_checkpoint_shapes(path), path)
        adapter, wrapper = state_dict_adapter(self.model_cfg, path), ModelWrapper(self.model)
        hf_sd = adapter.to_hf(wrapper.state_dict())
        dcp.load(hf_sd, storage_reader=adapter.get_hf_storage_reader(path))
        wrapper.load_state_dict(adapter.from_hf(hf_sd))
        if self.rank == 0:
            log.info("loaded HF weights from %s (DCP, %s)", path, type(adapter).__name__)

    def _stage_params(self) -> int:
        """Parameters this rank's model holds (a DTensor counts whole: the pipeline stage's share)."""
        return sum(p.numel() for p in self.model.parameters())

    def _whole_model(self):
        """The whole model on the meta device (parameter counts, the HF export; a pipeline stage holds a part)."""
        from harts.models.family import model_class

        with torch.device("meta"):
            return model_class(self.model_cfg)(self.model_cfg)

    # ------------------------------------------------------------------ loop
    def _prepare_run_dir(self) -> None:
        """Before loading: start fresh (checkpoint.overwrite) or report checkpoints a killed run left
        half-written (torchtitan skips a step-N folder without .metadata without a word)."""
        ck = self.cfg.checkpoint
        if ck.overwrite and self.rank == 0:
            import shutil

            for path in (self.ckpt_folder, self.metrics.path):
                if path and os.path.exists(path):
                    log.info("checkpoint.overwrite: removing %s", path)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if self.distributed:
            dist.barrier()
        if ck.enable and not ck.overwrite and self.rank == 0 and os.path.isdir(self.ckpt_folder):
            for name in sorted(os.listdir(self.ckpt_folder)):
                path = os.path.join(self.ckpt_folder, name)
                if name.startswith("step-") and os.path.isdir(path) and not any(
                        os.path.isfile(os.path.join(path, f)) for f in (".metadata", "model.safetensors.index.json")):
                    log.warning("checkpoint %s is incomplete (no .metadata: the run stopped while writing it); "
                                "skipped", path)

    def _checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints (step-N with .metadata) in checkpoint.folder."""
        folder = self.ckpt_folder
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return sorted(int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()
                      and os.path.isfile(os.path.join(folder, n, ".metadata")))

    def _load_checkpoint(self) -> None:
        """Resume from the latest (or checkpoint.load_step's) checkpoint. A checkpoint that does not load (another
        model or layout wrote it, or its files are damaged) is one line naming its folder and the settings that
        get past it; DCP's own error carries a traceback from every rank."""
        ck = self.cfg.checkpoint
        quiet = _DropDCPTracebacks()
        if os.environ.get("HARTS_DEBUG", "").strip().lower() in ("", "0", "false", "no"):
            logging.getLogger().addFilter(quiet)  # DCP warns of a damaged .metadata with a traceback per rank
        try:
            self.checkpointer.load(step=ck.load_step)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            steps = self._checkpoint_steps()
            if ck.load_step >= 0:
                what = os.path.join(self.ckpt_folder, f"step-{ck.load_step}")
            elif steps:
                what = os.path.join(self.ckpt_folder, f"step-{steps[-1]}")
            else:
                what = ck.initial_load_path or self.ckpt_folder
            earlier = f" (complete checkpoints here: steps {', '.join(map(str, steps))})" if steps else ""
            raise RunDirError(f"cannot resume from checkpoint {what}: {_checkpoint_failure(e, self.rank)}; a "
                              "different model or parallel layout wrote it, or its files are damaged: start fresh "
                              "with --checkpoint.overwrite (deletes this run's checkpoints and metrics) or another "
                              f"--job.dump_folder, or resume another step with --checkpoint.load_step=N{earlier}"
                              ) from e
        finally:
            logging.getLogger().removeFilter(quiet)

    def _check_resume(self) -> None:
        """After loading: a run that already reached training.steps is an error, not a silent no-op; the
        metrics file keeps the records up to the loaded step (steps after it are trained again)."""
        cfg, done = self.cfg, self.state.step
        if done >= cfg.training.steps:
            raise RunDirError(f"{self.ckpt_folder} holds a finished run (step {done}, training.steps = "
                              f"{cfg.training.steps}): raise --training.steps to continue it, or start fresh with "
                              "--checkpoint.overwrite or another --job.dump_folder")
        dropped = self.metrics.truncate(done)
        if self.rank == 0:
            if done:
                log.info("resumed from the checkpoint of step %d in %s%s", done, self.ckpt_folder,
                         f"; dropped {dropped} metrics records of later steps" if dropped else "")
            elif dropped:
                log.info("fresh run: replaced the %d records of an earlier run in %s", dropped, self.metrics.path)

    def train(self) -> list[dict]:
        cfg = self.cfg
        self._prepare_run_dir()
        self._load_checkpoint()
        self._check_resume()
        self.loader.next_step = self.state.step + 1
        if self.device.type == "cuda" and self.rank == 0:
            # on the H200 step 1 takes minutes on a cold cache (autotuning every config of fla's and our kernels)
            log.info("the first step compiles and autotunes Triton kernels (minutes on a cold cache; reused from "
                     "TRITON_CACHE_DIR=%s, autotune results only with TRITON_CACHE_AUTOTUNING=1)",
                     os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache"))
        from torchtitan.tools.utils import GarbageCollection

        gc_was_enabled = gc.isenabled()
        collector = GarbageCollection(gc_freq=cfg.training.gc_freq)  # automatic collection off from here on
        try:
            for step in range(self.state.step + 1, cfg.training.steps + 1):
                collector.run(step)
                data, wait = self.loader.get()
                assert data.step == step, (data.step, step)
                with self._profile(step):
                    t0 = time.perf_counter()
                    out = self.train_step(data)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    step_s = time.perf_counter() - t0
                self.state.step = step
                rec = self._record(data, out, step_s, wait)
                self.history.append(rec)
                if step % max(cfg.metrics.log_freq, 1) == 0 or step == 1 or step == cfg.training.steps:
                    self.metrics.log(rec)
                self.checkpointer.save(step, last_step=(step == cfg.training.steps))
                if cfg.debug.exit_after_step and step == cfg.debug.exit_after_step:
                    self._crash_exit()
            if cfg.checkpoint.export_hf:
                self.export_hf(os.path.join(self.ckpt_folder, "hf"))
            if cfg.online.enabled and cfg.online.plot and self.rank == 0 and self.history:
                from harts.rl.online import plot_rewards

                path = os.path.join(self.dump, "reward_vs_step.png")
                label = "HARTS" if cfg.harts.enabled else "baseline"
                if plot_rewards({label: ([r["step"] for r in self.history], [r["reward"] for r in self.history])},
                                path):
                    log.info("reward per step: %s", path)
        finally:
            self.loader.close()
            self.metrics.close()
            if gc_was_enabled:  # the calling process gets its collector back
                gc.enable()
        if self.rank == 0:
            log.info("%s", self._summary())
        return self.history

    def _summary(self) -> str:
        """End-of-run line: steps, tokens, compression, mean throughput, and where the results are."""
        h, cfg = self.history, self.cfg
        raw, rows, secs = (sum(r[k] for r in h) for k in ("raw_tokens", "compact_rows", "step_s"))
        first = h[0]["step"] if h else self.state.step
        parts = [f"done: steps {first}-{self.state.step} of {cfg.training.steps}" if h else "done: no steps",
                 f"{raw:,} raw tokens, {rows:,} compact rows (compression {raw / max(rows, 1):.3f}x)",
                 f"mean {raw / secs if secs else 0.0:,.1f} raw tok/s over {secs:.1f} s of steps",
                 f"metrics {self.metrics.path}"]
        report = getattr(self.model, "compile_report", None)
        if report is not None:
            parts.append(report.summary(len(h)))
        if cfg.checkpoint.enable:
            parts.append(f"checkpoints {self.ckpt_folder}")
        return "; ".join(parts)

    def _build_bf16_optimizer(self, ocfg):
        """bf16 weights: AdamW with fp32 gradient accumulation and fp32 master weights kept as bf16 + low bits.
        Gradients move into fp32 after every microbatch's backward; under FSDP + PP the schedule runs all
        microbatches first, so FSDP sums their (reduce-scattered) gradients in bf16 before that."""
        from torchtitan.components.optimizer import OptimizersContainer

        from harts.train.bf16_adamw import BF16AdamW

        if ocfg.name != "AdamW":
            raise ValueError(f"optimizer.name = {ocfg.name!r} with optimizer.bf16_update = 'fp32_master': only "
                             "AdamW is implemented (set optimizer.bf16_update = 'plain' for torch's)")
        choice = str(ocfg.bf16_fused).lower()
        if choice not in ("auto", "true", "false"):
            raise ValueError(f"optimizer.bf16_fused = {ocfg.bf16_fused!r}: expected 'auto', 'true' or 'false'")
        fused = self.device.type == "cuda" if choice == "auto" else choice == "true"
        if fused and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"optimizer.bf16_fused = true needs CUDA (device is {self.device.type}); "
                             "set it to auto or false")
        log.info("optimizer: BF16AdamW (fp32 gradient accumulation, fp32 master weights as bf16 + 16 low bits, "
                 "bf16 moments; update by %s, optimizer.bf16_fused = %s)",
                 "one fused Triton kernel per tensor" if fused else "torch ops", choice)
        kw = dict(lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, weight_decay=ocfg.weight_decay,
                  fused=fused)
        return OptimizersContainer([self.model], BF16AdamW, kw)

    def _sync_replicated_grads(self):
        """Sum the gradients of parameters FSDP left replicated (see _parallelize) over its mesh: one
        flat all-reduce per mesh dimension."""
        grads = [p.grad for p in self.replicated_params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        for d in range(self.replicated_mesh.ndim):
            dist.all_reduce(flat, group=self.replicated_mesh.get_group(mesh_dim=d))
        torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def _grads(self, local: bool = True) -> list[torch.Tensor]:
        """This rank's accumulated gradients (fp32 ones under BF16AdamW); DTensors as their local shards
        unless ``local=False`` (clipping needs the placements)."""
        from torch.distributed.tensor import DTensor

        if self.bf16_opt:
            grads = [g for o in self.optimizers for g in o.grads()]
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return [g.to_local() if local and isinstance(g, DTensor) else g for g in grads]

    def _crash_exit(self):
        """Simulated kill (tests): leave without closing anything, after the step's checkpoint."""
        self.checkpointer.maybe_wait_for_staging()
        if self.distributed:
            dist.barrier()
        os._exit(0)

    @contextlib.contextmanager
    def _profile(self, step: int):
        pc = self.cfg.profile
        if not (pc.enable and step in pc.steps):
            yield
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        folder = os.path.join(self.dump, pc.folder, f"step{step}")
        os.makedirs(folder, exist_ok=True)
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            yield
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        prof.export_chrome_trace(path)
        if self.rank == 0:
            log.info("profiler: chrome trace for step %d written to %s", step, path)

    # ------------------------------------------------------------------ one step
    def _router_inputs(self, data: StepData) -> tuple | None:
        rl = self.cfg.rl
        if self.n_moe == 0 or (rl.z_loss_coef == 0 and rl.aux_loss_coef == 0):
            return None
        scale = 1.0 / (data.normalizer.raw_tokens * self.n_moe)
        coef = torch.tensor([rl.z_loss_coef * scale, rl.aux_loss_coef * scale], dtype=torch.float64,
                            device=self.device)
        # every tensor-parallel rank seeds the same router term, whose gradient is summed over the ranks
        return coef, (self.state.moe_f if rl.aux_loss_coef else None), 1.0 / self.dims.tp

    def train_step(self, data: StepData) -> dict:
        t_start = time.perf_counter()
        cfg, model, step = self.cfg, self.model, data.step
        if cfg.harts.check_plan and self.distributed:
            self._check_plan(data)
        model.train()
        meta_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        mbs = [mb.to(self.device, meta_dtype) for mb in data.microbatches]
        router = self._router_inputs(data)
        old = [None] * len(mbs)  # PPO's recomputed old log-probs per microbatch slot; by index under PP
        old_pp = None
        if self.loss_cfg.objective == "ppo" and cfg.rl.old_logprobs == "recompute":
            with torch.no_grad(), self.amp:
                if self.pipe is not None:  # a forward-only pipeline pass; the last stage keeps them
                    old_pp = self.pipe.old_logprobs(mbs)
                else:
                    old = [mb.select(model.logprobs(mb.batch)).detach() for mb in mbs]
        self.hooks.before_forward(self, data, mbs)
        sums = StepSums(self.device, world=self.world_size, rank=self.rank,
                        counts_shape=(self.n_moe, self.model_cfg.num_experts) if self.n_moe else None)
        check = cfg.debug.check_finite
        if self.pipe is not None:
            if len(mbs) < self.dims.pp and not self._warned_pp_fill:
                self._warned_pp_fill = True  # once per run
                log.warning("step %d: %d microbatch(es) on this DP rank for %d pipeline stages, so the stages "
                            "cannot overlap (on two H200s, PP2 with one HARTS microbatch ran at 0.48 of "
                            "compression); %s", step, len(mbs), self.dims.pp,
                            "the step has too few trajectories to split further" if cfg.harts.fill_pipeline
                            else "harts.fill_pipeline = true plans enough of them")
            self._pipeline_slots(mbs, router, sums, old_pp)
        else:
            for j, mb in enumerate(mbs):
                with torch.profiler.record_function(f"harts.microbatch.{mb.index}"):
                    loss, logp, c, (loss_S, pg_S, kl_S, clip_S) = self.microbatch_loss(mb, router, old[j])
                stats = model.router_stats()
                with torch.no_grad():
                    if stats:
                        sums.add_counts(torch.stack([s.counts_E for s in stats]))
                        if router is not None:
                            sums.add(router_loss=sum(router_term(s, router, i).double() for i, s in enumerate(stats)))
                with torch.profiler.record_function(f"harts.backward.{mb.index}"):
                    loss.backward()
                self.accumulate_grads()
                with torch.no_grad():
                    if check:
                        sums.flag(0, mb.index, loss)
                        sums.flag(1, mb.index, _norms_sum(self._grads()))
                    sums.add(loss=loss.detach().double(), policy_loss=(c * pg_S).sum().double(),
                             kl=(c * kl_S).sum().double(), clip_frac=(c * clip_S).sum().double(),
                             positions=float(c.numel()), **self._reward_probe(logp.detach(), mb))
        # one all-reduce for metrics, MoE counts and non-finite flags; TP replicas contribute once
        tp_rank = self.dims.get_mesh("tp").get_local_rank() if self.dims.tp > 1 else 0
        s = sums.reduce(self.distributed, contribute=tp_rank == 0)
        bad = sums.nonfinite() if check else None
        if bad:
            raise NonFiniteError(f"step {step}: {bad} (step not applied)")
        counts = sums.counts
        self._sync_replicated_grads()
        # F/B/Grad ends here (paper Table 4: ready plan to gradients, optimizer excluded); one sync per step
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        fbgrad_s = time.perf_counter() - t_start
        self.hooks.after_backward(self, data, mbs)
        # one clipping path for every layout: the mesh-aware norm of FSDP / TP / EP DTensor and plain gradients
        grad_norm = par.clip_grad_norm_mixed_(None, cfg.training.max_norm, pp_group=self.pp_group,
                                              grads=self._grads(local=False))
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        if counts is not None:
            if cfg.rl.expert_bias_rate > 0:
                own = self.pipe.io.moe_ids() if self.pipe is not None else list(range(self.n_moe))
                model.update_expert_bias(cfg.rl.expert_bias_rate, counts[own].to(torch.float32))
            c = self.model_cfg
            self.state.moe_f = counts * (c.num_experts / (c.num_experts_per_tok * data.normalizer.raw_tokens))
        out = {"loss": s["loss"] + s["router_loss"], "policy_loss": s["policy_loss"], "kl": s["kl"],
               "clip_frac": s["clip_frac"], "router_loss": s["router_loss"], "grad_norm": float(grad_norm),
               "counts": counts, "fbgrad_s": fbgrad_s}
        if self.builder.reward == "learnable" and s["probe_good_n"] > 0 and s["probe_bad_n"] > 0:
            out["logp_gap"] = s["probe_good_logp"] / s["probe_good_n"] - s["probe_bad_logp"] / s["probe_bad_n"]
        return out

    def microbatch_loss(self, mb, router, old_logp=None, model=None):
        """One microbatch's objective: (loss, log-probs, coefficients, per-token (loss, pg, kl, clip)).
        ``model`` (e.g. an fp32 copy) runs in place of the trainer's, without its autocast."""
        amp = self.amp if model is None else contextlib.nullcontext()
        with amp:
            logp = mb.select((model or self.model).logprobs(mb.batch, router))  # this CP rank's positions
            terms = token_losses(logp, mb.adv, self.loss_cfg,
                                 old_logp_S=old_logp if old_logp is not None else mb.old_logp, ref_logp_S=mb.ref_logp)
            c = mb.coeff.to(terms[0].dtype)
            return (c * terms[0]).sum(), logp, c, terms

    def accumulate_grads(self):
        """Gradients FSDP set outside autograd: into BF16AdamW's fp32 buffers before the next microbatch."""
        for o in self.optimizers if self.bf16_opt else ():
            o.accumulate_grads()

    def _pipeline_slots(self, mbs, router, sums: StepSums, old_logp=None) -> None:
        """All slots through the pipeline schedule, into this rank's ``sums`` (MoE counts: this stage's rows).
        The schedule interleaves microbatches, so gradients are checked once after all of them (the flag
        names the stage); non-finite losses are flagged per microbatch (last stage).
        ``old_logp``: PPO's recomputed old log-probs by microbatch index (last stage)."""
        m = self.pipe.io
        with torch.profiler.record_function("harts.pipeline"), self.amp:
            self.pipe.run(mbs, router, self.loss_cfg, old_logp)
        if self.n_moe and m.mb_counts is not None:
            sums.counts[m.moe_ids()] = m.mb_counts.to(torch.float64)
        by_id = {mb.index: mb for mb in mbs}
        check = self.cfg.debug.check_finite
        with torch.no_grad():
            for mb_id, logp, loss, pg, kl, clip in m.mb_records:
                mb = by_id[mb_id]
                if check:
                    sums.flag(0, mb_id, loss)
                sums.add(loss=loss.double(), policy_loss=pg.double(), kl=kl.double(), clip_frac=clip.double(),
                         positions=float(mb.coeff.numel()), **self._reward_probe(logp, mb))
            sums.add(router_loss=m.router_sum)
            if check:
                sums.grads_by_stage = True
                sums.flag(1, self.pp_rank, _norms_sum(self._grads()))

    def _reward_probe(self, logp: torch.Tensor, mb) -> dict:
        """Learnable reward: mean log-prob of rewarded (id < V/2) minus unrewarded loss-token targets; it
        rises as the policy learns the reward (the loss itself is noisy when every step has new rollouts)."""
        if self.builder.reward != "learnable":
            return {}
        on = mb.coeff > 0
        good = (mb.select(mb.batch.logprob_targets) < self.builder.reward_vocab // 2) & on
        bad = ~good & on
        lp = logp.double()
        return {"probe_good_logp": lp[good].sum(), "probe_good_n": good.sum().double(),
                "probe_bad_logp": lp[bad].sum(), "probe_bad_n": bad.sum().double()}

    def _check_plan(self, data: StepData):
        h = torch.tensor([data.plan_hash, -data.plan_hash], dtype=torch.int64, device=self.device)
        dist.all_reduce(h, op=dist.ReduceOp.MAX)
        if int(h[0]) != data.plan_hash or -int(h[1]) != data.plan_hash:
            raise RuntimeError(f"step {data.step}: ranks computed different microbatch plans (hash {data.plan_hash:#x} "
                               f"on rank {self.rank}); the planner input or code differs between ranks")

    def _record(self, data: StepData, out: dict, step_s: float, wait_s: float) -> dict:
        st = data.stats
        rec = {"step": data.step, "loss": out["loss"], "policy_loss": out["policy_loss"], "kl": out["kl"],
               "clip_frac": out["clip_frac"], "router_loss": out["router_loss"], "reward": st["reward"],
               "grad_norm": out["grad_norm"], "lr": self.lr_schedulers.schedulers[0].get_last_lr()[0],
               "raw_tokens": st["raw_tokens"], "compact_rows": st["compact_rows"],
               "compression": st["raw_tokens"] / max(st["compact_rows"], 1), "microbatches": st["microbatches"],
               "trajectories": st["trajectories"], "step_s": step_s, "fbgrad_s": out["fbgrad_s"],
               "data_wait_s": wait_s,
               "raw_tok_s": st["raw_tokens"] / step_s, "compact_tok_s": st["compact_rows"] / step_s,
               "plan_s": st["plan_s"], "pack_s": st["pack_s"], "load_s": st["load_s"],
               "peak_mem_gib": peak_memory_gib(self.device), "harts": self.cfg.harts.enabled,
               "world": self.world_size, "dp": self.dp_degree, "ep": self.dims.ep, "tp": self.dims.tp,
               "pp": self.dims.pp, "cp": self.dims.cp}
        if "logp_gap" in out:
            rec["logp_gap"] = out["logp_gap"]
        if self.cfg.online.enabled:  # the sampler's measurements (harts.rl.rollout)
            rec.update(entropy=st["entropy"], generated_tokens=st["generated_tokens"], rollout_s=st["rollout_s"],
                       decode_tok_s=st["decoded_tokens"] / max(st["rollout_s"], 1e-9))
        flops = self.flops_per_row * st["compact_rows"]
        rec["tflops"] = flops / step_s / 1e12
        rec["mfu"] = flops / (step_s * self.world_size * self.peak_flops) if self.peak_flops else None
        if out["counts"] is not None:
            rec.update(expert_balance(out["counts"]))
        return rec

    # ------------------------------------------------------------------ export
    def export_hf(self, path: str) -> None:
        """Full (unsharded) weights in the official HF safetensors layout of the model's family (Ling-3.0's
        ``save_pretrained``, or ``Qwen35ForCausalLM.save_pretrained``: a folder transformers'
        ``Qwen3_5MoeForCausalLM`` loads), written by rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.pp_group is None:
            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:  # every stage holds its own layers (cpu_offload would leave them on global rank 0 only): gather
            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            sd = {k: v.detach().cpu() for k, v in sd.items()}
            parts = [None] * self.dims.pp
            dist.all_gather_object(parts, sd, group=self.pp_group)
            sd = {k: v for part in parts for k, v in part.items()}
        if self.rank == 0:
            plain = self._whole_model()
            plain.to_empty(device="cpu")
            plain.cast_(self.dtype)  # the trained dtype (float64 runs export float64), decay parameters fp32+
            plain.load_state_dict(sd)
            if is_qwen35(self.model_cfg):
                plain.save_pretrained(path)
            else:
                from harts.models.ling.checkpoint import save_pretrained

                save_pretrained(plain, path)
            log.info("exported HF safetensors to %s", path)
        if self.distributed:
            dist.barrier()

    def close(self):
        self.checkpointer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
