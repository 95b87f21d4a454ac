"""The timed speedup bench (`benchmarks.speedup`) on CPU: sharding and merging keep every microbatch once, the
merged report's rows and FLOPs equal a direct count, and a run that loaded kernels is timed again."""
import json

import pytest
import torch

from benchmarks.speedup import main, parse_shard, timed_run


class _Loads:
    n, names, seconds = 0, [], 0.0


def test_timed_run_repeats_until_no_kernel_load():
    loads, calls = _Loads(), []

    def fn():  # the first two runs load kernels (a compile, then a disk-cache load), the third does not
        calls.append(1)
        if len(calls) <= 2:
            loads.n += 1

    r = timed_run(fn, lambda: None, lambda: None, loads)
    assert r["runs"] == 3 and r["clean"] and r["loads"] == 0 and "first_s" in r
    loads.n, calls[:] = 0, []
    r = timed_run(lambda: None, lambda: None, lambda: None, loads)
    assert r["runs"] == 1 and r["clean"] and "first_s" not in r
    r = timed_run(lambda: setattr(loads, "n", loads.n + 1), lambda: None, lambda: None, loads, max_runs=2)
    assert r["runs"] == 2 and not r["clean"]  # reported, never hidden


def test_timed_run_median_of_clean_repeats(monkeypatch):
    """With repeats, the loading runs are not among the timed ones, and the reported time is the median of
    the clean runs (fake clock: run i takes durations[i] seconds)."""
    import benchmarks.speedup as sp

    durations, now, loads = [9.0, 3.0, 1.0, 2.0], [0.0], _Loads()
    loads.n = 0

    def fn():
        i = fn.calls
        fn.calls += 1
        now[0] += durations[i]
        if i == 0:
            loads.n += 1  # the first run compiles

    fn.calls = 0
    monkeypatch.setattr(sp.time, "perf_counter", lambda: now[0])
    r = timed_run(fn, lambda: None, lambda: None, loads, repeats=3)
    assert r["runs"] == 4 and r["clean"] and r["all_s"] == [3.0, 1.0, 2.0] and r["s"] == 2.0 and r["first_s"] == 9.0

    # a run that loads between clean ones is not among them, and the result stays clean
    durations[:], now[0], fn.calls, loads.n = [1.0, 7.0, 2.0, 5.0], 0.0, 0, 0

    def fn2():
        fn2.calls += 1
        now[0] += durations[fn2.calls - 1]
        if fn2.calls == 2:
            loads.n += 1

    fn2.calls = 0
    r = timed_run(fn2, lambda: None, lambda: None, loads, repeats=3)
    assert r["runs"] == 4 and r["clean"] and r["loads"] == 0 and r["all_s"] == [1.0, 2.0, 5.0] and r["s"] == 2.0
    with pytest.raises(ValueError, match="repeats=0"):
        timed_run(fn2, lambda: None, lambda: None, loads, repeats=0)


def test_profile_record_lists_host_ops_by_excess():
    """The host-op table: per op the HARTS and baseline seconds of the kernels under it, the ideal (baseline /
    compression) and the excess, largest |excess| first (2x compression here)."""
    from benchmarks.speedup import profile_record

    harts = ({}, None, {}, {"_Split": 0.3, "aten::mm": 1.0, "aten::cat": 0.2})
    base = ({}, None, {}, {"aten::mm": 2.2, "aten::cat": 0.4, "SDPABackward": 0.5})
    ops = profile_record(0, 200, 100, harts, base)["host_ops"]
    assert [o["name"] for o in ops] == ["_Split", "SDPABackward", "aten::mm", "aten::cat"]
    assert ops[0] == {"name": "_Split", "harts_s": 0.3, "baseline_s": 0.0, "ideal_s": 0.0, "excess_s": 0.3}
    assert abs(ops[2]["ideal_s"] - 1.1) < 1e-12 and abs(ops[2]["excess_s"] + 0.1) < 1e-12


