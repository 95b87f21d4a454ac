"""Trainer configuration: torchtitan 0.2.2's ``JobConfig`` extended with HARTS sections.

torchtitan's ``ConfigManager`` gives TOML loading and ``--section.key value`` CLI overrides (tyro) with
precedence CLI > TOML > defaults. We reuse its sections for what they mean there (``job``, ``training``
(steps, max_norm, mixed precision), ``optimizer``, ``lr_scheduler``, ``parallelism``, ``checkpoint``,
``activation_checkpoint``, ``compile``, ``metrics``, ``debug``) and add ours: ``ling`` (the model),
``harts`` (prefix sharing on/off, planner capacity), ``data``, ``rl``, ``online`` (rollouts sampled from the
policy) and ``profile``. Fields of torchtitan sections that this trainer does not read (tokenizer, HF
datasets, float8, fault tolerance, ...) are rejected by ``validate`` when changed from their default, so a
config never silently does nothing.

Besides tyro's own syntax we accept ``--config X.toml`` (= ``--job.config_file``), ``--a.b=true|false``
for booleans and ``--a.b=1,2`` for lists.
"""

import dataclasses
import sys
import typing
from dataclasses import dataclass, field

from torchtitan.config import ConfigManager
from torchtitan.config import job_config as tt

from harts.data.trajectory import did_you_mean

__all__ = ["HartsJobConfig", "parse_args", "load_config"]


@dataclass
class Ling:
    preset: str = "ling3-tiny-debug"
    """Model preset, naming the family: a LingConfig one ('ling3-tiny-debug' | 'ling3-small' | 'ling3-tiny') or a
    Qwen35Config one ('qwen3.5-debug' | 'qwen3.5-8l' | 'qwen3.5-35b-a3b': Qwen3.5-MoE, whose GDN chunk size
    ``kda_chunk_size`` then sets; docs/training.md says what it runs with)."""
    num_hidden_layers: int = 0
    """Override the preset's layer count (0 = keep)."""
    kda_chunk_size: int = 0
    """Override the KDA chunk size (0 = keep); it is also the HARTS planner's chunk size."""
    backend: str = "auto"
    """Op backends: 'auto' (fast on CUDA, reference on CPU), 'reference' or 'fast'."""
    op_backends: str = ""
    """Per-op overrides of ``backend``, e.g. 'norm=reference,moe=reference' (ops: attention, kda, conv,
    moe, logprobs, norm): to place a numerical difference on one op's fast path."""
    dtype: str = "float32"
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


@dataclass
class Data:
    source: str = "synthetic"
    """'synthetic' (a harts.data.synthetic preset, a new seed every step) or 'jsonl' (data.path; the schema
    is docs/byo-rollouts.md). A data.path with source 'synthetic' is an error, not silently ignored."""
    preset: str = "tiny"
    seed: int = 0
    """Step s uses seed + s (synthetic)."""
    scale: float = 1.0
    path: list[str] = field(default_factory=list)
    """JSONL files, one step each, cycled in order (jsonl source)."""
    fixed_step: bool = False
    """Every step reuses the first step's rollouts (offline RL on one batch: the loss then falls as the
    policy fits it)."""
    max_length: int = 0
    """Truncate trajectories to this many tokens (0 = keep); for sizing a workload to the hardware."""
    reward: str = "auto"
    """'data': rewards from the rollouts; 'learnable': reward = fraction of loss tokens with id < vocab/2
    (a signal the policy can learn from fixed offline rollouts; it replaces the rollouts' rewards);
    'auto': 'data' for JSONL files (your rewards are used), 'learnable' for synthetic rollouts (whose
    generated rewards are coin flips). The start-up summary says which one a run uses."""
    prefetch: int = 2
    """Steps prepared ahead by the background worker (0 = prepare in the main thread)."""


@dataclass
class RL:
    objective: str = "grpo"
    """'grpo': -A log p (on-policy); 'ppo': PPO-clip against old log-probs."""
    advantages: str = "grpo"
    """'grpo': group-relative from reward and group_id; 'data': the rollouts' advantage(s)."""
    std_normalize: bool = True
    adv_eps: float = 1e-6
    clip_eps: float = 0.2
    clip_eps_high: float = 0.0
    """Upper clip (0 = clip_eps)."""
    kl_coef: float = 0.0
    """k3 KL to the rollouts' ref_logprobs."""
    old_logprobs: str = "data"
    """PPO: 'data' (rollouts' old_logprobs) or 'recompute' (a no-grad pass before the update)."""
    loss_norm: str = "token"
    """'token' or 'sequence'; both are step-global (see harts.rl.losses)."""
    z_loss_coef: float = 0.0
    aux_loss_coef: float = 0.0
    expert_bias_rate: float = 1e-3
    """Aux-loss-free balancing step (0 = off); counts are multiplicity-weighted and summed over DP."""


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


