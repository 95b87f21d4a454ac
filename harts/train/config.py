"""Trainer configuration: the sections of the settings the trainer reads, HARTS's and torchtitan 0.2.2's.

Like torchtitan's ``JobConfig`` this is a tree of dataclasses parsed by tyro from a TOML file and
``--section.key value`` command-line overrides (precedence: command line, TOML, defaults). Sections ``job``,
``training``, ``optimizer``, ``lr_scheduler``, ``parallelism``, ``checkpoint``, ``activation_checkpoint``,
``compile``, ``metrics``, ``debug`` and ``comm`` carry torchtitan's names, defaults (read from torchtitan's
classes) and meanings for the settings the trainer reads, plus HARTS's additions; the three that a torchtitan
component takes (optimizer, lr_scheduler, checkpoint) convert to torchtitan's class with ``to_torchtitan()``.
HARTS adds ``model`` (the model), ``harts`` (prefix sharing on/off, planner capacity), ``data``, ``rl``,
``online`` (rollouts sampled from the policy) and ``profile``. Every key is read, so ``--help`` lists exactly
what has an effect; any other key is an error naming it (and saying when it is a torchtitan setting the
trainer does not use).

Types carry the checks that need no context: a field with a fixed set of values is a ``Literal`` (tyro
rejects another value and ``--help`` lists the allowed ones; TOML values get the same check), and every
section has a ``validate()`` for checks across its own fields; ``validate(cfg)`` runs them and the checks
that span sections.

Command-line syntax is tyro's, with three conveniences registered as tyro rules: a boolean takes
``--a.b``, ``--a.b=true`` or ``--a.b=false``; a list takes ``--a.b=1,2`` as well as ``--a.b 1 2``; and
``--config FILE`` is an alias of ``--job.config_file FILE``.
"""

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro
from torchtitan.config import ConfigManager
from torchtitan.config import job_config as tt

from harts.data.trajectory import did_you_mean

__all__ = ["HartsJobConfig", "parse_args", "load_config", "validate"]


