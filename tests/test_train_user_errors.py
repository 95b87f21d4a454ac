"""A new user's traps through the real entry point (``train.main``, in-process, one gloo process): every bad
input exits non-zero with one short line naming the item (file:line and field, or the config key) and no
traceback; silent wrong behaviour (ignored data path, replaced rewards, no-op resumes, duplicated metrics,
skipped half-written checkpoints) is gone. The rollouts are docs/examples/rollouts.jsonl, so the documented
example is what these tests train on."""
import json
import logging
import os
import subprocess
import sys

import pytest

import train

EXAMPLE = "docs/examples/rollouts.jsonl"
JSONL = ["--data.source=jsonl", f"--data.path={EXAMPLE}"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread, as torchrun gives each rank: on a loaded 2-core machine the default threads make
    a step 10-20x slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _argv(out, *extra):
    return ["--config", "configs/debug_cpu.toml", f"--job.dump_folder={out}", "--training.steps=2",
            "--checkpoint.interval=1", "--checkpoint.export_hf=false", *extra]


def _error_lines(capfd) -> list[str]:
    """stderr of a failed run: the error block only (logging goes to pytest's handlers, not stderr)."""
    err = capfd.readouterr().err
    assert "Traceback" not in err and "data worker failed" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert lines and lines[0].startswith("error: ") and len(lines) <= 3, err
    return lines


def _fails(capfd, argv) -> str:
    assert train.main(argv) == 1
    return " ".join(_error_lines(capfd))


def _records(out) -> list[int]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(l)["step"] for l in f]


def _example_lines() -> list[dict]:
    with open(EXAMPLE) as f:
        return [json.loads(l) for l in f]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------ config


def test_data_path_without_jsonl_source_is_an_error(tmp_path, capfd):
    msg = _fails(capfd, _argv(tmp_path, f"--data.path={EXAMPLE}"))
    assert "data.path" in msg and "--data.source=jsonl" in msg


@pytest.mark.parametrize("argv, fragments", [
    (["--harts.capcity=3"], ["--harts.capcity", "did you mean '--harts.capacity'"]),
    (["--hart.capacity=3"], ["[hart]", "did you mean 'harts'"]),
    (["--harts.capacity=big"], ["--harts.capacity=big", "integer"]),
])
def test_cli_typos_name_the_option(tmp_path, capfd, argv, fragments):
    msg = _fails(capfd, _argv(tmp_path, *argv))
    assert all(f in msg for f in fragments) and "run_train.sh" not in msg, msg


def test_toml_typo_names_file_section_and_key(tmp_path, capfd):
    bad = tmp_path / "bad.toml"
    bad.write_text(open("configs/debug_cpu.toml").read().replace("capacity = 512", "capcity = 512"))
    msg = _fails(capfd, ["--config", str(bad)])
    assert "'capcity' of [harts]" in msg and "did you mean 'capacity'" in msg and str(bad) in msg, msg
    assert "run_train.sh" not in msg
    msg = _fails(capfd, ["--config", str(tmp_path / "missing.toml")])
    assert "missing.toml" in msg


def test_debug_config_uses_the_rollouts_rewards(caplog):
    """data.reward = 'auto' (the debug config's): a JSONL file's rewards drive GRPO; 'learnable' replaces
    them and says so."""
    from harts.train.config import load_config
    from harts.train.data import StepBuilder

    want = [r["reward"] for r in _example_lines()]
    kw = dict(dp_degree=1, dp_rank=0, vocab_size=512, chunk_size=16, conv_width=4)
    cfg = load_config("configs/debug_cpu.toml", **{"data.source": "jsonl", "data.path": [EXAMPLE]})
    assert [t.reward for t in StepBuilder(cfg, **kw).load(1)] == want
    syn = StepBuilder(load_config("configs/debug_cpu.toml"), **kw)
    assert syn.reward == "learnable"
    cfg = load_config("configs/debug_cpu.toml", **{"data.source": "jsonl", "data.path": [EXAMPLE],
                                                     "data.reward": "learnable"})
    with caplog.at_level(logging.WARNING, logger="harts.train"):
        got = [t.reward for t in StepBuilder(cfg, **kw).load(1)]
    assert got != want and "replaces the rewards in " + EXAMPLE in caplog.text


# ------------------------------------------------------------------ data (raised in the data worker)


def _bad_rows():
    rows = _example_lines()
    no_mask = [dict(r) for r in rows]
    del no_mask[3]["loss_mask"]
    seven = [dict(r) for r in rows]
    seven[4]["loss_mask"] = [7.0] + seven[4]["loss_mask"][1:]
    typo = [dict(r) for r in rows]
    typo[5]["lossmask"] = typo[5].pop("loss_mask")
    no_reward = [dict(r) for r in rows]
    del no_reward[6]["reward"]
    vocab = [dict(r) for r in rows]
    vocab[7]["tokens"] = vocab[7]["tokens"][:-1] + [512]
    return {
        "missing loss_mask": (no_mask, ":4: field 'loss_mask' is missing"),
        "mask 7": (seven, ":5: field 'loss_mask' position 0 is 7"),
        "misspelt field": (typo, ":6: unknown field 'lossmask' (did you mean 'loss_mask'?)"),
        "missing reward": (no_reward, ":7: field 'reward' is missing (required by rl.advantages = 'grpo'"),
        "token id": (vocab, ":8: field 'tokens' position"),
        "bad json": (None, ":2: invalid JSON"),
    }