@dataclass
class Profile:
    enable: bool = False
    steps: list[int] = field(default_factory=lambda: [3])
    """Steps (1-based) to trace; each writes a chrome trace per rank."""
    folder: str = "profile"
    """Under job.dump_folder."""


@dataclass
class Checkpoint(tt.Checkpoint):
    export_hf: bool = False
    """After the last step, write the model in the official HF safetensors layout to <folder>/hf."""
    overwrite: bool = False
    """Start a fresh run in a job.dump_folder that holds an earlier one: delete its checkpoints
    (checkpoint.folder) and metrics.jsonl first. Without it the trainer resumes from the latest complete
    checkpoint, and refuses a folder whose run already reached training.steps."""


@dataclass
class Parallelism(tt.Parallelism):
    enable_sequence_parallel: bool = False
    """With TP: shard the rows (compact rows or tokens) over the TP group outside the TP regions (norms,
    residual stream, pipeline activations); all-gather into and reduce-scatter out of each region."""


@dataclass
class ActivationCheckpoint(tt.ActivationCheckpoint):
    mode: str = "none"
    """'none' or 'full' (recompute each decoder layer in backward; the plan and layout are reused)."""


@dataclass
class Debug(tt.Debug):
    check_finite: bool = True
    """After each microbatch's backward, check loss and gradients for NaN/Inf (one host sync each)."""
    exit_after_step: int = 0
    """Simulate a kill (tests): exit right after this step's checkpoint, without cleanup (0 = off)."""
    dump_hidden: str = ""
    """Path prefix: write step 1's final hidden state at every predicted position to PATH.rank<R>.pt and the LM
    head to PATH.lm_head.pt, for `python -m harts.bench.layout_fidelity A B` ('' = off)."""
    dump_hidden_stride: int = 1
    """With dump_hidden: keep the positions with (trajectory + position) % k == 0 (smaller files)."""
    dump_grad_norms: str = ""
    """Path prefix: write step 1's gradient norm of every parameter to PATH.rank<R>.json, for
    scripts/compare_grad_norms.py ('' = off)."""


@dataclass
class Optimizer(tt.Optimizer):
    bf16_update: str = "fp32_master"
    """With ling.dtype = bfloat16: 'fp32_master' (harts.train.bf16_adamw: fp32 gradient accumulation, and
    an fp32 master weight held as the bf16 weight plus its 16 low bits) or 'plain' (torch's AdamW on the
    bf16 tensors: updates below half a bf16 ulp are lost)."""
    bf16_fused: str = "auto"
    """With bf16_update = 'fp32_master': 'true' runs the update as one Triton kernel per tensor
    (harts.kernels.bf16_adamw) instead of ~20 torch ops, equal up to the last fp32 bits of the master
    weights; 'false' runs the torch ops; 'auto'
    (default) is 'true' on CUDA and 'false' elsewhere (the kernel runs on CPU only interpreted)."""


@dataclass
class HartsJobConfig(tt.JobConfig):
    ling: Ling = field(default_factory=Ling)
    harts: Harts = field(default_factory=Harts)
    data: Data = field(default_factory=Data)
    rl: RL = field(default_factory=RL)
    online: Online = field(default_factory=Online)
    profile: Profile = field(default_factory=Profile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    debug: Debug = field(default_factory=Debug)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)


# torchtitan sections/fields this trainer reads; anything else must stay at its default.
_USED = {
    "job": {"config_file", "dump_folder", "description", "print_config"},
    "training": {"steps", "max_norm", "mixed_precision_param", "mixed_precision_reduce", "gc_freq"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "bf16_update",
                  "bf16_fused"},
    "lr_scheduler": {"warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "pipeline_parallel_degree", "pipeline_parallel_schedule",
                    "expert_parallel_degree", "expert_tensor_parallel_degree", "context_parallel_degree",
                    "enable_sequence_parallel"},
    "checkpoint": {"enable", "folder", "interval", "keep_latest_k", "load_step", "last_save_model_only",
                   "export_dtype", "initial_load_path", "initial_load_model_only", "async_mode",
                   "exclude_from_loading", "enable_first_step_checkpoint", "export_hf", "load_only",
                   "enable_ft_dataloader_checkpoints", "overwrite"},
    "activation_checkpoint": {"mode"},
    "compile": {"enable", "components", "backend"},
    "metrics": {"log_freq", "enable_tensorboard", "save_tb_folder", "disable_color_printing"},
    "debug": {"seed", "deterministic", "check_finite", "exit_after_step", "dump_hidden", "dump_hidden_stride",
              "dump_grad_norms"},
    "comm": {"init_timeout_seconds", "train_timeout_seconds"},
}
_OURS = {"ling", "harts", "data", "rl", "online", "profile"}


