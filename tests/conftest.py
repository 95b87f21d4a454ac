"""Test configuration.

Markers (pyproject.toml): ``gpu`` tests need a CUDA GPU and are deselected by the default ``-m 'not gpu'``;
``gpu_bench`` tests run a benchmark's numerics checks at model shapes on a CUDA GPU (minutes of kernel
compilation from empty caches, so ``python -m pytest -m gpu_bench`` runs them apart from the GPU suite);
``python -m pytest -m gpu`` on a machine without CUDA is an error (exit code 4, one message), never a run
of skips that looks green. ``slow`` marks the multi-process and multi-step tests; the default run, and CI,
include them (``-m 'not slow'`` for a quick local pass). The whole suite (no test paths given) runs its files
in one process per core, at most 4, with pytest-xdist (``-n 0``: one process); named files or tests run in one.

On a machine without CUDA, Triton kernels (fla's and ours) run under the Triton interpreter in
float32. TRITON_INTERPRET is read when ``@triton.jit`` is applied, so it is set here, before anything
imports fla or harts.kernels. Three shims make fla 0.6.0's kernels interpreter-safe, all defined below:
(1) autotune benchmarking needs a GPU driver, so no config is timed: an autotuned fla kernel takes the config
that launches the fewest programs (the interpreter runs programs one by one, so that is its fastest), every
other autotuned kernel (ours) and every tie takes the first (pruned) config;
(2) interpreter loop variables are Python ints where fla calls ``.to()`` on them, so ``range`` loop
variables are turned into interpreter tensors; (3) Triton 3.6's interpreter (torch 2.11's Triton) converts a
scalar to an index with ``int()`` of its one-element 1-d array, which NumPy >= 2.4 refuses, so a ``range``
bounded by a program id fails there; the index takes the array's single element, as Triton 3.7 does. Our
own kernels do not need the shims.
"""
import os

# One intra-op thread (here and, through the environment, in every process a test starts), unless the caller
# sets OMP_NUM_THREADS: the tests' shapes are tiny, so extra threads only spin; on 2 cores a float64 trainer
# run took 3.5x the CPU time with 2 threads as with 1, and the multi-process tests run one process per core.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    import ast
    import math

    from triton.runtime import autotuner, interpreter

    # (1) no GPU driver -> no benchmarker. A config's "time" is the number of programs it launches, for fla's
    # kernels only: the interpreter executes programs one after another in Python, so that is what its time
    # scales with (e.g. fla's token-parallel KDA intra kernel: one program per token and head with BH = 1,
    # per token with BH = HV), and every candidate is one a GPU's autotuner may pick (the kernel's own code at
    # other block sizes). Our kernels (harts/kernels) keep their first config, whose small blocks the kernel
    # tests rely on; ties keep the first config too (the autotuner takes the first minimum).
    def _bench_by_programs(self, *args, config, **meta):
        grid = meta.get("grid")
        if grid is None or not getattr(self.base_fn, "__module__", "").startswith("fla."):
            return [0.0, 0.0, 0.0]
        if callable(grid):
            grid = grid({**dict(zip(self.arg_names, args)), **meta, **config.all_kwargs()})
        n = float(math.prod(grid))
        return [n, n, n]

    autotuner.Autotuner._bench = _bench_by_programs

    # (2) loop variables of range()/tl.range() are tensors when compiled, Python ints when interpreted.
    class _LoopVarToTensor(interpreter.ASTTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            f = node.iter.func if isinstance(node.iter, ast.Call) else None
            if (getattr(f, "id", None) or getattr(f, "attr", None)) == "range" and isinstance(node.target, ast.Name):
                node.body.insert(
                    0,
                    ast.parse(f"{node.target.id} = interpreter_semantic.to_tensor({node.target.id}, False)").body[0],
                )
            return node

    interpreter.FunctionRewriter.ast_transformer = _LoopVarToTensor()

    # (3) int() of a one-element 1-d array: an error from NumPy 2.4 on; Triton 3.7 squeezes it first.
    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = _patch_lang_tensor_index

import pytest  # noqa: E402


def _gpu_run(config) -> bool:
    expr = config.option.markexpr or ""
    return "gpu" in expr and "not gpu" not in expr


# Test processes of a GPU run: from empty caches the suite's time is Triton compiling kernels (one CPU core per
# kernel, minutes in all), so files run in parallel processes that share the one GPU (the tests are small).
GPU_RUN_WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))
# Test processes of a whole run without GPU tests (no test paths given, e.g. CI's ``python -m pytest``): each
# test runs on one intra-op thread (above), so one process keeps one core busy outside the multi-process tests;
# one process per core, at most 4 (memory: the distributed tests fork up to eight ranks of their own).
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
CPU_RUN_WORKERS = max(1, min(4, _CORES))


