"""Environment variables read once (``harts.env``), kernel variants chosen in code (``harts.ops.choices``), and
fla imported behind one version check (``harts.ops._fla``). CPU only; nothing is timed."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import harts.ops
from harts.env import read
from harts.ops import KernelChoices, kernel_choices, set_kernel_choices, tuning, use_kernel_choices
from harts.ops.attention.fast import CUDNN_MIN_MEAN_LEN, packed_self_attention_impl
from harts.ops.attention.tree import view_attention_impl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHOICE_VARS = ("HARTS_VIEW_ATTENTION", "HARTS_PACKED_ATTENTION", "HARTS_AUTOTUNE")


@pytest.fixture(autouse=True)
def _restore_choices():
    before = kernel_choices()
    yield
    set_kernel_choices(before)


def _long_packed():
    """Packed rows long enough per sequence that only the kernel choice (and the device) decides."""
    return torch.zeros(2 * CUDNN_MIN_MEAN_LEN, 2, 8)


def test_defaults_are_the_default_kernels():
    assert KernelChoices() == KernelChoices("cudnn_split", "cudnn", "table", "auto", "harts")
    assert read({}) == read({"UNRELATED": "1"})
    assert (read({}).view_attention, read({}).packed_attention, read({}).autotune, read({}).conv, read({}).swiglu) == \
        ("cudnn_split", "cudnn", "table", "auto", "harts")


@pytest.mark.parametrize("field,bad", [("view_attention", "flash"), ("packed_attention", "sdpa"),
                                       ("autotune", "sometimes"), ("conv", "cuda"),
                                       ("swiglu", "inductor")])
def test_invalid_choice_names_the_value_and_the_allowed_ones(field, bad):
    before = kernel_choices()
    allowed = harts.ops.choices.ALLOWED[field]
    for make in (lambda: KernelChoices(**{field: bad}), lambda: set_kernel_choices(**{field: bad}),
                 lambda: use_kernel_choices(**{field: bad}).__enter__()):
        with pytest.raises(ValueError) as e:
            make()
        msg = str(e.value)
        assert f"{field}={bad!r}" in msg and str(allowed) in msg and "\n" not in msg
    assert kernel_choices() == before  # a refused change changes nothing


def test_unknown_choice_name_is_refused():
    with pytest.raises(TypeError, match=r"unknown kernel choice\(s\) \['packed'\]"):
        set_kernel_choices(packed="varlen")


def test_set_and_scoped_choices_select_the_packed_kernel():
    q = _long_packed()
    assert packed_self_attention_impl(q, q, q)[1] == "cuDNN not used: not on CUDA"
    with use_kernel_choices(packed_attention="varlen") as c:
        assert c.packed_attention == "varlen" and kernel_choices() is c
        assert packed_self_attention_impl(q, q, q)[1] == "cuDNN not used: kernel choice packed_attention='varlen'"
    assert packed_self_attention_impl(q, q, q)[1] == "cuDNN not used: not on CUDA"
    set_kernel_choices(packed_attention="varlen")
    assert packed_self_attention_impl(q, q, q)[1].endswith("packed_attention='varlen'")
    set_kernel_choices(packed_attention="cudnn")
    assert packed_self_attention_impl(q, q, q)[1] == "cuDNN not used: not on CUDA"


def test_scoped_choices_select_the_view_kernel_and_are_restored_on_errors():
    q, v = torch.zeros(4, 2, 192, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert view_attention_impl(q, v) == ("varlen", "cuDNN split not used: not on CUDA")
    with pytest.raises(RuntimeError, match="inside"):
        with use_kernel_choices(view_attention="varlen", autotune="full"):
            assert view_attention_impl(q, v) == ("varlen", "requested")
            assert tuning.mode() == "full"
            set_kernel_choices(packed_attention="varlen")  # undone with the block's own changes
            raise RuntimeError("inside")
    assert kernel_choices() == KernelChoices()
    assert view_attention_impl(q, v) == ("varlen", "cuDNN split not used: not on CUDA")


def test_nested_scopes_and_whole_choices():
    with use_kernel_choices(view_attention="varlen"):
        with use_kernel_choices(KernelChoices(packed_attention="varlen")) as inner:
            assert inner == KernelChoices(packed_attention="varlen")  # a whole KernelChoices replaces every field
        assert kernel_choices() == KernelChoices(view_attention="varlen")
    assert kernel_choices() == KernelChoices()


def _fresh_process(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in _CHOICE_VARS}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**clean, "PYTHONPATH": REPO, **env})


_PRINT_CHOICES = """
import dataclasses, json, os
import harts.env, harts.ops
first = harts.ops.kernel_choices()
os.environ["HARTS_PACKED_ATTENTION"] = "cudnn"  # read once, at import: a later change is not seen
print(json.dumps({"env": dataclasses.asdict(harts.env.ENV), "choices": dataclasses.asdict(harts.ops.kernel_choices()),
                  "same": first is harts.ops.kernel_choices()}))