class _Manager(ConfigManager):
    def _validate_config(self) -> None:  # torchtitan's checks concern its tokenizer assets
        pass

    def _dict_to_dataclass(self, cls, data):
        """torchtitan's TOML -> dataclass, with unknown keys named (section, key, nearest known key); its own
        message points at a launcher script this repository does not have."""
        if dataclasses.is_dataclass(cls) and isinstance(data, dict):
            known = [f.name for f in dataclasses.fields(cls)]
            for key in data:
                if key not in known:
                    raise ValueError(f"config: unknown {_toml_where(cls, key)}{did_you_mean(key, known)} in "
                                     f"{self._toml_path or 'the TOML file'}; `python train.py --help` lists every key")
        return super()._dict_to_dataclass(cls, data)

    def parse_args(self, args):
        self._toml_path = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--job.config_file"), None)
        return super().parse_args(args)

    def _maybe_load_toml(self, args):
        """torchtitan's loader logs a traceback before re-raising; this names the file in one line."""
        if self._toml_path is None:
            return super()._maybe_load_toml(args)
        import tomllib

        try:
            with open(self._toml_path, "rb") as f:
                return tomllib.load(f)
        except OSError as e:
            raise ValueError(f"config: cannot read the config file {self._toml_path} ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config: {self._toml_path} is not valid TOML ({e})") from None


def _toml_where(cls, key: str) -> str:
    """'section [x]' for a top-level key, 'key x of [section]' inside one."""
    if cls is HartsJobConfig or issubclass(HartsJobConfig, cls):
        return f"section [{key}]"
    section = next((f.name for f in dataclasses.fields(HartsJobConfig) if f.type is cls
                    or typing.get_type_hints(HartsJobConfig).get(f.name) is cls), None)
    return f"key '{key}' of [{section}]" if section else f"key '{key}'"


def _field_types(cls) -> dict[str, dict[str, typing.Any]]:
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        if dataclasses.is_dataclass(sub):
            out[f.name] = typing.get_type_hints(sub)
    return out


def _normalize(argv: list[str]) -> list[str]:
    """``--config F`` -> ``--job.config_file F``; ``--a.b=true`` -> ``--a.b``; ``--a.b=1,2`` -> ``--a.b 1 2``."""
    types = _field_types(HartsJobConfig)
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config" or a.startswith("--config="):
            if "=" in a:
                out += ["--job.config_file", a.split("=", 1)[1]]
            else:
                if i + 1 >= len(argv):
                    raise SystemExit("--config needs a TOML file")
                out += ["--job.config_file", argv[i + 1]]
                i += 1
            i += 1
            continue
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            _check_cli_key(a.split("=", 1)[0][2:], types)
        if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0]:
            key, val = a[2:].split("=", 1)
            sec, _, name = key.partition(".")
            t = types.get(sec, {}).get(name.replace("-", "_"))
            if t is bool:
                v = val.strip().lower()
                if v not in ("true", "false", "1", "0", "yes", "no"):
                    raise SystemExit(f"--{key}: expected true or false, got {val!r}")
                out.append(f"--{key}" if v in ("true", "1", "yes") else f"--{sec}.no-{name}")
                i += 1
                continue
            if t in (int, float):
                try:
                    t(val)
                except ValueError:
                    raise ValueError(f"config: --{key}={val}: expected {'an integer' if t is int else 'a number'}"
                                     ) from None
            if typing.get_origin(t) is list and "," in val and typing.get_args(t) != (str,):
                # list[str] already takes "a,b" (torchtitan's tyro rule); other lists get one value each
                out += [f"--{key}"] + [x for x in val.split(",") if x]
                i += 1
                continue
        out.append(a)
        i += 1
    return out


def _check_cli_key(key: str, types: dict) -> None:
    """``--section.key``: an unknown section or key is one line naming the nearest known one (tyro's own
    message is a 12-line box)."""
    sec, _, name = key.partition(".")
    if sec not in types:
        raise ValueError(f"config: unknown option --{key}: no section [{sec}]{did_you_mean(sec, types)}")
    name = name.replace("-", "_")
    bare = name[3:] if name.startswith("no_") and types[sec].get(name[3:]) is bool else name
    if bare not in types[sec]:
        dotted = [f"--{sec}.{k}" for k in types[sec]]
        raise ValueError(f"config: unknown option --{key}{did_you_mean(f'--{sec}.{name}', dotted)}; "
                         "`python train.py --help` lists every option")


