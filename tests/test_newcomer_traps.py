"""Inputs a first-time user gets wrong, through the real entry points (``train.main`` in-process, ``train.py``
under torchrun, ``python -m harts.data.stats``): each either trains correctly or stops with one line naming the
file:line / config key / setting and what to change."""
import json
import os
import subprocess
import sys

import pytest

import train
from tests.helpers import DIST_BASE, ROOT, assert_same_run, records, torchrun

EXAMPLE = "docs/examples/rollouts.jsonl"
JSONL = ["--data.source=jsonl", f"--data.path={EXAMPLE}"]


def _argv(out, *extra):
    return ["--config", "configs/debug_cpu.toml", f"--job.dump_folder={out}", "--training.steps=2",
            "--checkpoint.interval=1", "--checkpoint.export_hf=false", *extra]


def _error_line(capfd) -> str:
    """stderr of a failed run: exactly one line, ``error: ...``, and no traceback."""
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _fails(capfd, argv) -> str:
    assert train.main(argv) == 1
    return _error_line(capfd)


def _example_lines() -> list[dict]:
    with open(ROOT / EXAMPLE) as f:
        return [json.loads(line) for line in f]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------ a rank with nothing to score


@pytest.mark.slow
def test_one_token_trajectory_trains_on_two_processes_like_one(tmp_path):
    """A one-token trajectory has no predicted position; planned alone onto DP rank 1, that rank's microbatch
    scores nothing. Two gloo processes must still train, and equal one process (float64)."""
    from harts.train.config import load_config
    from harts.train.data import StepBuilder
    from harts.train.trainer import Trainer

    rows = _example_lines()[:2] + [{"tokens": [5], "loss_mask": [0], "reward": 1.0, "group_id": 9}]
    path = _write(tmp_path / "r.jsonl", rows)
    cfg = tmp_path / "base.toml"
    cfg.write_text(DIST_BASE)
    over = {"data.source": "jsonl", "data.path": [path], "data.reward": "data", "data.max_length": 0,
            "checkpoint.enable": False}
    c = load_config(str(cfg), **over)
    kw = dict(dp_degree=2, vocab_size=512, chunk_size=16, conv_width=4)
    empty = [all(mb.coeff.numel() == 0 for mb in StepBuilder(c, dp_rank=r, **kw).build(1).microbatches)
             for r in (0, 1)]
    assert empty == [False, True]  # the case under test: rank 1 has no log-prob position
    one = tmp_path / "one"
    Trainer(load_config(str(cfg), **{"job.dump_folder": str(one), **over})).train()
    two = tmp_path / "two"
    torchrun(cfg, two, "--data.source=jsonl", f"--data.path={path}", "--data.reward=data", "--data.max_length=0",
             "--checkpoint.enable=false")
    assert_same_run(one, two)
    assert all(r["grad_norm"] > 0 for r in records(two))


# ------------------------------------------------------------------ config files


def _toml(tmp_path, old: str, new: str) -> str:
    text = open(ROOT / "configs/debug_cpu.toml").read()
    assert old in text
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(old, new, 1))
    return str(path)


@pytest.mark.parametrize("old, new, fragments", [
    ("steps = 40", 'steps = "forty"', ['training.steps = "forty"', "expected an integer"]),
    ("steps = 40", "steps = 40.5", ["training.steps = 40.5", "expected an integer"]),
    ("lr = 3e-3", 'lr = "fast"', ['optimizer.lr = "fast"', "expected a number"]),
    ("enabled = true", "enabled = 1", ["harts.enabled = 1", "expected true or false"]),
    ("steps = [3]", "steps = 3", ["profile.steps = 3", "expected a list of integers"]),
])
def test_toml_value_of_the_wrong_type_names_file_key_type_and_value(tmp_path, capfd, old, new, fragments):
    path = _toml(tmp_path, old, new)
    msg = _fails(capfd, ["--config", path, f"--job.dump_folder={tmp_path / 'out'}"])
    assert path in msg and all(f in msg for f in fragments), msg