def _whole_suite(config) -> bool:
    """No test paths on the command line: the run collects the configured test paths (or the directory)."""
    source = getattr(config, "args_source", None)
    return source is not None and source != pytest.Config.ArgsSource.ARGS


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns -n into its worker list
def pytest_cmdline_main(config):
    """With pytest-xdist (the ``test`` extra) and neither ``-n`` nor ``--dist`` given, files run in parallel
    processes (``--dist loadfile``: a file's module fixtures are built once, in one process): a GPU run
    (``-m gpu``, ``-m gpu_bench``) on a CUDA machine in ``GPU_RUN_WORKERS``, any other run of the whole suite
    (the default ``-m``: every test but the GPU ones) in ``CPU_RUN_WORKERS``. A run of named files or tests
    stays in one process; ``-n 0`` keeps any run in one."""
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or config.option.numprocesses is not None or config.option.dist != "no"
            or config.getvalue("collectonly")):
        return
    if _gpu_run(config):
        workers = GPU_RUN_WORKERS if torch.cuda.is_available() else 0
    else:
        workers = CPU_RUN_WORKERS if _whole_suite(config) else 0
    if workers > 1:
        config.option.numprocesses = workers
        config.option.dist = "loadfile"


def pytest_configure(config):
    """A GPU run names each test as it ends with its outcome (-v), and ``--durations`` lists the slowest:
    compiling kernels from empty caches can keep one test busy for a while."""
    if _gpu_run(config):
        config.option.verbose = max(config.option.verbose, 1)
        if config.option.durations is None:
            config.option.durations = 10


@pytest.hookimpl(trylast=True)  # after the -m deselection: only the tests that would run
def pytest_collection_modifyitems(config, items):
    """A selection that still holds ``gpu`` tests on a machine without CUDA stops the run with one error."""
    if torch.cuda.is_available():
        return
    gpu = [item.nodeid for item in items
           if item.get_closest_marker("gpu") is not None or item.get_closest_marker("gpu_bench") is not None]
    if gpu:
        raise pytest.UsageError(
            f"{len(gpu)} selected test(s) marked gpu (first: {gpu[0]}), and CUDA is not available: run them on a "
            "CUDA machine, or deselect them with -m 'not gpu' (the default).")


@pytest.fixture
def fla_interpreter_patches(monkeypatch):
    """fla 0.6.0's safe-gate KDA kernels under the Triton interpreter: the interpreter has no ``tl.gather``
    and rejects the 'bf16x3' dot precision, so take fla's own non-gather branch and 'ieee' dots (the
    compiled GPU kernels are unaffected; this only lets CPU CI execute the same kernel code)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import fla.ops.kda.chunk_intra as chunk_intra
    import triton.language as tl

    monkeypatch.setattr(chunk_intra, "IS_GATHER_SUPPORTED", False)
    monkeypatch.setattr(chunk_intra, "SAFE_GATE_DOT_PRECISION", tl.constexpr("ieee"))


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    """Each test compiles from a clean Dynamo cache. The compiled regions are shared functions whose code
    cache holds one entry per (dtype, grad mode, backend, model constants); one process that runs every
    compile test in turn would otherwise pass Dynamo's per-function recompile limit (8), which no single
    training run comes near (tests/test_compile.py bounds a run's compilations)."""
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