@dataclass
class Model:
    preset: str = "ling3-tiny-debug"
    """Model preset, naming the family: a LingConfig one ('ling3-tiny-debug' | 'ling3-small' | 'ling3-tiny') or a
    Qwen35Config one ('qwen3.5-debug' | 'qwen3.5-8l' | 'qwen3.5-35b-a3b': Qwen3.5-MoE, whose GDN chunk size
    ``kda_chunk_size`` then sets; docs/training.md says what it runs with)."""
    num_hidden_layers: int = 0
    """Override the preset's layer count (0 = keep)."""
    kda_chunk_size: int = 0
    """Override the KDA chunk size (0 = keep); it is also the HARTS planner's chunk size."""
    backend: Literal["auto", "reference", "fast"] = "auto"
    """Op backends: 'auto' (fast on CUDA, reference on CPU), 'reference' or 'fast'."""
    op_backends: str = ""
    """Per-op overrides of ``backend``, e.g. 'norm=reference,moe=reference' (ops: attention, kda, conv,
    moe, logprobs, norm): to place a numerical difference on one op's fast path."""
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """Parameter dtype: float32 | float64 (CPU exactness tests) | bfloat16 (pure bf16, no master copy)."""
    init_seed: int = 0
    """Weight init seed. Every tensor draws from its own generator, seeded by this seed and the tensor's
    name, so any parallel layout starts from the same weights as one process; see init_on_meta."""
    init_on_meta: bool = False
    """Build on the meta device and initialise each rank's shards in place on the training device (for
    models too large to materialise on the host per rank). The weights equal a one-process init on the
    same device type, whatever the layout; host (CPU) and CUDA random streams differ, so they do not
    equal the init_on_meta = false weights on a GPU."""
    load_hf: str = ""
    """Start from an HF safetensors checkpoint directory (official layout) instead of random init."""

    def validate(self) -> None:
        if not isinstance(self.preset, str) or not self.preset:
            raise ValueError(f"config: model.preset = {self.preset!r} must name a model preset")
        for name in ("num_hidden_layers", "kda_chunk_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"config: model.{name} = {getattr(self, name)} must be >= 0 (0 keeps the preset's)")


@dataclass
class Harts:
    enabled: bool = True
    """True: prefix-shared compact execution; False: the trajectory-wise baseline through the same trainer."""
    capacity: int = 2048
    """Microbatch capacity: compact rows (HARTS) or raw tokens (baseline)."""
    exact_threshold: int = 512
    """Planner N0: largest trajectory count planned with the exact DP."""
    check_plan: bool = True
    """All-reduce a hash of the step's plan and fail if ranks disagree (one tiny collective per step)."""
    fill_pipeline: bool = True
    """With pipeline parallelism: plan at the largest capacity (<= ``capacity``) that gives every DP rank at
    least as many microbatches as there are stages; with fewer, the stages wait for each other."""

    def validate(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"config: harts.capacity = {self.capacity} must be >= 1")
        if self.exact_threshold < 0:
            raise ValueError(f"config: harts.exact_threshold = {self.exact_threshold} must be >= 0")


@dataclass
class Data:
    source: Literal["synthetic", "jsonl"] = "synthetic"
    """'synthetic' (a harts.data.synthetic preset, a new seed every step) or 'jsonl' (data.path; the schema
    is docs/byo-rollouts.md). A data.path with source 'synthetic' is an error, not silently ignored."""
    preset: str = "tiny"
    """Synthetic workload preset (harts.data.synthetic.PRESETS)."""
    seed: int = 0
    """Step s uses seed + s (synthetic)."""
    scale: float = 1.0
    """Synthetic: multiplies the number of rollout trees per step (each tree's shape is unchanged)."""
    path: list[str] = field(default_factory=list)
    """JSONL files, one step each, cycled in order (jsonl source): step s reads file (s-1) mod len(path), so
    one file gives the same rollouts every step. In TOML a single string is one file. Every file is read and
    checked before step 1."""
    fixed_step: bool = False
    """Synthetic source: every step reuses the first generated step (offline RL on one batch: the loss then
    falls as the policy fits it). JSONL files are always cycled (see path)."""
    check_files: bool = True
    """Read and check every file of path before step 1 (schema, required fields, loss tokens, harts.capacity;
    the ranks share the files), so that a bad file stops the run at once; false: each file is checked when its
    step reads it."""
    max_length: int = 0
    """Truncate trajectories to this many tokens (0 = keep); for sizing a workload to the hardware."""
    reward: Literal["auto", "data", "learnable"] = "auto"
    """'data': rewards from the rollouts; 'learnable': reward = fraction of loss tokens with id < vocab/2
    (a signal the policy can learn from fixed offline rollouts; it replaces the rollouts' rewards);
    'auto': 'data' for JSONL files (your rewards are used), 'learnable' for synthetic rollouts (whose
    generated rewards are coin flips). The start-up summary says which one a run uses."""
    prefetch: int = 2
    """Steps prepared ahead by the background worker (0 = prepare in the main thread)."""

    def validate(self) -> None:
        if isinstance(self.path, str):
            raise TypeError(f"config: data.path = {self.path!r} must be a list of files, e.g. [{self.path!r}]")
        if self.source == "jsonl" and not self.path:
            raise ValueError("config: data.source = 'jsonl' needs data.path (one or more JSONL files)")
        if self.source != "jsonl" and self.path:
            raise ValueError(f"config: data.path = {self.path} is set but data.source = {self.source!r}, which "
                             "ignores it; add --data.source=jsonl to train on the files")
        if self.source == "synthetic":
            from harts.data.synthetic import PRESETS

            if self.preset not in PRESETS:
                raise ValueError(f"config: data.preset = {self.preset!r} is not a synthetic workload preset; "
                                 f"known: {', '.join(sorted(PRESETS))}")
        if not self.scale > 0:
            raise ValueError(f"config: data.scale = {self.scale} must be > 0")
        for name in ("max_length", "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"config: data.{name} = {getattr(self, name)} must be >= 0")


@dataclass
class RL:
    objective: Literal["grpo", "ppo"] = "grpo"
    """'grpo': -A log p (on-policy); 'ppo': PPO-clip against old log-probs."""
    advantages: Literal["grpo", "data"] = "grpo"
    """'grpo': group-relative from reward and group_id; 'data': the rollouts' advantage(s)."""
    std_normalize: bool = True
    """GRPO: divide each advantage by its group's reward std (false: subtract the group mean only)."""
    adv_eps: float = 1e-6
    """GRPO: added to the group's reward std before dividing."""
    clip_eps: float = 0.2
    """PPO: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float = 0.0
    """Upper clip (0 = clip_eps)."""
    kl_coef: float = 0.0
    """k3 KL to the rollouts' ref_logprobs."""
    old_logprobs: Literal["data", "recompute"] = "data"
    """PPO: 'data' (rollouts' old_logprobs) or 'recompute' (a no-grad pass before the update)."""
    loss_norm: Literal["token", "sequence"] = "token"
    """'token' or 'sequence'; both are step-global (see harts.rl.losses)."""
    z_loss_coef: float = 0.0
    """MoE router z-loss weight (mean squared log-sum-exp of the router logits; 0 = off)."""
    aux_loss_coef: float = 0.0
    """MoE load-balance loss weight (sum over experts of f_E P_E: the previous step's load share times the
    mean router probability; 0 = off)."""
    expert_bias_rate: float = 1e-3
    """Aux-loss-free balancing step (0 = off); counts are multiplicity-weighted and summed over DP."""

    def validate(self) -> None:
        for name in ("adv_eps", "clip_eps", "clip_eps_high", "kl_coef", "z_loss_coef", "aux_loss_coef",
                     "expert_bias_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"config: rl.{name} = {getattr(self, name)} must be >= 0")


@dataclass
class Online:
    enabled: bool = False
    """Online RL: every step samples rollout trees from the current policy (harts.rl.rollout) on
    ``online.task`` and trains on them; [data]'s source is not read. One process (docs/online.md)."""
    task: str = "lookup"
    """Built-in environment (harts.rl.tasks.TASKS): 'lookup' (a lookup-tool task)."""
    episodes: int = 8
    """Rollout trees per step (each is one GRPO group)."""
    branching: list[int] = field(default_factory=lambda: [4, 2])
    """Branches per turn: every live branch forks into branching[t] at turn t (1 after the list)."""
    max_turns: int = 8
    """Turns after which an episode ends even if the environment has not ended it."""
    temperature: float = 1.0
    """Sampling temperature (1: the policy itself, so the sampler's log-probs are PPO's old log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens holding this much probability (1 = all)."""
    seed: int = 0
    """Step s's episode seeds and sampler generator derive from (seed, s): a run is reproducible, and
    HARTS on and off from the same seed sample the same rollouts."""
    plot: bool = True
    """Write reward_vs_step.png (reward per step) to job.dump_folder at the end; needs matplotlib."""

    def validate(self) -> None:
        from harts.rl.tasks import TASKS

        if self.task not in TASKS:
            raise ValueError(f"config: online.task = {self.task!r}; known: {', '.join(sorted(TASKS))}")
        for name in ("episodes", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"config: online.{name} = {getattr(self, name)} must be >= 1")
        if not self.branching or any(k < 1 for k in self.branching):
            raise ValueError(f"config: online.branching = {self.branching} must be a non-empty list of counts >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"config: online.temperature = {self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"config: online.top_p = {self.top_p} must lie in (0, 1]")


@dataclass
class Profile:
    enable: bool = False
    """Trace profile.steps with torch.profiler (CPU, and CUDA on a GPU)."""
    steps: list[int] = field(default_factory=lambda: [3])
    """Steps (1-based) to trace; each writes a chrome trace per rank."""
    folder: str = "profile"
    """Under job.dump_folder."""

    def validate(self) -> None:
        if any(s < 1 for s in self.steps):
            raise ValueError(f"config: profile.steps = {self.steps}: steps are 1-based (each >= 1)")


def _torchtitan_section(tt_cls):
    """A section with torchtitan's names, defaults and meanings: its fields named like ``tt_cls``'s and declared
    without a value take torchtitan's default, and ``to_torchtitan()`` gives the ``tt_cls`` instance a torchtitan
    component takes (its fields the section has get the section's values, the rest torchtitan's defaults)."""
    tt_fields = {f.name: f for f in dataclasses.fields(tt_cls)}

    def to_torchtitan(self):
        ours = {f.name for f in dataclasses.fields(self)}
        return tt_cls(**{name: getattr(self, name) for name in tt_fields if name in ours})

    def wrap(cls):
        for name in cls.__dict__.get("__annotations__", {}):
            f = tt_fields.get(name)
            if f is not None and name not in cls.__dict__:
                setattr(cls, name, f.default if f.default is not dataclasses.MISSING
                        else field(default_factory=f.default_factory))
        cls.to_torchtitan = to_torchtitan
        return dataclass(cls)

    return wrap


@_torchtitan_section(tt.Job)
class Job:
    config_file: Annotated[str | None, tyro.conf.arg(aliases=("--config",))] = None
    """TOML file to read the config from (``--config FILE`` for short); command-line values override it."""
    dump_folder: str
    """Run folder: checkpoints, metrics.jsonl, traces and the HF export go below it."""
    description: str
    """Free text naming the run, logged at start."""
    print_config: bool
    """Print the whole resolved config at start."""


@_torchtitan_section(tt.Training)
class Training:
    steps: int
    """Optimizer steps to run (the run resumes to this count from its latest checkpoint)."""
    max_norm: float
    """Gradient clipping: gradients are scaled down so that their total norm is at most this (> 0)."""
    mixed_precision_param: Literal["bfloat16", "float32"]
    """With FSDP2 and float32 parameters: the dtype parameters are gathered and computed in."""
    mixed_precision_reduce: Literal["float32"]
    """With FSDP2: the dtype gradients are reduced in."""
    gc_freq: int
    """Python's automatic garbage collection is off during training (it would stop the host at random points
    of a step, between kernel launches or inside pack); a generation-1 collection runs at the start of every
    this many steps instead (torchtitan's GarbageCollection)."""

    def validate(self) -> None:
        if self.steps < 1:
            raise ValueError(f"config: training.steps = {self.steps} must be >= 1")
        if self.gc_freq < 1:
            raise ValueError(f"config: training.gc_freq = {self.gc_freq} must be >= 1 (steps between collections)")
        if not self.max_norm > 0:
            raise ValueError(f"config: training.max_norm = {self.max_norm} must be > 0 (the clipping bound)")


@_torchtitan_section(tt.Checkpoint)
class Checkpoint:
    enable: bool
    """Save checkpoints (torchtitan's CheckpointManager, DCP format) and resume from the latest one."""
    folder: str
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int
    """Save every this many steps (and after the last one)."""
    keep_latest_k: int
    """Keep this many of the latest checkpoints, delete older ones (0 = keep all)."""
    load_step: int
    """Resume from this step's checkpoint (-1 = the latest)."""
    last_save_model_only: bool
    """The checkpoint after the last step holds the model only (no optimizer, scheduler or train state)."""
    export_dtype: Literal["float16", "bfloat16", "float32"]
    """Dtype of the model-only last checkpoint."""
    initial_load_path: str | None
    """A DCP checkpoint to start from when the run folder has none."""
    initial_load_model_only: bool
    """From initial_load_path, load the model only."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"]
    """Save in the background ('async', 'async_with_pinned_mem') or block ('disabled')."""
    exclude_from_loading: list[str]
    """State keys not to load when resuming (e.g. 'optimizer,lr_scheduler')."""
    enable_first_step_checkpoint: bool
    """Also save before the first step."""
    load_only: bool
    """Load checkpoints but never save."""
    enable_ft_dataloader_checkpoints: bool
    """torchtitan's setting for fault-tolerant data loader state (the HARTS loader keeps none; leave it)."""
    export_hf: bool = False
    """After the last step, write the model in the official HF safetensors layout to <folder>/hf."""
    overwrite: bool = False
    """Start a fresh run in a job.dump_folder that holds an earlier one: delete its checkpoints
    (checkpoint.folder) and metrics.jsonl first. Without it the trainer resumes from the latest complete
    checkpoint, and refuses a folder whose run already reached training.steps."""

    def validate(self) -> None:
        if self.enable and self.interval < 1:
            raise ValueError(f"config: checkpoint.interval = {self.interval} must be >= 1")


@_torchtitan_section(tt.Parallelism)
class Parallelism:
    data_parallel_replicate_degree: int
    """Data-parallel replicas (HSDP's outer, replicated dimension)."""
    data_parallel_shard_degree: int
    """FSDP2 shards per replica (-1: the ranks the other degrees leave)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"]
    """Free gathered parameters after each forward ('always'), keep them for the backward ('never'), or
    torchtitan's choice per pipeline schedule ('default')."""
    tensor_parallel_degree: int
    """Tensor-parallel ranks (DTensor parallel styles on each mixer and FFN)."""
    enable_sequence_parallel: bool = False
    """With TP: shard the rows (compact rows or tokens) over the TP group outside the TP regions (norms,
    residual stream, pipeline activations); all-gather into and reduce-scatter out of each region."""
    pipeline_parallel_degree: int
    """Pipeline stages (the decoder layers split evenly)."""
    pipeline_parallel_schedule: str
    """torch.distributed.pipelining schedule name, e.g. '1F1B' or 'GPipe'."""
    context_parallel_degree: int
    """Context-parallel ranks (HARTS batches only: heads split across ranks, rows exchanged by all-to-all)."""
    expert_parallel_degree: int
    """Expert-parallel ranks (experts split, tokens dispatched by all-to-all)."""
    expert_tensor_parallel_degree: int
    """Tensor parallelism inside the experts (1: none)."""

    def validate(self) -> None:
        for name in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                     "expert_parallel_degree", "expert_tensor_parallel_degree", "context_parallel_degree"):
            if getattr(self, name) < 1:
                raise ValueError(f"config: parallelism.{name} = {getattr(self, name)} must be >= 1")
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            raise ValueError(f"config: parallelism.data_parallel_shard_degree = {self.data_parallel_shard_degree} "
                             "must be >= 1, or -1 (the ranks the other degrees leave)")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "selective", "full"] = "selective"
    """'selective' (the default: save matrix products and the mixer cores, recompute norms, gates and casts:
    harts.models.common.compile; Ling-3.0-tiny at 65,536 rows fits one H200 with it, 'none' does not); 'full'
    (recompute each decoder layer in backward, the plan and layout reused: the paper's setting, and what fits
    next to a whole optimizer state on one GPU, or with tensor / expert parallelism); 'none'."""


@_torchtitan_section(tt.Compile)
class Compile:
    enable: bool
    """torch.compile the decoder layers' regions (harts.models.ling.compile_model; the loss stays eager)."""
    backend: str
    """torch.compile backend."""


@_torchtitan_section(tt.Metrics)
class Metrics:
    log_freq: int
    """Log a step's metrics every this many steps (metrics.jsonl gets every step)."""
    enable_tensorboard: bool
    """Also write TensorBoard event files."""
    save_tb_folder: str
    """TensorBoard folder, relative to job.dump_folder."""
    disable_color_printing: bool
    """Plain log lines (no terminal colours)."""


@_torchtitan_section(tt.Debug)
class Debug:
    seed: int | None
    """torch.manual_seed at start (None: 0); the data has its own seed (data.seed)."""
    deterministic: bool
    """torch.use_deterministic_algorithms(True)."""
    check_finite: bool = True
    """After each microbatch's backward, check loss and gradients for NaN/Inf (one host sync each)."""
    exit_after_step: int = 0
    """Simulate a kill (tests): exit right after this step's checkpoint, without cleanup (0 = off)."""
    dump_hidden: str = ""
    """Path prefix: write step 1's final hidden state at every predicted position to PATH.rank<R>.pt and the LM
    head to PATH.lm_head.pt, for `python -m benchmarks.layout_fidelity A B` ('' = off)."""
    dump_hidden_stride: int = 1
    """With dump_hidden: keep the positions with (trajectory + position) % k == 0 (smaller files)."""
    dump_grad_norms: str = ""
    """Path prefix: write step 1's gradient norm of every parameter to PATH.rank<R>.json, for
    scripts/compare_grad_norms.py ('' = off)."""

    def validate(self) -> None:
        if self.dump_hidden_stride < 1:
            raise ValueError(f"config: debug.dump_hidden_stride = {self.dump_hidden_stride} must be >= 1")
        if self.exit_after_step < 0:
            raise ValueError(f"config: debug.exit_after_step = {self.exit_after_step} must be >= 0 (0 = off)")


@_torchtitan_section(tt.Comm)
class Comm:
    init_timeout_seconds: int
    """Timeout of the process group's collectives (torch.distributed.init_process_group)."""


@_torchtitan_section(tt.Optimizer)
class Optimizer:
    name: str
    """torch.optim class name (torchtitan's build_optimizers): 'AdamW' or 'Adam'."""
    lr: float
    """Peak learning rate (the lr_scheduler shapes it)."""
    beta1: float
    """Adam's first-moment decay."""
    beta2: float
    """Adam's second-moment decay."""
    eps: float
    """Adam's denominator epsilon."""
    weight_decay: float
    """Decoupled weight decay (AdamW), applied to every parameter."""
    implementation: Literal["for-loop", "foreach", "fused"]
    """torch's optimizer implementation ('fused' falls back where a layout refuses it, logged)."""
    bf16_update: Literal["fp32_master", "plain"] = "fp32_master"
    """With model.dtype = bfloat16: 'fp32_master' (harts.train.bf16_adamw: fp32 gradient accumulation, and
    an fp32 master weight held as the bf16 weight plus its 16 low bits) or 'plain' (torch's AdamW on the
    bf16 tensors: updates below half a bf16 ulp are lost)."""
    bf16_fused: Literal["auto", "true", "false"] = "auto"
    """With bf16_update = 'fp32_master': 'true' runs the update as one Triton kernel per tensor
    (harts.kernels.bf16_adamw) instead of ~20 torch ops, equal up to the last fp32 bits of the master
    weights; 'false' runs the torch ops; 'auto'
    (default) is 'true' on CUDA and 'false' elsewhere (the kernel runs on CPU only interpreted)."""

    def validate(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"config: optimizer.lr = {self.lr} must be >= 0")


@_torchtitan_section(tt.LRScheduler)
class LRScheduler:
    warmup_steps: int
    """Linear warm-up steps from near 0 to optimizer.lr."""
    decay_ratio: float | None
    """Decay only over this last share of the steps, constant before (warmup-stable-decay); None: decay right
    after the warm-up."""
    decay_type: Literal["linear", "sqrt", "cosine"]
    """Shape of the decay."""
    min_lr_factor: float
    """The decay ends at optimizer.lr times this factor."""
    total_steps: int | None
    """Steps the schedule spans (None: training.steps)."""


@dataclass
class HartsJobConfig:
    """The trainer's config. Sections job ... comm carry torchtitan's names, defaults and meanings for the
    fields the trainer reads (and HARTS's additions); model ... profile are HARTS's."""

    job: Job = field(default_factory=Job)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    debug: Debug = field(default_factory=Debug)
    comm: Comm = field(default_factory=Comm)
    model: Model = field(default_factory=Model)
    harts: Harts = field(default_factory=Harts)
    data: Data = field(default_factory=Data)
    rl: RL = field(default_factory=RL)
    online: Online = field(default_factory=Online)
    profile: Profile = field(default_factory=Profile)


# ------------------------------------------------------------------ parsing

_BOOL = {"true": True, "false": False}
_REGISTRY = tyro.constructors.ConstructorRegistry()
ConfigManager.register_tyro_rules(_REGISTRY)  # torchtitan's rule: a list[str] is given as "a,b,c"


@_REGISTRY.primitive_rule
def _bool_rule(info: tyro.constructors.PrimitiveTypeInfo):
    """``--a.b`` alone means true; ``--a.b=true`` / ``--a.b=false`` set either value (TOML's spelling)."""
    if info.type is not bool:
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=(0, 1), metavar="[true|false]", choices=tuple(_BOOL),
        instance_from_str=lambda args: True if not args else _BOOL[args[0]],
        is_instance=lambda x: isinstance(x, bool), str_from_instance=lambda x: ["true" if x else "false"])


@_REGISTRY.primitive_rule
def _number_list_rule(info: tyro.constructors.PrimitiveTypeInfo):
    """A list of numbers takes ``--a.b=1,2`` as well as ``--a.b 1 2``."""
    if info.type not in (list[int], list[float]):
        return None
    elem = typing.get_args(info.type)[0]
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs="*", metavar="N,N,...",
        instance_from_str=lambda args: [elem(x) for a in args for x in a.split(",") if x],
        is_instance=lambda v: isinstance(v, list) and all(isinstance(x, elem) for x in v),
        str_from_instance=lambda v: [",".join(str(x) for x in v)])


_CONFIG_KEYS = ("--config", "--job.config_file", "--job.config-file")


def _option_values(argv: list[str], names) -> list[str | None]:
    """The values the command line gives any of ``names`` (``--k=v`` or ``--k v``), in order; None where the
    option ends the command line."""
    values = []
    for i, a in enumerate(argv):
        k, eq, v = a.partition("=")
        if k in names:
            values.append(v if eq else (argv[i + 1] if i + 1 < len(argv) else None))
    return values


def _read_toml(path: str) -> dict:
    """The file's tables, or one line naming the file (torchtitan's loader logs a traceback first)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ValueError(f"config: cannot read the config file {path} ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config: {path} is not valid TOML ({e})") from None


def _torchtitan_hint(section: str | None, key: str) -> str:
    """' (a torchtitan setting ...)' when an unknown section or key is one of torchtitan's JobConfig: the
    trainer reads only the torchtitan settings its sections declare."""
    if section is None:
        known = {f.name for f in dataclasses.fields(tt.JobConfig)}
        return " (a torchtitan section the HARTS trainer does not use)" if key in known else ""
    cls = typing.get_type_hints(tt.JobConfig).get(section)
    if cls is not None and dataclasses.is_dataclass(cls) and key in {f.name for f in dataclasses.fields(cls)}:
        return " (a torchtitan setting the HARTS trainer does not use)"
    return ""


def _from_toml(cls, data: dict, path: str, section: str | None = None):
    """TOML tables -> the dataclasses, naming an unknown section or key with the nearest known one."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key == "ling" and section is None:
            raise ValueError(f"config: section [ling] in {path} is now [model] (the same keys): rename it")
        if key not in known:
            where = f"key '{key}' of [{section}]" if section else f"section [{key}]"
            extra = _torchtitan_hint(section, key)
            raise ValueError(f"config: unknown {where}{did_you_mean(key, known)}{extra} in {path}; "
                             "`python train.py --help` lists every key")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ValueError(f"config: {key} = {_toml_repr(value)} in {path}: [{key}] is a section (a table of "
                                 "keys), not a value")
            kwargs[key] = _from_toml(hints[key], value, path, key)
        else:
            kwargs[key] = _toml_value(hints[key], value, f"{section}.{key}" if section else key, path)
    return cls(**kwargs)


def _toml_repr(value) -> str:
    """A value as TOML writes it (strings in double quotes, true/false)."""
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string (in quotes)"}


def _kind(t) -> str:
    """What a value of type ``t`` is, in words."""
    t = typing.get_args(t)[0] if typing.get_origin(t) is Annotated else t
    if typing.get_origin(t) is Literal:
        return "one of " + ", ".join(_toml_repr(a) for a in typing.get_args(t))
    if typing.get_origin(t) is list:
        elem = typing.get_args(t)[0]
        return "a list of " + {str: "strings (in quotes)", int: "integers", float: "numbers"}.get(elem, _kind(elem))
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) in (typing.Union, types.UnionType) and len(args) == 1:
        return _kind(args[0])
    return _KINDS.get(t, getattr(t, "__name__", str(t)))