def test_toml_data_path_string_is_one_file(tmp_path, caplog):
    """``path = "x.jsonl"`` is the one file, not a list of its characters."""
    import logging

    path = _toml(tmp_path, 'source = "synthetic"', f'source = "jsonl"\npath = "{EXAMPLE}"')
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    assert train.main(["--config", path, f"--job.dump_folder={out}", "--training.steps=1",
                       "--checkpoint.enable=false", "--checkpoint.export_hf=false"]) == 0
    assert f"data: JSONL, 1 file(s) ({EXAMPLE})" in caplog.text
    assert records(out)[0]["trajectories"] == len(_example_lines())


# ------------------------------------------------------------------ data files


def _two_files(tmp_path, second=None) -> tuple[str, str]:
    rows = _example_lines()
    return _write(tmp_path / "step0.jsonl", rows[:8]), _write(tmp_path / "step1.jsonl", second or rows[8:])


def test_quickstart_multi_file_command_trains_on_every_file(tmp_path, caplog):
    """docs/quickstart.md's command (configs/debug_cpu.toml, whose data.fixed_step = true is for generated data)
    with two files: step 1 trains the first file, step 2 the second; both are checked before step 1."""
    import logging

    a, b = _two_files(tmp_path)
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    assert train.main(_argv(out, "--data.source=jsonl", f"--data.path={a},{b}")) == 0
    sizes = [sum(len(json.loads(line)["tokens"]) for line in open(p)) for p in (a, b)]
    assert [r["raw_tokens"] for r in records(out)] == sizes and sizes[0] != sizes[1]
    assert "checked before step 1: 2 file(s), 20 trajectories" in caplog.text


def test_a_bad_later_file_stops_the_run_before_step_1(tmp_path, capfd):
    rows = _example_lines()[8:]
    rows[3]["lossmask"] = rows[3].pop("loss_mask")
    a, b = _two_files(tmp_path, second=rows)
    out = tmp_path / "out"
    msg = _fails(capfd, _argv(out, "--data.source=jsonl", f"--data.path={a},{b}"))
    assert msg.startswith(f"error: {b}:4: unknown field 'lossmask'"), msg
    assert not (out / "metrics.jsonl").exists()  # no step ran