def validate(cfg: HartsJobConfig) -> HartsJobConfig:
    """Reject settings of torchtitan sections this trainer does not implement, and bad values of ours."""
    default = HartsJobConfig()
    for f in dataclasses.fields(cfg):
        if f.name in _OURS:
            continue
        used = _USED.get(f.name, set())
        cur, ref = getattr(cfg, f.name), getattr(default, f.name)
        for g in dataclasses.fields(cur):
            if g.name not in used and getattr(cur, g.name) != getattr(ref, g.name):
                raise ValueError(f"config: {f.name}.{g.name} = {getattr(cur, g.name)!r} is a torchtitan setting "
                                 "the HARTS trainer does not use; remove it")
    choices = {
        ("data", "source"): ("synthetic", "jsonl"), ("data", "reward"): ("auto", "data", "learnable"),
        ("rl", "objective"): ("grpo", "ppo"), ("rl", "advantages"): ("grpo", "data"),
        ("rl", "old_logprobs"): ("data", "recompute"), ("rl", "loss_norm"): ("token", "sequence"),
        ("ling", "dtype"): ("float32", "float64", "bfloat16"), ("ling", "backend"): ("auto", "reference", "fast"),
        ("activation_checkpoint", "mode"): ("none", "selective", "full"),
        ("optimizer", "bf16_update"): ("fp32_master", "plain"),
    }
    for (sec, name), ok in choices.items():
        v = getattr(getattr(cfg, sec), name)
        if v not in ok:
            raise ValueError(f"config: {sec}.{name} = {v!r}; expected one of {ok}")
    if cfg.data.source == "jsonl" and not cfg.data.path:
        raise ValueError("config: data.source = 'jsonl' needs data.path (one or more JSONL files)")
    if cfg.data.source != "jsonl" and cfg.data.path:
        raise ValueError(f"config: data.path = {cfg.data.path} is set but data.source = {cfg.data.source!r}, which "
                         "ignores it; add --data.source=jsonl to train on the files")
    if cfg.data.source == "synthetic":
        from harts.data.synthetic import PRESETS

        if cfg.data.preset not in PRESETS:
            raise ValueError(f"config: data.preset = {cfg.data.preset!r} is not a synthetic workload preset; "
                             f"known: {', '.join(sorted(PRESETS))}")
    _validate_online(cfg)
    if cfg.training.steps < 1:
        raise ValueError(f"config: training.steps = {cfg.training.steps} must be >= 1")
    if cfg.debug.dump_hidden_stride < 1:
        raise ValueError(f"config: debug.dump_hidden_stride = {cfg.debug.dump_hidden_stride} must be >= 1")
    if cfg.harts.capacity < 1:
        raise ValueError(f"config: harts.capacity = {cfg.harts.capacity} must be >= 1")
    cp = cfg.parallelism.context_parallel_degree
    if cp < 1:
        raise ValueError(f"config: parallelism.context_parallel_degree = {cp} must be >= 1")
    if cp > 1 and not cfg.harts.enabled:
        raise ValueError("config: parallelism.context_parallel_degree > 1 needs harts.enabled = true (context "
                         "parallelism is implemented for HARTS prefix-shared batches, not the trajectory-wise "
                         "baseline)")
    return cfg


def _validate_online(cfg: HartsJobConfig) -> None:
    on = cfg.online
    from harts.rl.tasks import TASKS

    if on.task not in TASKS:
        raise ValueError(f"config: online.task = {on.task!r}; known: {', '.join(sorted(TASKS))}")
    for name in ("episodes", "max_turns"):
        if getattr(on, name) < 1:
            raise ValueError(f"config: online.{name} = {getattr(on, name)} must be >= 1")
    if not on.branching or any(k < 1 for k in on.branching):
        raise ValueError(f"config: online.branching = {on.branching} must be a non-empty list of counts >= 1")
    if not on.temperature >= 0:
        raise ValueError(f"config: online.temperature = {on.temperature} must be >= 0")
    if not 0 < on.top_p <= 1:
        raise ValueError(f"config: online.top_p = {on.top_p} must lie in (0, 1]")
    if not on.enabled:
        return
    if cfg.data.source != "synthetic" or cfg.data.path:
        raise ValueError(f"config: online.enabled = true samples its own rollouts, but data.source = "
                         f"{cfg.data.source!r}{' with data.path' if cfg.data.path else ''} is set too; remove it")
    if cfg.data.reward not in ("auto", "data"):
        raise ValueError(f"config: data.reward = {cfg.data.reward!r} would replace the environment's rewards in "
                         "online mode; leave it at 'auto'")
    if cfg.rl.advantages != "grpo":
        raise ValueError("config: online.enabled = true needs rl.advantages = 'grpo' (rollouts carry rewards, not "
                         "advantages)")
    if cfg.rl.kl_coef > 0:
        raise ValueError("config: rl.kl_coef > 0 needs reference log-probs, which online rollouts do not carry")


def parse_args(argv: list[str] | None = None) -> HartsJobConfig:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = _Manager(HartsJobConfig).parse_args(_normalize(argv))
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