def _toml_value(t, value, key: str, path: str):
    """A TOML value checked against the field's type ``t`` (tyro checks the command line's, but takes a TOML
    default of the wrong type as it is): an int where a float is expected becomes a float, a string where a
    list of strings is expected a one-element list; anything else of the wrong type is one line naming the
    file, the key, the value and the type expected."""
    t0 = typing.get_args(t)[0] if typing.get_origin(t) is Annotated else t
    origin, args = typing.get_origin(t0), typing.get_args(t0)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if a is not type(None):
                try:
                    return _toml_value(a, value, key, path)
                except ValueError:
                    pass
    elif origin is Literal:
        return value  # _check_values names the allowed values
    elif origin is list:
        if isinstance(value, str) and args == (str,):
            return [value]  # path = "x.jsonl" means the one file, not its characters
        if isinstance(value, list):
            try:
                return [_toml_value(args[0], v, key, path) for v in value]
            except ValueError:
                pass
    elif t0 is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif t0 in (bool, int, str) and isinstance(value, t0) and (t0 is bool or not isinstance(value, bool)):
        return value
    elif t0 not in (bool, int, float, str):
        return value
    raise ValueError(f"config: {key} = {_toml_repr(value)} in {path}: expected {_kind(t)}")


def _unknown_option(token: str) -> str:
    key = token.split("=", 1)[0]
    if not key.startswith("--") or "." not in key:
        return f"config: unexpected argument {token!r}; options are written --section.key=value"
    sec, _, name = key[2:].partition(".")
    sections = typing.get_type_hints(HartsJobConfig)  # section name -> its dataclass
    if sec == "ling":
        return f"config: option {key} is now --model.{name} (the section [ling] is [model]): rename it"
    if sec not in sections:
        hint = _torchtitan_hint(None, sec)
        return f"config: unknown option {key}: no section [{sec}]{did_you_mean(sec, sections)}{hint}"
    dotted = [f"--{sec}.{f.name}" for f in dataclasses.fields(sections[sec])]
    return (f"config: unknown option {key}{did_you_mean(f'--{sec}.' + name.replace('-', '_'), dotted)}"
            f"{_torchtitan_hint(sec, name.replace('-', '_'))}; `python train.py --help` lists every option")