def test_non_utf8_bytes_name_file_and_line(tmp_path, capfd):
    path = tmp_path / "r.jsonl"
    latin1 = b'{"tokens": [1, 2], "loss_mask": [0, 1], "meta": {"x": "\xff"}}\n'
    path.write_bytes(open(ROOT / EXAMPLE, "rb").read() + latin1)
    msg = _fails(capfd, _argv(tmp_path / "out", "--data.source=jsonl", f"--data.path={path}"))
    assert f"{path}:21: not UTF-8 text (byte 0xff" in msg, msg
    p = subprocess.run([sys.executable, "-m", "harts.data.stats", str(path)], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.strip().splitlines() == [
        f"error: {path}:21: not UTF-8 text (byte 0xff at column 56); rollout files are UTF-8 JSON, one object per line"]


def test_stats_into_a_closed_pipe_ends_quietly():
    """``python -m harts.data.stats F | head -1``: the reader leaves after one line; no BrokenPipe traceback."""
    p = subprocess.run(f"{sys.executable} -m harts.data.stats {EXAMPLE} | head -1", shell=True, cwd=ROOT,
                       capture_output=True, text=True)
    assert p.stdout.startswith("paths") and len(p.stdout.splitlines()) == 1 and p.stderr == "", p.stderr


def _bad_values():
    rows = _example_lines()
    out = {}
    r = [dict(x) for x in rows]
    r[2]["tokens"] = [True] + r[2]["tokens"][1:]
    out["tokens true"] = (r, [], ":3: field 'tokens' position 0: token must be a non-negative integer, got True")
    r = [dict(x) for x in rows]
    r[4]["loss_mask"] = r[4]["loss_mask"][:-1] + [True]
    out["mask true"] = (r, [], f":5: field 'loss_mask' position {len(r[4]['tokens']) - 1} is true; it must be 0 or 1")
    r = [dict(x) for x in rows]
    r[5]["tokens"] = r[5]["tokens"][:-1] + [2**70]
    out["token 2**70"] = (r, [], f":6: field 'tokens' position {len(r[5]['tokens']) - 1}: token id {2**70} is out of "
                                 "range")
    r = [dict(x, old_logprobs=[-1.0] * len(x["tokens"])) for x in rows]
    r[6]["old_logprobs"][3] = 0.25
    out["old_logprobs > 0"] = (r, ["--rl.objective=ppo"], ":7: field 'old_logprobs' position 3 is 0.25; a "
                                                          "log-probability is <= 0")
    return out


@pytest.mark.parametrize("case", list(_bad_values()))
def test_bad_values_name_file_line_and_field(tmp_path, capfd, case):
    rows, extra, fragment = _bad_values()[case]
    path = _write(tmp_path / "r.jsonl", rows)
    msg = _fails(capfd, _argv(tmp_path / "out", "--data.source=jsonl", f"--data.path={path}", *extra))
    assert f"error: {path}{fragment}" in msg, msg


# ------------------------------------------------------------------ GRPO with nothing to learn


@pytest.mark.parametrize("case, change, why", [
    ("groups of one", lambda i, r: dict(r, group_id=i), "has a single trajectory"),
    ("equal rewards", lambda i, r: dict(r, reward=1.0), "every trajectory has the same reward"),
])
def test_grpo_without_signal_warns_once(tmp_path, caplog, case, change, why):
    import logging

    path = _write(tmp_path / "r.jsonl", [change(i, r) for i, r in enumerate(_example_lines())])
    caplog.set_level(logging.INFO)
    assert train.main(_argv(tmp_path / "out", "--data.source=jsonl", f"--data.path={path}")) == 0
    warned = [r.getMessage() for r in caplog.records if "every GRPO advantage is 0" in r.getMessage()]
    assert len(warned) == 1 and why in warned[0] and path in warned[0] and "rl.advantages" in warned[0], warned
    assert all(r["policy_loss"] == 0 for r in records(tmp_path / "out"))


def test_grpo_with_signal_does_not_warn(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    assert train.main(_argv(tmp_path / "out", *JSONL)) == 0
    assert "every GRPO advantage is 0" not in caplog.text


# ------------------------------------------------------------------ run folders and checkpoints


def _resume_hint(msg: str, step_dir) -> None:
    assert f"cannot resume from checkpoint {step_dir}:" in msg, msg
    assert "--checkpoint.load_step" in msg and "--checkpoint.overwrite" in msg, msg


def test_checkpoint_of_another_model_or_damaged_is_one_line(tmp_path, capfd):
    out = tmp_path / "run"
    assert train.main(_argv(out, "--training.steps=1")) == 0
    capfd.readouterr()
    step1 = out / "checkpoint" / "step-1"
    _resume_hint(_fails(capfd, _argv(out, "--model.num_hidden_layers=2")), step1)  # a changed model
    shard = next(p for p in sorted(step1.iterdir()) if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # a damaged file
    _resume_hint(_fails(capfd, _argv(out)), step1)
    (step1 / ".metadata").write_text("garbage")  # damaged metadata: DCP would log a traceback per rank
    _resume_hint(_fails(capfd, _argv(out)), step1)
    assert train.main(_argv(out, "--checkpoint.overwrite")) == 0  # the fix the message names


@pytest.mark.slow
def test_torchrun_checkpoint_of_another_model_is_one_line_from_rank_0(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HARTS_DEBUG", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py"]
    p = subprocess.run([*cmd, *_argv(out, "--training.steps=1")], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([*cmd, *_argv(out, "--model.num_hidden_layers=2")], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and not any(line.startswith("[rank") for line in p.stderr.splitlines()), p.stderr
    _resume_hint(ours[0], out / "checkpoint" / "step-1")


def test_unwritable_dump_folder_names_the_setting(tmp_path, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    msg = _fails(capfd, _argv(blocker / "out"))
    assert f"job.dump_folder = '{blocker / 'out'}' is not a writable folder" in msg and "--job.dump_folder" in msg


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path, capfd):
    out = tmp_path / "never"
    _fails(capfd, _argv(out, "--harts.capacity=5"))
    assert not out.exists()
    out.mkdir()  # a folder that was there before is kept
    _fails(capfd, _argv(out, "--harts.capacity=5"))
    assert out.is_dir()


def test_every_config_key_has_a_description():
    """docs/configuration.md gives every key a meaning (its generator reads the docstrings under the fields)."""
    import dataclasses
    import typing

    from benchmarks.docgen import field_docs
    from harts.train.config import HartsJobConfig

    sections = typing.get_type_hints(HartsJobConfig)
    missing = [f"{name}.{f.name}" for name, cls in sections.items() for f in dataclasses.fields(cls)
               if not field_docs(cls).get(f.name)]
    assert missing == []


@pytest.mark.slow
def test_fewer_trajectories_than_data_parallel_ranks_is_one_line(tmp_path):
    """One trajectory, two DP ranks: one error line naming the file and what to change, before step 1."""
    path = _write(tmp_path / "r.jsonl", _example_lines()[:1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HARTS_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "train.py", *_argv(tmp_path / "out", "--data.source=jsonl", f"--data.path={path}")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith(f"error: {path}: 1 trajectory for 2 data-parallel replicas"), p.stderr
    assert "--nproc_per_node" in ours[0] and not (tmp_path / "out").exists()


def test_unknown_model_preset_lists_every_family(tmp_path, capfd):
    msg = _fails(capfd, _argv(tmp_path / "out", "--model.preset=ling3-tiny-debgu"))
    assert "ling3-tiny-debgu" in msg and all(p in msg for p in ("ling3-tiny-debug", "qwen3.5-debug", "qwen3.5-8l",
                                                                 "qwen3.5-35b-a3b")), msg


@pytest.mark.slow
def test_torchrun_bad_second_file_is_one_line_from_rank_0(tmp_path):
    """Two ranks share the up-front file checks (rank 1 reads the second file); rank 0 prints rank 1's finding."""
    rows = _example_lines()[8:]
    rows[1]["tokens"] = rows[1]["tokens"][:-1] + [True]
    a, b = _two_files(tmp_path, second=rows)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HARTS_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "train.py", *_argv(tmp_path / "out", "--data.source=jsonl", f"--data.path={a},{b}")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith(f"error: {b}:2: field 'tokens' position"), p.stderr
    assert not any(line.startswith("[rank") for line in p.stderr.splitlines()), p.stderr


@pytest.mark.parametrize("source,argv_n,gpu,want", [
    ("TESTPATHS", None, False, "cpu"),  # `python -m pytest`: the whole suite, one process per core
    ("INVOCATION_DIR", None, False, "cpu"),
    ("ARGS", None, False, None),  # named files or tests: one process
    ("TESTPATHS", 0, False, None),  # -n 0 wins
    ("TESTPATHS", 3, False, None),  # so does any -n the caller gives (left as given)
])
def test_whole_suite_runs_in_parallel_processes_and_named_tests_in_one(source, argv_n, gpu, want):
    """The conftest's xdist switch: only a run without test paths is spread over processes; an explicit -n is
    never changed."""
    from types import SimpleNamespace

    from tests import conftest

    opt = SimpleNamespace(numprocesses=argv_n, dist="no", markexpr="gpu" if gpu else "not gpu and not gpu_bench")
    config = SimpleNamespace(option=opt, args_source=getattr(pytest.Config.ArgsSource, source),
                             pluginmanager=SimpleNamespace(hasplugin=lambda name: name == "xdist"),
                             getvalue=lambda name: False)
    conftest.pytest_cmdline_main(config)
    if want is None:
        assert (opt.numprocesses, opt.dist) == (argv_n, "no")
    else:
        n = conftest.CPU_RUN_WORKERS
        assert (opt.numprocesses, opt.dist) == ((n, "loadfile") if n > 1 else (None, "no"))