"""


def test_environment_sets_the_defaults_read_once_at_import():
    out = _fresh_process(_PRINT_CHOICES, HARTS_VIEW_ATTENTION="varlen", HARTS_PACKED_ATTENTION="varlen",
                         HARTS_AUTOTUNE="full", HARTS_CONV="harts", HARTS_SWIGLU="torch",
                         HARTS_KERNEL_REPORT="/tmp/r.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["choices"] == {"view_attention": "varlen", "packed_attention": "varlen", "autotune": "full",
                              "conv": "harts", "swiglu": "torch"}
    assert got["env"]["kernel_report"] == "/tmp/r.jsonl" and got["env"]["autotune_record"] is None
    assert got["same"]


def test_environment_default_reaches_the_kernel_selection():
    code = ("import torch\nfrom harts.ops.attention.fast import CUDNN_MIN_MEAN_LEN, packed_self_attention_impl\n"
            "q = torch.zeros(2 * CUDNN_MIN_MEAN_LEN, 2, 8)\nprint(packed_self_attention_impl(q, q, q)[1])")
    out = _fresh_process(code, HARTS_PACKED_ATTENTION="varlen")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "cuDNN not used: kernel choice packed_attention='varlen'"


def test_invalid_environment_value_is_named_when_the_choices_are_first_needed():
    out = _fresh_process("import harts.ops\nprint('imported')\nharts.ops.kernel_choices()",
                         HARTS_VIEW_ATTENTION="flash")
    assert out.stdout.strip() == "imported"  # importing stays possible
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: HARTS_VIEW_ATTENTION='flash': expected one of ('cudnn_split', 'varlen')")


def test_library_reads_no_environment_outside_harts_env():
    """No HARTS_* or TRITON_INTERPRET lookups in the ops, kernels and warm-up; harts.env is the one reader."""
    roots = [os.path.join(REPO, "harts", "ops"), os.path.join(REPO, "kernels")]
    files = [os.path.join(REPO, "harts", "warmup.py")]
    files += [os.path.join(d, f) for r in roots for d, _, fs in os.walk(r) for f in fs if f.endswith(".py")]
    offenders = [p for p in files if any(s in open(p).read() for s in ("os.environ", "getenv("))
                 and not p.endswith("warmup.py")]
    assert offenders == []
    warmup = open(files[0]).read()
    reads = [line.strip() for line in warmup.splitlines() if "os.environ" in line]
    # the warm-up copies the environment into its subprocesses and reads torchrun's RANK, nothing else
    assert all("RANK" in r or r.startswith("env = dict(os.environ") for r in reads), reads


# ------------------------------------------------------------------------------------------- host memory
# Frees 24 blocks of 6 MB (above glibc's default mmap threshold, below 32 MiB) and allocates and touches them
# again, three times; prints the page faults of the last two rounds. Under glibc's defaults the freed blocks
# are unmapped or trimmed (more than twice the largest block is free at the heap top), so each round faults
# every page in again; with the memory kept, none does.
_FAULTS = """
import ctypes, resource
from harts.env import keep_host_memory
line = keep_host_memory() if KEEP else "defaults"
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def round_():
    blocks = [libc.malloc(6 << 20) for _ in range(24)]
    for b in blocks:
        ctypes.memset(b, 1, 6 << 20)
    for b in blocks:
        libc.free(b)