def _given(argv: list[str], key: str) -> str | None:
    """The value the command line gave ``--key`` (last occurrence)."""
    values = _option_values(argv, {f"--{key}", f"--{key.replace('_', '-')}"})
    return values[-1] if values else None


def _not_allowed(key: str, value, allowed) -> str:
    return f"config: {key} = {value!r} is not one of {', '.join(repr(a) for a in allowed)}"


def _one_line_errors(argv: list[str]):
    """tyro's parse errors as one-line ValueErrors naming the option, the value and what is allowed (train.py
    prints those as its one ``error:`` line; tyro's own rendering is a multi-line box). The hook API is tyro's
    (``tyro._errors``, 1.0.x); where it is missing, tyro prints its own message, which names the same things."""
    import contextlib

    try:
        from tyro import _errors
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(_errors, "on_parse_error"):
        return contextlib.nullcontext()

    def hook(event) -> None:
        arg = getattr(event, "argument", None)
        key = arg.get_output_key() if arg is not None else None
        if isinstance(event, _errors.InvalidChoice):
            raise ValueError(_not_allowed(key, event.value, event.choices) + f" (--{key})")
        if isinstance(event, _errors.UnrecognizedArgs):
            raise ValueError(_unknown_option(event.tokens[0]))
        if isinstance(event, _errors.BadValue):
            raise ValueError(f"config: --{key} needs a value")
        if isinstance(event, _errors.InstantiationFailure) and key is not None:
            t = arg.field.type_stripped
            kind = {int: "an integer", float: "a number"}.get(t) or (
                "numbers separated by commas" if t in (list[int], list[float]) else f"a {getattr(t, '__name__', t)}")
            raise ValueError(f"config: --{key}={_given(argv, key)}: expected {kind}")

    return _errors.on_parse_error(hook)


