"""The standard benchmark set in one command.

    python -m benchmarks.suite --out DIR                 # on one GPU: the full set
    python -m benchmarks.suite --out DIR --cpu-smoke     # on CPU: every benchmark at toy size (CI)
    python -m benchmarks.suite --out DIR --only model,kernels

Each benchmark runs its own module (``benchmarks.<name>``) with the arguments listed in ``BENCHMARKS``;
its raw output goes to ``DIR/raw/<name>/`` and the suite writes ``DIR/<name>.json``: one record with
``benchmark``, ``date``, ``commit``, ``device``, ``command`` (the exact module command line, which reruns
it), ``values`` (the headline numbers, named with units) and ``raw`` (the module's whole JSON). PNGs the
module draws are copied to ``DIR/<name>*.png``. ``python -m benchmarks.results`` turns such records,
committed under ``benchmarks/results/``, into ``benchmarks/RESULTS.md``.

``--cpu-smoke`` runs the same code paths at toy sizes on CPU (debug model, float32, the Triton
interpreter for the log-probs kernel) so the suite cannot rot between GPU runs. Its numbers mean
nothing and its records say ``"smoke": true``; the results generator refuses them.

A benchmark that fails is recorded with ``"error"`` (the traceback's tail) and the suite exits 1 after
running the rest: nothing is dropped silently.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import importlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import traceback

# name -> (title, GPU arguments, CPU smoke arguments). "{raw}" is the benchmark's raw output folder.
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "model": (
        "Ling-3.0-tiny trajectory-wise training step (MFU)",
        ["--out", "{raw}"],
        ["--out", "{raw}", "--device", "cpu", "--dtype", "float32", "--preset", "ling3-tiny-debug", "--tokens", "96",
         "--lens", "uniform:24:48", "--iters", "1", "--warmup", "1", "--no-profile"],
    ),
    "kernels": (
        "HARTS kernels against fla and against expanding the rows",
        ["--out", "{raw}"],
        ["--out", "{raw}", "--device", "cpu", "--quick", "--only", "logprobs"],
    ),
    "speedup": (
        "HARTS against trajectory-wise training, forward + backward per microbatch",
        ["--out", "{raw}", "--preset", "ling3-tiny", "--scale", "0.2", "--microbatches", "16"],
        ["--out", "{raw}", "--preset", "ling3-tiny-debug", "--workload", "tiny", "--capacity", "128",
         "--microbatches", "2", "--device", "cpu", "--dtype", "float32"],
    ),
    "fidelity": (
        "Log-prob fidelity of HARTS against trajectory-wise execution",
        ["--out", "{raw}", "--preset", "ling3-tiny", "--scale", "0.05"],
        ["--out", "{raw}", "--preset", "ling3-tiny-debug", "--workload", "tiny", "--device", "cpu", "--dtype",
         "float32", "--scale", "1"],
    ),
    "planner": (
        "Microbatch / DP / slot planner against OR-Tools and simple packers",
        ["--json", "{raw}/planner.json", "--png", "{raw}/planner.png", "--preset", "swe-step", "--steps", "10",
         "--dp", "4", "2", "--capacity", "65536"],
        ["--json", "{raw}/planner.json", "--preset", "swe-small", "--steps", "1", "--dp", "2", "--capacity", "2048",
         "--repeat", "1"],
    ),
    "calls": (
        "Minimum-call KDA planner",
        ["--out", "{raw}"],
        ["--out", "{raw}", "--max-segments", "1000", "--repeats", "1", "--swe-scale", "0.01"],
    ),
}


def git_commit() -> str:
    """HEAD's hash, with ``+dirty`` when tracked files differ from it; ``unknown`` outside a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def device_name(cpu: bool) -> str:
    import torch

    if not cpu and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"cpu {platform.machine()} x{os.cpu_count()} (torch {torch.__version__})"


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def headline(name: str, raw: dict) -> dict:
    """The numbers a reader looks for, named with their units, from a benchmark's raw JSON."""
    v: dict = {}
    if name == "model":
        r = raw.get("result") or {}
        for key, label, scale in (("step_s_median", "step s (median)", 1), ("tokens_per_s", "tokens/s", 1),
                                  ("mfu", "MFU %", 100), ("hfu", "HFU %", 100), ("peak_mem_gib", "peak GiB", 1),
                                  ("tokens", "tokens", 1), ("params_total", "parameters", 1),
                                  ("params_active", "active parameters", 1)):
            if r.get(key) is not None:
                v[label] = r[key] * scale
    elif name == "kernels":
        for row in raw.get("kda", []):
            v[f"KDA {row['layout']}: fla chunk_kda fwd+bwd ms"] = row["fla_fwd_bwd_ms"]
            v[f"KDA {row['layout']}: round / fla, no requests"] = row["ratio_no_req"]
            v[f"KDA {row['layout']}: round / fla, 1 request per 4 chunks"] = row["ratio"]
        for row in raw.get("logprobs", []):
            v["log-probs: compact fwd+bwd ms"] = row["ours_fwd_bwd_ms"]
            v["log-probs: expand + log_softmax fwd+bwd ms"] = row["expand_fwd_bwd_ms"]
            v["log-probs: speedup"] = row["speedup"]
            if row.get("peak_extra_bytes") is not None:
                v["log-probs: peak extra GB"] = row["peak_extra_bytes"] / 1e9
        for row in raw.get("moe_gather", []):
            v[f"MoE {row['what']}: kernel / Inductor ms"] = f"{row['kernel_ms']:.3f} / {row['inductor_ms']:.3f}"
            v[f"MoE {row['what']}: kernel TB/s"] = row["kernel_TBps"]
        for row in raw.get("attention", []):
            v[f"attention {row['heads']}: cuDNN / flash fwd+bwd"] = row["cudnn_over_flash_fwd_bwd"]
    elif name == "speedup":
        for key, label in (("microbatches_timed", "microbatches timed"), ("raw_rows", "raw rows"),
                           ("compact_rows", "compact rows"), ("compression", "row compression"),
                           ("flop_compression", "FLOP compression"), ("fbgrad_baseline_s", "F/B/Grad baseline s"),
                           ("fbgrad_harts_s", "F/B/Grad HARTS s"), ("speedup_fbgrad", "F/B/Grad speedup"),
                           ("fbgrad_over_compression", "F/B/Grad speedup / row compression"),
                           ("fbgrad_over_flop_compression", "F/B/Grad speedup / FLOP compression"),
                           ("speedup_core", "Core speedup"),
                           ("core_over_compression", "Core speedup / row compression"),
                           ("baseline_peak_gb", "peak GB baseline"), ("harts_peak_gb", "peak GB HARTS")):
            if raw.get(key) is not None:
                v[label] = raw[key]
    elif name == "fidelity":
        for run, cos in (raw.get("mean_token_cosine") or {}).items():
            v[f"mean token cosine vs baseline A: {run}"] = cos
    elif name == "planner":
        for dp, res in (raw.get("results") or {}).items():
            for planner, s in res["summary"].items():
                v[f"{dp} {planner}: compact rows"] = s["compact"]
                v[f"{dp} {planner}: slots"] = s["slots"]
                v[f"{dp} {planner}: seconds (all steps)"] = s["seconds"]
    elif name == "calls":
        for row in raw.get("scaling", []):
            if row["segments"] == max(r["segments"] for r in raw["scaling"]):
                v[f"plan s, {row['segments']:,} segments, {row['shape']}"] = row["plan_s"]
        swe = raw.get("swe_step")
        if swe:
            v["SWE step: packed KDA calls"] = swe["num_calls"]
            v["SWE step: replay tokens"] = swe["replay_tokens"]
            v["SWE step: compact rows"] = swe["C"]
    return v