round_()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_(); round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(line)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux only)")
def test_kept_host_memory_reuses_freed_pages_without_faults():
    pages = 2 * 24 * (6 << 20) // os.sysconf("SC_PAGE_SIZE")
    default = _fresh_process("KEEP = False" + _FAULTS, HARTS_HOST_MEMORY="keep")
    kept = _fresh_process("KEEP = True" + _FAULTS, HARTS_HOST_MEMORY="keep")
    assert default.returncode == 0 and kept.returncode == 0, (default.stderr[-2000:], kept.stderr[-2000:])
    faults_default, faults_kept = int(default.stdout.split()[0]), int(kept.stdout.split()[0])
    assert faults_default > pages // 16, (faults_default, pages)  # huge pages fault 2 MB at a time
    assert faults_kept < pages // 100, (faults_kept, pages)
    assert kept.stdout.splitlines()[1].startswith("host memory: glibc ")


def test_host_memory_system_leaves_malloc_alone_and_a_bad_value_is_named():
    out = _fresh_process("from harts.env import keep_host_memory\nprint(keep_host_memory())",
                         HARTS_HOST_MEMORY="system")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "host memory: glibc malloc defaults (HARTS_HOST_MEMORY=system)"
    out = _fresh_process("from harts.env import keep_host_memory\nkeep_host_memory()", HARTS_HOST_MEMORY="yes")
    assert out.stderr.strip().splitlines()[-1] == "ValueError: HARTS_HOST_MEMORY='yes': expected 'keep' or 'system'"


# --------------------------------------------------------------------------------------------------- fla
def test_fla_names_resolve_to_fla_objects():
    from harts.ops import _fla

    assert _fla.installed_version() == _fla.REQUIRED_VERSION
    import fla.ops.utils.index as index

    assert _fla.prepare_chunk_indices is index.prepare_chunk_indices
    with pytest.raises(AttributeError, match="no fla name 'chunk_nothing'"):
        _fla.chunk_nothing  # noqa: B018
    with pytest.raises(ValueError, match="not an fla module"):
        _fla.module("os")


@pytest.mark.parametrize("installed,have", [("0.5.1", "fla 0.5.1 is installed"), (None, "fla is not installed")])
def test_fla_version_check_is_one_line_naming_both_versions_and_the_fix(monkeypatch, installed, have):
    from harts.ops import _fla

    monkeypatch.setattr(_fla, "installed_version", lambda: installed)
    with pytest.raises(ImportError) as e:
        _fla.check_version()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(have) and "fla-core==0.6.0" in msg
    assert msg.endswith("pip install fla-core==0.6.0")
    _fla.check_version("0.6.0")


def test_fla_version_is_checked_at_import(monkeypatch):
    """A fresh import of the door module with another fla version installed raises the one-line error."""
    import fla

    monkeypatch.setattr(fla, "__version__", "0.7.0")
    monkeypatch.delitem(sys.modules, "harts.ops._fla")
    with pytest.raises(ImportError, match=r"^fla 0\.7\.0 is installed; .*pip install fla-core==0\.6\.0$"):
        import harts.ops._fla  # noqa: F401


def test_fla_is_imported_only_through_harts_ops_fla():
    roots = [os.path.join(REPO, d) for d in ("harts", "kernels", "benchmarks")]
    files = [os.path.join(d, f) for r in roots for d, _, fs in os.walk(r) for f in fs if f.endswith(".py")]
    fla_import = re.compile(r"^\s*(from|import) fla(\.|\s|$)")
    door = os.path.join(REPO, "harts", "ops", "_fla.py")
    offenders = [f"{os.path.relpath(p, REPO)}:{i}" for p in files if p != door
                 for i, line in enumerate(open(p), 1) if fla_import.match(line)]
    assert offenders == []