# ------------------------------------------------------------------ checks


def _check_values(section: str, obj) -> None:
    """Values a TOML file set (tyro checks the command line's): Literal fields hold an allowed value, bools a
    bool."""
    for f in dataclasses.fields(obj):
        t, v = typing.get_type_hints(type(obj))[f.name], getattr(obj, f.name)
        if typing.get_origin(t) is Literal and v not in typing.get_args(t):
            raise ValueError(_not_allowed(f"{section}.{f.name}", v, typing.get_args(t)))
        if t is bool and not isinstance(v, bool):
            raise TypeError(f"config: {section}.{f.name} = {v!r} must be true or false")


def validate(cfg: HartsJobConfig) -> HartsJobConfig:
    """Every section's values and ``validate()``, then the checks that span sections: context parallelism
    needs HARTS batches; selective checkpointing excludes tensor and expert parallelism; online mode excludes
    rollout files, replaced rewards, data advantages and the KL term."""
    for sec in dataclasses.fields(cfg):
        obj = getattr(cfg, sec.name)
        _check_values(sec.name, obj)
        if hasattr(obj, "validate"):
            obj.validate()
    if cfg.parallelism.context_parallel_degree > 1 and not cfg.harts.enabled:
        raise ValueError("config: parallelism.context_parallel_degree > 1 needs harts.enabled = true (context "
                         "parallelism is implemented for HARTS prefix-shared batches, not the trajectory-wise "
                         "baseline)")
    if cfg.online.enabled:
        if cfg.data.source != "synthetic" or cfg.data.path:
            raise ValueError(f"config: online.enabled = true samples its own rollouts, but data.source = "
                             f"{cfg.data.source!r}{' with data.path' if cfg.data.path else ''} is set too; remove it")
        if cfg.data.reward not in ("auto", "data"):
            raise ValueError(f"config: data.reward = {cfg.data.reward!r} would replace the environment's rewards "
                             "in online mode; leave it at 'auto'")
        if cfg.rl.advantages != "grpo":
            raise ValueError("config: online.enabled = true needs rl.advantages = 'grpo' (rollouts carry rewards, "
                             "not advantages)")
        if cfg.rl.kl_coef > 0:
            raise ValueError("config: rl.kl_coef > 0 needs reference log-probs, which online rollouts do not carry")
    return cfg