def _small_profile() -> dict:
    """profile_families of a HARTS-like and a baseline-like CPU workload (matrix products and elementwise ops,
    the baseline doing 2x the work), as the bench's report records them."""
    from benchmarks.speedup import profile_families, profile_record

    a = torch.randn(96, 96, dtype=torch.float64)

    def work(n):
        for _ in range(n):
            (a @ a).relu_().exp_()

    fam = [profile_families(lambda n=n: work(n), torch.device("cpu"), _Loads(), lambda: None) for n in (2, 4)]
    return profile_record(0, 200, 100, fam[0], fam[1])


def test_profile_families_on_cpu():
    p = _small_profile()
    fams = p["families"]
    assert fams["gemm"]["harts_s"] > 0 and fams["gemm"]["baseline_s"] > 0 and p["compression"] == 2.0
    assert p["device_idle"] == {"harts": None, "baseline": None}  # CPU: no device timeline
    for v in fams.values():
        assert v["ideal_s"] == v["baseline_s"] / 2 and v["excess_s"] == v["harts_s"] - v["ideal_s"]


def test_parse_shard_errors():
    assert parse_shard("1/2") == (1, 2)
    for bad in ("2/2", "x", "1"):
        with pytest.raises(Exception, match="shard"):
            parse_shard(bad)


