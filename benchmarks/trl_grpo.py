"""One TRL GRPO training step with a long shared prompt, with and without HARTS: ``python -m benchmarks.trl_grpo``.

    python -m benchmarks.trl_grpo --out DIR                    # qwen3.5-8l, bf16, CUDA: prompt 8192, G 8, C 512
    python -m benchmarks.trl_grpo --out DIR --preset ling3-tiny
    python -m benchmarks.trl_grpo --out DIR --device cpu --dtype float32 --preset qwen3.5-debug \\
        --prompt-len 64 --completion-len 8 --num-generations 4 --steps 1 --warmup 0   # smoke run, not a measurement

TRL 1.16's ``GRPOTrainer`` trains one prompt group per step (``per_device_train_batch_size`` = G =
``--num-generations``, gradient accumulation 1): a ``--prompt-len`` prompt of random token ids and G completions
(random ids ending in EOS) of lengths drawn (seeded) between ``--completion-len`` / 2 and ``--completion-len``,
padded as TRL pads them (prompts left, completions right, to the longest). Two runs in one process, each on a model
built from the same seeded init (``benchmarks.common.build_model``: from scratch, no download, the preset's
backends, which on CUDA resolve to the fast kernels; the report lists the choices each run logged), with the same
completions:

- ``trl``: plain ``trl.GRPOTrainer`` on ``harts.integrations.trl.as_hf_model(model)``: TRL's own log-prob path, the
  wrapper's padded forward (each row's attended tokens as one varlen sequence of the model's packed path, so padding
  costs no compute) and TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``: TRL 1.16's GRPO runs the
  backbone and projects only the completion positions, in vocabulary tiles, on CUDA; no [N, L, V] logits; it does
  not pass ``logits_to_keep``, which ``HartsForCausalLM.forward`` also takes, as transformers' models do);
- ``harts``: ``harts.integrations.trl.GRPOTrainer``: the same trainer with the log-prob passes on HARTS's compact
  layout, the G completions sharing the prompt's rows.

Generation is not measured and does not run the model (the wrapper has no KV cache; real training generates with
vLLM): ``_generate_single_turn``, the smallest generation method, returns the fixed completions, so TRL's
tokenization, decoding, rewards (reward = completion length: distinct per completion, nonzero advantages),
advantages, old-policy / reference log-prob passes (when its settings ask for them: with the defaults, on-policy and
``--beta 0``, neither runs), loss, backward, gradient clipping and optimizer step (TRL's default, torch's fused
AdamW, at a constant ``--lr``) all run as in a real step. Activation checkpointing: TRL's default
``gradient_checkpointing=True``, which the wrapper maps to the HARTS model's full policy (every decoder layer
recomputed in backward).

Per step (after ``--warmup`` untimed steps, ``--steps`` timed ones; a TrainerCallback synchronizes the device at
``on_step_begin`` and ``on_step_end``, so a step is generation stub + scoring + loss + backward + optimizer step,
logging excluded): wall seconds, the seconds of TRL's host-side generation step (tokenizing the prompts, the stub,
decoding; inside the step time), peak allocated memory (reset at each step's start; weights, gradients and AdamW
state are in both runs' peaks alike, ``step_peak_over_start_gib`` is what the step adds), kernel loads during the
step (Triton compiles / autotuning, cuDNN plans: a timed step with one says so), TRL's loss, gradient norm and mean
entropy. The losses of the two runs agree to rounding; at on-policy the GRPO loss does not depend on the log-probs
(the ratio is 1), so the gradient norm and entropy are the comparisons that do. Reported: the median of the timed
steps, tokens/s (tokens counted: the G rows' prompt + completion tokens, G x prompt + sum of completion lengths, the
same for both runs), HARTS's speedup (TRL / HARTS median seconds) and memory ratio (HARTS peak / TRL peak), and the
rows: the padded batch (N x L), its attended tokens (what TRL's path computes) and HARTS's compact rows
(``harts.pack_padded`` of the same padded batch), whose ratio is the row compression.

Writes ``DIR/trl_grpo.json``. Needs trl==1.16.0 (``pip install 'harts[trl]'``).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import re
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch

from benchmarks.common import build_model
from benchmarks.output import write_results
from harts.models.family import all_presets

# token ids of the benchmark's word-level tokenizer: 0 pad, 1 bos, 2 eos, 3 unk, "t<i>" is id i >= 4 (the random ids)
PAD_ID, BOS_ID, EOS_ID, UNK_ID, FIRST_ID = 0, 1, 2, 3, 4
RUNS = ("trl", "harts")
TITLES = {"trl": "TRL", "harts": "HARTS"}
TRAINERS = {"trl": "trl.GRPOTrainer on harts.integrations.trl.as_hf_model(model)",
            "harts": "harts.integrations.trl.GRPOTrainer"}
GIB = 2.0 ** 30


@dataclasses.dataclass(frozen=True)
class Workload:
    """One prompt group: the prompt's token ids and the G completions' (fixed, seeded)."""

    prompt: list[int]
    completions: list[list[int]]

    @property
    def tokens(self) -> int:
        """Prompt + completion tokens of the G rows (each row's attended tokens)."""
        return len(self.completions) * len(self.prompt) + sum(len(c) for c in self.completions)


def make_workload(vocab_size: int, prompt_len: int, completion_len: int, G: int, seed: int) -> Workload:
    """A random prompt and G completions of lengths drawn between ``completion_len`` // 2 and ``completion_len``
    (distinct where the range allows): random ids ending in EOS (finished completions). Random ids are in
    [FIRST_ID, vocab_size)."""
    rng = np.random.default_rng(seed)
    lo = max(1, completion_len // 2)
    choices = np.arange(lo, completion_len + 1)
    lengths = rng.choice(choices, size=G, replace=len(choices) < G)
    if len(set(lengths.tolist())) == 1:
        raise ValueError(f"--completion-len {completion_len}: all {G} completions would have length {lengths[0]}, "
                         "so the rewards (completion lengths) have no spread and the advantages are 0; use "
                         "--completion-len >= 2")
    prompt = rng.integers(FIRST_ID, vocab_size, prompt_len).tolist()
    return Workload(prompt=prompt, completions=[rng.integers(FIRST_ID, vocab_size, int(n) - 1).tolist() + [EOS_ID]
                                                for n in lengths])


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over the model's ids: "t<i>" <-> id i >= FIRST_ID (whitespace-separated), no
    special tokens added, so a prompt text tokenizes to exactly its ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the special tokens' words are no substring of a "t<i>" word: transformers matches them anywhere in the text
    special = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
    vocab = {**special, **{f"t{i}": i for i in range(FIRST_ID, vocab_size)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>")


def length_reward(completions, completion_ids, **kwargs) -> list[float]:
    """Reward = completion length: constant per completion, distinct across the group (nonzero advantages)."""
    return [float(len(c)) for c in completion_ids]


class _FixedRollouts:
    """Before a GRPO trainer class: generation returns the workload's completions without running the model, and
    the step's losses, generation seconds and padded log-prob batch are recorded for the report."""

    bench_workload: Workload | None = None

    def bench_reset(self, workload: Workload) -> None:
        self.bench_workload, self.bench_losses, self.bench_generate_s, self.bench_padded = workload, [], [], None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        w = self.bench_workload
        if w is None:
            raise RuntimeError("benchmarks.trl_grpo: bench_reset(workload) was not called before train()")
        if len(prompt_ids) != len(w.completions):
            raise RuntimeError(f"benchmarks.trl_grpo: TRL asked for completions of {len(prompt_ids)} prompts, the "
                               f"workload has one group of {len(w.completions)} (per_device_train_batch_size must "
                               "equal num_generations)")
        if not self.bench_losses:  # first step: the tokenizer must give back the prompt's ids exactly
            for i, ids in enumerate(prompt_ids):
                if list(ids) != w.prompt:
                    raise RuntimeError(f"benchmarks.trl_grpo: prompt {i} tokenized to {len(ids)} ids, not the "
                                       f"workload's {len(w.prompt)} (the word-level tokenizer added or changed ids)")
        return [list(c) for c in w.completions], None

    def _generate(self, prompts):
        t0 = time.perf_counter()
        out = super()._generate(prompts)
        self.bench_generate_s.append(time.perf_counter() - t0)
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self.bench_padded is None:  # references only (no copy, no device sync inside the step)
            self.bench_padded = (input_ids.detach(), attention_mask.detach(), int(logits_to_keep))
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                          **kwargs)

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.bench_losses.append(loss.detach())
        return loss


class _FrozenReference:
    """Before plain ``trl.GRPOTrainer``: with beta != 0 the reference model is a frozen copy of the initial HARTS
    model (what ``harts.integrations.trl.GRPOTrainer`` makes; TRL itself would load one from a hub id), with
    TRL's fused LM head as TRL gives its reference model."""

    def __init__(self, model, reward_funcs=None, args=None, **kwargs):
        from trl.trainer.utils import add_fused_lm_head

        from harts.integrations import trl as htrl

        beta = args.beta
        args.beta = 0.0
        try:
            super().__init__(model, reward_funcs, args=args, **kwargs)
        finally:
            args.beta = beta
        self.beta = beta
        if beta != 0.0:
            ref = htrl.frozen_copy(self.accelerator.unwrap_model(self.model))
            add_fused_lm_head(ref, temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
            self.ref_model = self.accelerator.prepare_model(ref, evaluation_mode=True)


def trainer_class(run: str):
    import trl

    from harts.integrations import trl as htrl

    if run == "trl":
        return type("BenchTRLGRPOTrainer", (_FixedRollouts, _FrozenReference, trl.GRPOTrainer), {})
    return type("BenchHartsGRPOTrainer", (_FixedRollouts, htrl.GRPOTrainer), {})


class BackendLog(logging.Handler):
    """The op-backend and kernel choices ``harts.ops.backend`` logs during a run (``reset_log`` at the run's start,
    so each run lists its own choices)."""

    _CHOICE = re.compile(r"^harts backend (\S+) -> (\S+) \((.*)\)$")

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def choices(self) -> dict:
        """op -> "choice (reason)", and the kernel lines (attention kernel, MLA views) under their own text."""
        out = {}
        for m in self.messages:
            hit = self._CHOICE.match(m)
            if hit:
                out[hit.group(1)] = f"{hit.group(2)} ({hit.group(3)})"
            else:
                name, _, rest = m.removeprefix("harts ").partition(" -> ")
                out[name] = rest
        return out

    def __enter__(self):
        from harts.ops import backend

        backend.reset_log()
        self.logger = logging.getLogger("harts.ops.backend")
        self.level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def _step_clock(run: str, trainer, dev: torch.device, warmup: int, total: int, loads):
    """A TrainerCallback timing each step from ``on_step_begin`` to ``on_step_end`` (device synchronized at both),
    with its peak memory, kernel loads and loss; ``on_log`` adds TRL's logged metrics of the step."""
    from transformers import TrainerCallback

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_step_begin(self, args, state, control, **kw):
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                self.start_b = torch.cuda.memory_allocated()
            self.loads0 = loads.n
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            dt = time.perf_counter() - self.t0
            k = len(self.steps) + 1
            rec = {"step": k, "timed": k > warmup, "s": dt, "kernel_loads": loads.n - self.loads0,
                   "loss": float(trainer.bench_losses[-1]), "generate_s": trainer.bench_generate_s[-1]}
            if cuda:
                peak = torch.cuda.max_memory_allocated()
                rec.update(peak_gib=peak / GIB, over_start_gib=(peak - self.start_b) / GIB)
            self.steps.append(rec)
            mem = f", peak {rec['peak_gib']:.2f} GiB" if cuda else ""
            loads_note = f", {rec['kernel_loads']} kernel loads" if rec["kernel_loads"] else ""
            print(f"  {TITLES[run]} step {k}/{total} ({'timed' if rec['timed'] else 'warm-up'}): {dt:.3f} s, "
                  f"loss {rec['loss']:+.6f}{mem}{loads_note}", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs and self.steps and "logged" not in self.steps[-1]:
                self.steps[-1]["logged"] = {k: v for k, v in logs.items() if isinstance(v, (int, float))}

    return StepClock()


def param_checksum(model) -> float:
    """Sum of every parameter (float64): equal for the two runs when they start from the same init."""
    with torch.no_grad():
        return float(sum(p.detach().sum(dtype=torch.float64) for p in model.parameters()))


def run_one(run: str, args, dev: torch.device, dtype: torch.dtype, workload: Workload, tokenizer, loads):
    """One trainer's ``train()`` of warm-up + timed steps on a freshly built model: (the run's record, the padded
    log-prob batch TRL built (input ids [N, L], attention mask [N, L], logits_to_keep) on the CPU, model config)."""
    import datasets
    import trl
    from transformers import PrinterCallback, ProgressCallback

    from harts.integrations import trl as htrl

    print(f"{TITLES[run]}: building {args.preset} ({args.dtype}, seed {args.seed}) on {dev}", flush=True)
    model = build_model(args.preset, dev, dtype, args.seed, recompute=False)
    cfg = model.config
    checksum = param_checksum(model)
    total = args.warmup + args.steps
    text = " ".join(f"t{i}" for i in workload.prompt)
    dataset = datasets.Dataset.from_dict({"prompt": [text] * total})
    G = len(workload.completions)
    mixed_bf16 = dtype == torch.bfloat16 and args.autocast
    with tempfile.TemporaryDirectory() as tmp, BackendLog() as blog:
        config = trl.GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=G, num_generations=G, gradient_accumulation_steps=1,
            max_completion_length=max(len(c) for c in workload.completions), max_steps=total, beta=args.beta,
            learning_rate=args.lr, lr_scheduler_type="constant", bf16=mixed_bf16, fp16=False, use_cpu=dev.type == "cpu",
            report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0, disable_tqdm=True,
            seed=args.seed)
        hf = model if run == "harts" else htrl.as_hf_model(model, eos_token_id=tokenizer.eos_token_id,
                                                            pad_token_id=tokenizer.pad_token_id)
        trainer = trainer_class(run)(hf, reward_funcs=length_reward, args=config, train_dataset=dataset,
                                     processing_class=tokenizer)
        trainer.bench_reset(workload)
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        clock = _step_clock(run, trainer, dev, args.warmup, total, loads)
        trainer.add_callback(clock)
        print(f"{TITLES[run]}: {TRAINERS[run]}, {total} steps ({args.warmup} warm-up)", flush=True)
        trainer.train()
        policy = trainer.accelerator.unwrap_model(trainer.model).harts.model.checkpoint_policy
        ids_NL, am_NL, K = trainer.bench_padded
        padded = (ids_NL.cpu(), am_NL.cpu(), K)
        backends = blog.choices()
        messages = list(blog.messages)
        trainer.accelerator.free_memory()
    del trainer, hf, model
    steps = clock.steps
    timed = [s for s in steps if s["timed"]]
    med = statistics.median(s["s"] for s in timed)
    out = {
        "trainer": TRAINERS[run],
        "step_s": [s["s"] for s in timed], "step_s_median": med, "warmup_s": [s["s"] for s in steps if not s["timed"]],
        "tokens_per_s": workload.tokens / med,
        "generate_s_median": statistics.median(s["generate_s"] for s in timed),
        "losses": [s["loss"] for s in steps],
        "grad_norms": [s.get("logged", {}).get("grad_norm") for s in steps],
        "entropies": [s.get("logged", {}).get("entropy") for s in steps],
        "kernel_loads_timed": sum(s["kernel_loads"] for s in timed),
        "param_checksum": checksum,
        "activation_checkpointing": f"{policy} (TRL gradient_checkpointing=True)",
        "trl_bf16_autocast": mixed_bf16,
        "backends_requested": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                               if f.name.endswith("backend") and getattr(cfg, f.name) is not None},
        "backends": backends, "backend_log": messages, "steps": steps,
    }
    if dev.type == "cuda":
        out["peak_gib"] = max(s["peak_gib"] for s in timed)
        out["step_peak_over_start_gib"] = max(s["over_start_gib"] for s in timed)
    return out, padded, cfg


def row_counts(padded, cfg) -> dict:
    """The padded log-prob batch TRL built (N x L) against HARTS's compact rows of the same batch."""
    import harts

    ids_NL, am_NL, K = padded
    N, L = ids_NL.shape
    cm_NL = am_NL.clone()
    cm_NL[:, :L - K] = 0  # the completion columns, as the HARTS trainer scores them
    batch, _ = harts.pack_padded(ids_NL, am_NL, completion_mask=cm_NL, config=cfg)
    attended = int(am_NL.sum())
    return {"padded_rows": N, "padded_width": L, "padded_tokens": N * L, "attended_tokens": attended,
            "compact_rows": int(batch.num_rows), "replay_rows": int(batch.stats["replay_tokens"]),
            "row_compression": attended / batch.num_rows, "padded_compression": N * L / batch.num_rows}


def _max_rel(a: list, b: list) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not pairs:
        return None
    return max(abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in pairs)


def _fmt_list(xs, spec: str) -> str:
    return ", ".join("-" if x is None else format(x, spec) for x in xs)


def print_table(res: dict) -> None:
    r = res["rows"]
    lens = res["completion_lengths"]
    print(f"\nTRL {res['trl']} GRPO step: {res['preset']} {res['dtype']} on {res['device']}, prompt "
          f"{res['prompt_len']}, G {res['G']}, completions {min(lens)}..{max(lens)} (mean {statistics.mean(lens):.1f})")
    print(f"tokens per step {res['tokens_per_step']:,} ({res['tokens_counted']}); padded batch {r['padded_rows']} x "
          f"{r['padded_width']} = {r['padded_tokens']:,}; HARTS compact rows {r['compact_rows']:,} (replay "
          f"{r['replay_rows']:,}): row compression {r['row_compression']:.2f}x")
    cuda = res["device"] != "cpu"
    print(f"{'run':<7}{'step s':>10}{'tokens/s':>12}{'peak GiB':>10}{'gen s':>8}  losses / grad norms / entropies")
    for run, rec in res["runs"].items():
        if "error" in rec:
            print(f"{TITLES[run]:<7}  {rec['error']}")
            continue
        peak = f"{rec['peak_gib']:>10.2f}" if cuda else f"{'-':>10}"
        print(f"{TITLES[run]:<7}{rec['step_s_median']:>10.3f}{rec['tokens_per_s']:>12,.0f}{peak}"
              f"{rec['generate_s_median']:>8.3f}  [{_fmt_list(rec['losses'], '+.6f')}] / "
              f"[{_fmt_list(rec['grad_norms'], '.5g')}] / [{_fmt_list(rec['entropies'], '.6g')}]")
        if rec["kernel_loads_timed"]:
            print(f"{'':<7}  {rec['kernel_loads_timed']} kernel loads during timed steps: raise --warmup")
    if res.get("speedup") is not None:
        mem = f", memory ratio (HARTS / TRL peak) {res['memory_ratio']:.3f}" if res.get("memory_ratio") else ""
        print(f"HARTS speedup {res['speedup']:.2f}x{mem}; max relative difference loss "
              f"{res['agreement']['loss']:.1e}, grad norm {_fmt_list([res['agreement']['grad_norm']], '.1e')}, "
              f"entropy {_fmt_list([res['agreement']['entropy']], '.1e')}")
    for run, rec in res["runs"].items():
        if "backends" in rec:
            print(f"{TITLES[run]} backends: " + "; ".join(f"{k} {v}" for k, v in rec["backends"].items()))
            print(f"{TITLES[run]} activation checkpointing: {rec['activation_checkpointing']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trl_grpo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-8l",
                    help=f"model preset (harts.models.family): {', '.join(all_presets())}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float64"), help="model dtype")
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                    help="with --dtype bfloat16: TRL's bf16=True (accelerate's bf16 autocast around the forwards, "
                         "TRL's default); --no-autocast: bf16=False, the bf16 model as it is")
    ap.add_argument("--seed", type=int, default=0, help="model init, prompt and completions")
    ap.add_argument("--prompt-len", type=int, default=8192, help="prompt tokens (random ids)")
    ap.add_argument("--completion-len", type=int, default=512,
                    help="longest completion; lengths are drawn between half of it and it")
    ap.add_argument("--num-generations", type=int, default=8, help="G: completions of the prompt (one group/step)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (kernel compiles, autotuning)")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (!= 0 adds the reference pass)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (TRL's default)")
    ap.add_argument("--runs", default="trl,harts", help="comma-separated runs, in order: trl, harts")
    ap.add_argument("--out", default="out/bench_trl_grpo")
    args = ap.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in RUNS for r in runs) or len(set(runs)) != len(runs):
        ap.error(f"--runs {args.runs!r}: a comma-separated subset of {', '.join(RUNS)}")
    for name, v, lo in (("--prompt-len", args.prompt_len, 1), ("--completion-len", args.completion_len, 2),
                        ("--num-generations", args.num_generations, 2), ("--steps", args.steps, 1),
                        ("--warmup", args.warmup, 0)):
        if v < lo:
            ap.error(f"{name} {v}: must be >= {lo}")
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if dev.type not in ("cuda", "cpu"):
        ap.error(f"--device {args.device}: cuda or cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu --dtype float32 with a debug preset")
    try:
        import trl
    except ImportError as e:
        raise SystemExit(f"benchmarks.trl_grpo needs trl: pip install 'harts[trl]' (trl==1.16.0) ({e})") from None
    import accelerate
    import transformers

    from benchmarks.speedup import KernelLoads
    from harts.models.family import model_config

    vocab = model_config(args.preset).vocab_size
    if vocab <= FIRST_ID:
        ap.error(f"--preset {args.preset}: vocabulary of {vocab} ids leaves none for random tokens")
    workload = make_workload(vocab, args.prompt_len, args.completion_len, args.num_generations, args.seed)
    tokenizer = word_tokenizer(vocab)
    loads = KernelLoads()
    G = args.num_generations
    lens = [len(c) for c in workload.completions]
    print(f"workload: prompt {args.prompt_len} tokens, G {G}, completion lengths {lens}; {workload.tokens:,} tokens "
          f"per step", flush=True)

    res = {
        "benchmark": "trl_grpo", "args": vars(args), "preset": args.preset, "dtype": args.dtype,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "prompt_len": args.prompt_len, "G": G, "completion_len": args.completion_len, "completion_lengths": lens,
        "tokens_per_step": workload.tokens,
        "tokens_counted": "G x prompt + completion tokens: the attended tokens of the G rows",
        "runs": {},
    }
    try:
        from trl.kernels.chunked_logprob import _use_triton

        how = "triton, completion positions only" if _use_triton(dev) else "torch, every position"
        res["trl_lm_head"] = f"TRL fused chunked log-probs ({how})"
    except ImportError:
        pass
    padded = cfg = None
    checks = res["checks"] = {}
    with warnings.catch_warnings():  # transformers 5.2x's renames (gradient -> activation checkpointing)
        warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6", category=FutureWarning)
        for run in runs:
            try:
                rec, p, c = run_one(run, args, dev, dtype, workload, tokenizer, loads)
                if padded is None:
                    padded, cfg = p, c
                checks[f"{run}_padded_batch_as_first_run"] = bool(p[0].shape == padded[0].shape
                                                                  and torch.equal(p[0], padded[0])
                                                                  and torch.equal(p[1], padded[1]))
            except torch.cuda.OutOfMemoryError as e:  # reported, the other run still runs
                rec = {"error": f"CUDA out of memory: {str(e).splitlines()[0]}"}
                print(f"{TITLES[run]}: {rec['error']}", flush=True)
            res["runs"][run] = rec
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if padded is not None:
        res["rows"] = row_counts(padded, cfg)
        res["row_compression"] = res["rows"]["row_compression"]
        checks["attended_tokens_are_workload_tokens"] = res["rows"]["attended_tokens"] == workload.tokens
    ok = {r: v for r, v in res["runs"].items() if "error" not in v}
    if len(ok) == 2:
        t, h = ok["trl"], ok["harts"]
        checks["same_init"] = t["param_checksum"] == h["param_checksum"]
        res["speedup"] = t["step_s_median"] / h["step_s_median"]
        if "peak_gib" in t:
            res["memory_ratio"] = h["peak_gib"] / t["peak_gib"]
            res["memory_ratio_is"] = "HARTS peak / TRL peak (max_memory_allocated over the timed steps)"
        res["agreement"] = {k: _max_rel(t[f], h[f]) for k, f in
                            (("loss", "losses"), ("grad_norm", "grad_norms"), ("entropy", "entropies"))}
    write_results(args.out, "trl_grpo", res)
    if "rows" in res:
        print_table(res)
    failed = sorted(k for k, v in checks.items() if not v)
    if failed:
        print(f"CHECKS FAILED: {', '.join(failed)} (the runs did not see the same model or batch)")
    print(f"wrote {args.out}/trl_grpo.json")
    return 0 if len(ok) == len(runs) and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