def parse_args(argv: list[str] | None = None) -> HartsJobConfig:
    """The config of a command line: ``--config FILE.toml`` (optional) and ``--section.key=value`` overrides."""
    argv = sys.argv[1:] if argv is None else list(argv)
    path = next((v for v in _option_values(argv, _CONFIG_KEYS) if v is not None), None)  # the first --config
    base = HartsJobConfig()
    if path:
        base = _from_toml(HartsJobConfig, _read_toml(path), path)
        for sec in dataclasses.fields(base):  # before tyro, which would warn about them
            try:
                _check_values(sec.name, getattr(base, sec.name))
            except (ValueError, TypeError) as e:
                raise type(e)(f"{e} (in {path})") from None
    with _one_line_errors(argv):
        cfg = tyro.cli(HartsJobConfig, args=argv, default=base, registry=_REGISTRY, use_underscores=True,
                       config=(tyro.conf.FlagConversionOff,))
    return validate(cfg)


def load_config(path: str | None = None, **overrides) -> HartsJobConfig:
    """Programmatic access (tests): a TOML file plus ``{"section.key": value}`` overrides."""
    argv = ["--config", path] if path else []
    for k, v in overrides.items():
        if isinstance(v, bool):
            argv.append(f"--{k}={'true' if v else 'false'}")
        elif isinstance(v, (list, tuple)):
            argv.append(f"--{k}=" + ",".join(str(x) for x in v))
        else:
            argv.append(f"--{k}={v}")
    return parse_args(argv)