@pytest.mark.parametrize("case", list(_bad_rows()))
def test_bad_rollouts_give_one_line_with_file_line_and_field(tmp_path, capfd, case):
    rows, fragment = _bad_rows()[case]
    if rows is None:
        path = tmp_path / "r.jsonl"
        path.write_text(open(EXAMPLE).readline() + "{oops\n")
        path = str(path)
    else:
        path = _write(tmp_path / "r.jsonl", rows)
    msg = _fails(capfd, _argv(tmp_path / "out", "--data.source=jsonl", f"--data.path={path}"))
    assert path + fragment in msg, msg


def test_over_capacity_names_harts_capacity(tmp_path, capfd):
    msg = _fails(capfd, _argv(tmp_path, *JSONL, "--harts.capacity=30"))
    assert "harts.capacity = 30" in msg and f"{EXAMPLE}:" in msg and "--harts.capacity" in msg, msg


# ------------------------------------------------------------------ run directories and output


def test_run_directory_lifecycle(tmp_path, capfd, caplog):
    """Train 2 steps; the same command again is refused (not a silent no-op); a half-written last checkpoint
    is reported and skipped, the resumed run trains step 2 again and metrics.jsonl holds each step once;
    checkpoint.overwrite starts fresh. Output: no ANSI codes off a terminal, the metrics path at start and
    an end-of-run summary."""
    out = tmp_path / "run"
    caplog.set_level(logging.INFO)
    assert train.main(_argv(out, *JSONL)) == 0
    stdout = capfd.readouterr().out
    assert "\033[" not in stdout and "step    2" in stdout
    assert f"metrics: {out}/metrics.jsonl" in caplog.text
    assert "done: steps 1-2 of 2" in caplog.text and "compression" in caplog.text
    assert _records(out) == [1, 2]

    msg = _fails(capfd, _argv(out, *JSONL))
    assert "finished run" in msg and "--training.steps" in msg and "--checkpoint.overwrite" in msg, msg

    os.remove(out / "checkpoint" / "step-2" / ".metadata")  # a run killed while writing step 2's checkpoint
    caplog.clear()
    assert train.main(_argv(out, *JSONL)) == 0
    assert f"checkpoint {out}/checkpoint/step-2 is incomplete" in caplog.text
    assert "resumed from the checkpoint of step 1" in caplog.text
    assert _records(out) == [1, 2]

    assert train.main(_argv(out, *JSONL, "--checkpoint.overwrite")) == 0
    assert _records(out) == [1, 2]


def test_torchrun_data_error_is_one_line_from_rank_0(tmp_path):
    """Two gloo processes, a misspelt field: exit status != 0, one error line (rank 0's), no traceback from
    the ranks."""
    rows = _example_lines()
    rows[2]["lossmask"] = rows[2].pop("loss_mask")
    path = _write(tmp_path / "r.jsonl", rows)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HARTS_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py",
                        *_argv(tmp_path / "out", "--data.source=jsonl", f"--data.path={path}")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0
    ours = [l for l in p.stderr.splitlines() if l.startswith("error: ")]
    assert ours == [f"error: {path}:3: unknown field 'lossmask' (did you mean 'loss_mask'?) (free-form data goes "
                    "into 'meta')"], p.stderr
    # no traceback from the ranks: no frame of train.py or the harts package (torchrun's own summary may follow)
    ours_dir = os.path.dirname(os.path.abspath(train.__file__))
    frames = [l.strip() for l in p.stderr.splitlines() if l.strip().startswith("File ")]
    assert not [f for f in frames if f.startswith((f'File "{os.path.join(ours_dir, "harts")}{os.sep}',
                                                    f'File "{os.path.join(ours_dir, "train.py")}"'))], p.stderr
    assert not any(l.startswith("[rank") for l in p.stderr.splitlines()), p.stderr


def test_metrics_truncate_drops_later_steps_and_a_torn_line(tmp_path):
    """What a run killed mid-write leaves (steps after the checkpoint, a half-written record) is cut away."""
    from harts.train.metrics import MetricsLogger

    m = MetricsLogger(str(tmp_path), rank=0, color=False)
    with open(m.path, "w") as f:
        f.write("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    assert m.truncate(2) == 3 and _records(tmp_path) == [1, 2]
    assert m.truncate(2) == 0 and m.truncate(0) == 2 and _records(tmp_path) == []
    assert MetricsLogger(str(tmp_path), rank=1).truncate(0) == 0  # other ranks own no file