def test_sharded_speedup_merges_to_the_planned_microbatches(tmp_path, monkeypatch):
    import gc

    import benchmarks.speedup as speedup
    from benchmarks.common import in_subbatch_order, subbatches
    from benchmarks.speedup import planned_microbatches
    from harts.runtime import pack
    from harts.train.data import plan_trajectory_wise

    collecting = []  # whether automatic garbage collection was on at each timed run: off, as in train.py
    timed_run = speedup.timed_run
    monkeypatch.setattr(speedup, "timed_run", lambda *a, **k: collecting.append(gc.isenabled()) or timed_run(*a, **k))

    # no profiler here (on a CPU its event parsing of the per-token reference cores takes most of a minute):
    # shard 0's profile is a real one of a small workload (test_profile_families_on_cpu's), carried by the merge
    common = ["--preset", "ling3-tiny-debug", "--workload", "tiny", "--capacity", "128", "--microbatches", "2",
              "--device", "cpu", "--dtype", "float64", "--out", str(tmp_path), "--no-profile"]
    for shard in ("1/2", "0/2"):
        assert main(common + ["--shard", shard]) == 0
    assert collecting and not any(collecting) and gc.isenabled()  # the caller's collector is back on
    shards = [str(tmp_path / f"speedup_shard{i}of2.json") for i in (1, 0)]
    s0 = json.loads(open(shards[1]).read())
    assert "profile" not in s0
    s0["profile"] = _small_profile()
    open(shards[1], "w").write(json.dumps(s0))
    assert main(["--merge", *shards, "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "speedup.json").read_text())

    class A:
        preset, workload, seed, scale, capacity, microbatches = "ling3-tiny-debug", "tiny", 0, 0.2, 128, 2
    mbs, _, _ = planned_microbatches(A)
    assert [rec["index"] for rec in r["records"]] == list(range(len(mbs)))  # each once, none dropped
    raw = sum(len(t) for m in mbs for t in m)
    compact = sum(pack(m, chunk_size=16).num_rows for m in mbs)
    assert (r["raw_rows"], r["compact_rows"]) == (raw, compact) and r["compression"] == raw / compact
    assert r["speedup_fbgrad"] == r["fbgrad_baseline_s"] / r["fbgrad_harts_s"]
    assert r["fbgrad_baseline_s"] == sum(rec["baseline_s"] for rec in r["records"])
    # the host seconds before HARTS's first kernel are part of its F/B/Grad, reported on their own
    assert r["harts_pack_s"] == sum(rec["harts_pack_s"] for rec in r["records"]) > 0
    assert all(0 < rec["harts_pack_s"] + rec["harts_to_device_s"] < rec["harts_s"] for rec in r["records"])
    # and what stalled pack: its page faults and garbage-collection seconds, summed like its time
    assert r["harts_pack_page_faults"] == sum(rec["harts_pack_page_faults"] for rec in r["records"]) >= 0
    assert all(0 <= rec["harts_pack_gc_s"] <= rec["harts_pack_s"] for rec in r["records"])
    # the baseline's sub-batches are the trainer's baseline grouping: every trajectory once, each within capacity
    for m in mbs:
        groups = subbatches(m, 128)
        assert groups == plan_trajectory_wise([len(t) for t in m], dp_degree=1, capacity=128).microbatches
        assert sorted(i for sb in groups for i in sb) == list(range(len(m)))
        assert all(sum(len(m[i]) for i in sb) <= 128 for sb in groups)
        # in sub-batch order the groups are contiguous runs over the same trajectories
        ordered, runs = in_subbatch_order(m, 128)
        assert [i for r in runs for i in r] == list(range(len(m)))
        assert [[ordered[i] for i in r] for r in runs] == [[m[i] for i in sb] for sb in groups]
    assert r["profile"] == s0["profile"] and r["shards"] == 2
    # the host allocator setting both paths ran under is in the record (harts.env.keep_host_memory)
    assert r["host_memory"] == s0["host_memory"] and r["host_memory"].startswith("host memory: ")
    assert r["garbage_collection"].startswith("automatic collection off")
    with pytest.raises(SystemExit, match="every shard"):
        main(["--merge", shards[0], "--out", str(tmp_path)])


def test_compiled_speedup_compiles_both_paths_in_the_warm_up_only(tmp_path):
    """--compile compiles both paths' layers the same way (aot_eager here: the partitioner without inductor's C++
    compile), under --ac selective; every graph is built in the untimed warm-up, which is reported on its own,
    and the timed runs are clean (no graph compiled during them)."""
    args = ["--preset", "ling3-tiny-debug", "--workload", "tiny", "--capacity", "128", "--microbatches", "1",
            "--device", "cpu", "--dtype", "float64", "--out", str(tmp_path), "--no-profile", "--compile",
            "--compile-backend", "aot_eager", "--ac", "selective"]
    assert main(args) == 0
    r = json.loads((tmp_path / "speedup.json").read_text())
    assert r["activation_checkpointing"] == "selective" and r["compile"]["backend"] == "aot_eager"
    assert r["compile"]["compilations_in_warmup"] > 0 and r["warmup_s"]["harts"] > 0 and r["warmup_s"]["baseline"] > 0
    assert all(rec["harts_clean"] and rec["baseline_clean"] for rec in r["records"])
    assert r["speedup_fbgrad"] > 0 and r["flop_compression"] > 1


def test_profile_record_per_flop_ideal_follows_each_familys_flops():
    """With FLOP compressions, each family's per-FLOP ideal divides its baseline seconds by the compression of the
    FLOPs it does (attention its own, the KDA families kda's, the rest the matmul count's), kernels likewise by
    their family, and flop_parity is the ideal kernel time over HARTS's."""
    from benchmarks.speedup import profile_record

    fam_h = {"attention": 1.0, "kda_other": 0.5, "gemm": 2.0}
    fam_b = {"attention": 3.0, "kda_other": 1.6, "gemm": 8.0}
    names_h = {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 0.6, "nvjet_sm90_tst_256x160": 2.0}
    names_b = {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 1.5, "nvjet_sm90_tst_256x160": 8.0}
    comp = {"matmul": 4.0, "attention": 2.0, "kda": 3.2, "total": 3.5}
    p = profile_record(0, 400, 100, (fam_h, None, names_h, {}), (fam_b, None, names_b, {}), flop_compression=comp)
    f = p["families"]
    assert f["attention"]["flop_ideal_s"] == 1.5 and f["attention"]["flop_excess_s"] == -0.5
    assert f["kda_other"]["flop_ideal_s"] == 0.5 and f["gemm"]["flop_ideal_s"] == 2.0
    assert f["gemm"]["ideal_s"] == 2.0 and f["attention"]["ideal_s"] == 0.75  # the row ideal is kept beside it
    k = {x["name"]: x for x in p["kernels"]}
    assert k["cudnn_generated_fort_native_sdpa_sm90_flash_bprop"]["flop_ideal_s"] == 0.75
    assert abs(p["flop_parity"] - (1.5 + 0.5 + 2.0) / 3.5) < 1e-12
    assert "flop_parity" not in profile_record(0, 400, 100, (fam_h, None, {}, {}), (fam_b, None, {}, {}))


def test_profile_only_profiles_the_chosen_microbatch_and_times_nothing(tmp_path, monkeypatch):
    """``--profile-only``: one profile of the chosen microbatch (by raw rows) of each path, written as
    speedup_profile.json (HARTS's share written before the baseline is profiled); no microbatch is timed (no
    speedup.json). The profiler is replaced by a stub that
    records which microbatch each path ran (its cost on a CPU is the event parsing, not what is tested)."""
    import benchmarks.speedup as sp
    from benchmarks.speedup import planned_microbatches

    seen, partial = [], []

    def fake_profile(fn, device, loads, reset):
        if seen:  # the baseline's profile: HARTS's is already on disk
            partial.append(json.loads((tmp_path / "speedup_profile.json").read_text())["partial"])
        seen.append(fn)
        return ({"gemm": 1.0}, None, {"aten::mm": 1.0}, {"aten::mm": 1.0})

    monkeypatch.setattr(sp, "profile_families", fake_profile)
    common = ["--preset", "ling3-tiny-debug", "--workload", "tiny", "--capacity", "128", "--microbatches", "3",
              "--device", "cpu", "--dtype", "float64", "--out", str(tmp_path), "--profile-only"]
    assert main(common + ["--profile-microbatch", "smallest"]) == 0
    assert len(seen) == 2 and not (tmp_path / "speedup.json").exists()
    r = json.loads((tmp_path / "speedup_profile.json").read_text())

    class A:
        preset, workload, seed, scale, capacity, microbatches = "ling3-tiny-debug", "tiny", 0, 0.2, 128, 3
    mbs, _, _ = planned_microbatches(A)
    raws = [sum(len(t) for t in m) for m in mbs]
    assert r["profile"]["index"] == raws.index(min(raws)) and r["profile"]["raw"] == min(raws)
    assert partial[0]["harts_families_s"] == {"gemm": 1.0} and partial[0]["index"] == r["profile"]["index"]
    assert "partial" not in r
    assert r["profile"]["families"]["gemm"]["excess_s"] == 1.0 - 1.0 / r["profile"]["compression"]
    # the per-FLOP ideal of the matmul families is the row ideal: matmul FLOPs compress exactly like rows
    gemm = r["profile"]["families"]["gemm"]
    assert abs(gemm["flop_ideal_s"] - gemm["ideal_s"]) < 1e-12 and "attention" in r["profile"]["flop_compression"]
    with pytest.raises(SystemExit):
        main(common + ["--no-profile"])


def test_host_stalls_count_garbage_collection_and_page_faults():
    """A collection inside the interval is counted in seconds, one before it is not (automatic collections are
    off meanwhile, so none can fall into the interval by chance), and touching fresh pages counts their faults:
    the two things that stretch pack between runs besides its own work."""
    import gc
    import mmap

    from benchmarks.speedup import HostStalls

    stalls, was_enabled = HostStalls(), gc.isenabled()
    gc.disable()
    try:
        junk = [[i] for i in range(200_000)]  # tracked containers, so a collection takes measurable time
        gc.collect()  # before the interval
        before = stalls.mark()
        assert stalls.since(before)[1] == 0.0
        before = stalls.mark()
        gc.collect()
        # 16,384 fresh 4 KiB pages: an anonymous mapping of its own, never memory that malloc kept from earlier
        # tests (a process that called keep_host_memory reuses freed blocks, which fault no more)
        touched = mmap.mmap(-1, 64 << 20)
        for off in range(0, len(touched), mmap.PAGESIZE):
            touched[off] = 1
        faults, gc_s = stalls.since(before)
        assert gc_s > 0 and faults >= 32, (faults, gc_s)  # 32: even if every fault maps a 2 MiB huge page
        touched.close()
        del junk
    finally:
        gc.callbacks.remove(stalls._on_gc)
        if was_enabled:
            gc.enable()