def run_one(name: str, out: str, cpu: bool) -> dict:
    title, gpu_args, cpu_args = BENCHMARKS[name]
    raw_dir = os.path.join(out, "raw", name)
    if os.path.isdir(raw_dir):
        shutil.rmtree(raw_dir)
    os.makedirs(raw_dir)
    argv = [a.replace("{raw}", raw_dir) for a in (cpu_args if cpu else gpu_args)]
    module = f"benchmarks.{name}"
    rec = {"benchmark": name, "title": title,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "commit": git_commit(), "device": device_name(cpu),
           "command": " ".join(["python", "-m", module] + [shlex.quote(a) for a in argv]),
           "smoke": cpu}
    t0 = time.time()
    try:
        rc = importlib.import_module(module).main(argv)
    except SystemExit as e:  # the modules' own refusals (no GPU, bad arguments)
        rc = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int) and e.code is not None:
            rec["error"] = str(e.code)
    except Exception:
        rc = 1
        rec["error"] = traceback.format_exc()[-4000:]
    rec["wall_s"] = round(time.time() - t0, 3)
    if rc not in (0, None):
        rec.setdefault("error", f"{module} exited with status {rc}")
    raws = sorted(glob.glob(os.path.join(raw_dir, "*.json")))
    if len(raws) == 1:
        with open(raws[0]) as f:
            rec["raw"] = json.load(f)
        rec["values"] = headline(name, rec["raw"])
    elif "error" not in rec:
        rec["error"] = f"{module} wrote {len(raws)} JSON files to {raw_dir}, expected one"
    for png in sorted(glob.glob(os.path.join(raw_dir, "*.png"))):
        base = os.path.basename(png)
        shutil.copy(png, os.path.join(out, base if base.startswith(name) else f"{name}_{base}"))
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(rec, f, indent=1, default=str)
        f.write("\n")
    return rec


def parse_only(text: str | None) -> list[str]:
    if not text:
        return list(BENCHMARKS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for NAME.json records, PNGs and raw/ outputs")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU: checks the code, measures nothing")
    ap.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(BENCHMARKS))
    args = ap.parse_args(argv)
    names = parse_only(args.only)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported
    os.makedirs(args.out, exist_ok=True)
    failed = []
    for name in names:
        print(f"\n######## {name}: {BENCHMARKS[name][0]}", flush=True)
        rec = run_one(name, args.out, args.cpu_smoke)
        if "error" in rec:
            failed.append(name)
            print(f"[suite] {name} failed: {rec['error'][-500:]}", flush=True)
    print(f"\n[suite] wrote {len(names)} records to {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
