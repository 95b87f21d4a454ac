"""The TRL GRPO step bench (``benchmarks.trl_grpo``) on CPU: its smoke run trains one step with plain TRL and one
with the HARTS trainer from the same init on the same fixed completions, and writes both runs' times and metrics;
the two runs' loss, gradient norm and entropy agree (float32, reference ops)."""
import json

import pytest

trl = pytest.importorskip("trl", minversion="1.16.0",
                          reason="TRL is optional: pip install 'harts[trl]' (the README's test command installs it)")

from benchmarks.trl_grpo import main, make_workload  # noqa: E402

REL = 1e-4


def test_workload_is_seeded_with_distinct_lengths():
    a, b = make_workload(512, 64, 8, 4, seed=0), make_workload(512, 64, 8, 4, seed=0)
    assert a == b and len(a.prompt) == 64 and len(a.completions) == 4
    lens = [len(c) for c in a.completions]
    assert len(set(lens)) == 4 and all(4 <= n <= 8 for n in lens)
    assert min(a.prompt + sum((c[:-1] for c in a.completions), [])) >= 4  # no pad / bos / eos / unk ids inside
    assert all(c[-1] == 2 for c in a.completions)  # finished: each ends in EOS
    assert a.tokens == 4 * 64 + sum(lens)
    with pytest.raises(ValueError, match="no spread"):
        make_workload(512, 64, 1, 4, seed=0)


def test_smoke_run_both_trainers_agree(tmp_path):
    argv = ["--device", "cpu", "--dtype", "float32", "--preset", "qwen3.5-debug", "--prompt-len", "64",
            "--completion-len", "8", "--num-generations", "4", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "trl_grpo.json").read_text())
    assert set(res["runs"]) == {"trl", "harts"} and res["G"] == 4 and res["prompt_len"] == 64
    assert all(res["checks"].values()) and res["checks"]["same_init"]
    lens = res["completion_lengths"]
    assert len(lens) == 4 and res["tokens_per_step"] == 4 * 64 + sum(lens)
    rows = res["rows"]
    assert rows["padded_tokens"] == 4 * (64 + max(lens)) and rows["attended_tokens"] == res["tokens_per_step"]
    assert rows["compact_rows"] == 64 + sum(lens)  # random completions share only the prompt
    assert res["row_compression"] == pytest.approx(res["tokens_per_step"] / rows["compact_rows"])
    t, h = res["runs"]["trl"], res["runs"]["harts"]
    for r in (t, h):
        assert len(r["step_s"]) == 1 and r["step_s_median"] > 0 and r["tokens_per_s"] > 0
        assert len(r["losses"]) == 1 and r["activation_checkpointing"].startswith("full")
        assert r["backends"] and all(v.startswith("reference") for k, v in r["backends"].items() if " " not in k)
    assert res["speedup"] == pytest.approx(t["step_s_median"] / h["step_s_median"])
    for key in ("losses", "grad_norms", "entropies"):
        for a, b in zip(t[key], h[key]):
            assert a is not None and abs(a - b) <= REL * abs(a), (key, a, b)
    assert t["losses"][0] != 0 and t["grad_norms"][0] > 0
