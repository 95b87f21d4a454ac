"""Our Triton kernels compile for the H200 (sm90) on this CPU machine.

The interpreter (what the other CPU tests run) executes kernels as Python and does not type-check them
the way the compiler does: e.g. a variable rebound from a bf16 to an fp32 pointer inside a branch runs
fine interpreted and is a CompilationError on the GPU. ``triton.compile`` with an explicit target runs
the whole pipeline (frontend, TTGIR, LLVM, PTX, the wheel's ptxas) without a GPU, so CI catches those.
The compile runs in a subprocess: this pytest process has TRITON_INTERPRET=1, under which ``triton.jit``
builds interpreter objects instead of compilable functions. The compile jobs (the round scans at K = 64
and 128, the AdamW update, the MoE gather-sum and SwiGLU, the attention merge, the short convolution) start
together when the module's first test runs, one subprocess each, so that they share the machine's cores; each
test waits for its own job.
"""
import os
import subprocess
import sys

import pytest

# the subprocess argument of each compile job
JOBS = ("64", "128", "adamw", "gather_sum", "swiglu", "attn_merge", "short_conv")

DT = "bf16"  # what the runtime uses; fp32 kernels share the source
FWD_SIG = {"k": f"*{DT}", "u": f"*{DT}", "w": f"*{DT}", "v_new": f"*{DT}", "gk": "*fp32", "h": f"*{DT}", "h0": "*fp32",
           "ht": "*fp32", "hb": "*fp32", "state_slot": "*i32", "cu_seqlens": "*i64",
           "chunk_offsets": "*i64", "T": "i32"}
BWD_SIG = {"qg": f"*{DT}", "k": f"*{DT}", "w": f"*{DT}", "gk": "*fp32", "dht": "*fp32", "dh0": "*fp32", "dhb": "*fp32",
           "state_slot": "*i32", "do": f"*{DT}", "dv": f"*{DT}", "dh": f"*{DT}", "dv2": f"*{DT}", "cu_seqlens": "*i64",
           "chunk_offsets": "*i64", "scale": "fp32", "T": "i32"}
# KDA (per-channel gate, k/q at the value heads: H == HV) and GDN (SCALAR_G: per-head gate, k/q at H = HV / 2
# key heads, Qwen3.5's grouping)
KDA, GDN = dict(H=16, SCALAR_G=False), dict(H=8, SCALAR_G=True)
VARIANTS = [("fwd", dict(SAVE_BOUNDARY=False, **KDA)), ("fwd", dict(SAVE_BOUNDARY=True, **KDA)),
            ("bwd", dict(USE_BOUNDARY_GRADIENT=False, INJECT_AT_TOP=False, **KDA)),
            ("bwd", dict(USE_BOUNDARY_GRADIENT=True, INJECT_AT_TOP=False, **KDA)),
            ("bwd", dict(USE_BOUNDARY_GRADIENT=True, INJECT_AT_TOP=True, **KDA)),
            ("fwd", dict(SAVE_BOUNDARY=False, **GDN)), ("fwd", dict(SAVE_BOUNDARY=True, **GDN)),
            ("bwd", dict(USE_BOUNDARY_GRADIENT=False, INJECT_AT_TOP=False, **GDN)),
            ("bwd", dict(USE_BOUNDARY_GRADIENT=True, INJECT_AT_TOP=False, **GDN))]


# GDN rounds' dqkwg kernel, at Qwen3.5's grouping (HV = 2 H) and block widths BK = BV = 64 and 128
DQKWG_SIG = {"q": f"*{DT}", "k": f"*{DT}", "v_new": f"*{DT}", "g": "*fp32", "h": f"*{DT}", "do": f"*{DT}",
             "dh": f"*{DT}", "dv": f"*{DT}", "dq": f"*{DT}", "dk": f"*{DT}", "dw": f"*{DT}", "dg": "*fp32",
             "cu_seqlens": "*i64", "chunk_indices": "*i64", "scale": "fp32", "T": "i32"}


@pytest.fixture(scope="module")
def compile_jobs(tmp_path_factory):
    """Starts every compile job (``python this_file JOB`` without TRITON_INTERPRET, output to files); returns
    ``result(job)``, which waits for that job and gives (returncode, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    d = tmp_path_factory.mktemp("sm90")
    procs = {}
    for job in JOBS:
        with open(d / f"{job}.out", "w") as out, open(d / f"{job}.err", "w") as err:
            procs[job] = subprocess.Popen([sys.executable, __file__, job], env=env, stdout=out, stderr=err, text=True)

    def result(job: str):
        procs[job].wait(timeout=600)
        return procs[job].returncode, (d / f"{job}.out").read_text(), (d / f"{job}.err").read_text()

    yield result
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("K", [64, 128])
def test_round_scans_compile_for_sm90(compile_jobs, K):
    rc, out, err = compile_jobs(str(K))
    assert rc == 0, out[-3000:] + err[-6000:]
    assert out.count("compiled") == len(VARIANTS) + 1, out


def _compile_all(K: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import harts.kernels.kda_round as kr

    def jit_fn(kernel):
        while not isinstance(kernel, triton.runtime.jit.JITFunction):  # through autotune/heuristics wrappers
            kernel = kernel.fn
        return kernel

    for which, flags in VARIANTS:
        kernel, sig = (kr.kda_round_fwd_kernel_h, FWD_SIG) if which == "fwd" else (kr.kda_round_bwd_kernel_dh, BWD_SIG)
        consts = dict(HV=16, K=K, V=128, BT=64, BV=64, **flags)
        consts.update(dict(USE_INITIAL_STATE=True, STORE_FINAL_STATE=True) if which == "fwd" else
                      dict(USE_INITIAL_STATE=True, USE_FINAL_STATE_GRADIENT=True))
        src = ASTSource(fn=jit_fn(kernel), signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
        assert compiled.asm["cubin"]
        print("compiled", which, K, flags, flush=True)

    import harts.kernels.gdn_round as kg

    consts = dict(H=8, HV=16, K=K, V=128, BT=64, BK=K, BV=K)
    sig = {**DQKWG_SIG, **{k: "constexpr" for k in consts}}
    src = ASTSource(fn=jit_fn(kg.gdn_round_bwd_kernel_dqkwg), signature=sig, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
    assert compiled.asm["cubin"]
    print("compiled dqkwg", K, flush=True)


def test_bf16_adamw_update_compiles_for_sm90(compile_jobs):
    rc, out, err = compile_jobs("adamw")
    assert rc == 0, out[-3000:] + err[-6000:]
    assert "compiled adamw" in out, out


def _compile_adamw() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import harts.kernels.bf16_adamw as ka

    sig = {"w_bits": "*i16", "low_bits": "*i16", "m_bits": "*i16", "v_bits": "*i16", "g": "*fp32", "N": "i64",
           **{k: "fp32" for k in ("one_minus_beta1", "beta2", "one_minus_beta2", "eps", "decay", "step_size",
                                  "bias_correction2")}, "BLOCK": "constexpr"}
    src = ASTSource(fn=ka.bf16_adamw_fwd_kernel_update, signature=sig, constexprs={"BLOCK": 1024})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"]
    print("compiled adamw", flush=True)


def test_moe_gather_sum_compiles_for_sm90(compile_jobs):
    rc, out, err = compile_jobs("gather_sum")
    assert rc == 0, out[-3000:] + err[-6000:]
    assert out.count("compiled gather_sum") == 3, out


def _compile_gather_sum() -> None:
    """The MoE combine (K = 8, D = 1536 of Ling-3.0-tiny) and the slot gather (K = 1) with int64 indices,
    and the combine with int32 indices at a width that needs the column mask; blocks from the launcher's
    heuristic."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import harts.kernels.moe_gather_sum as kg

    for K, D, idx in ((8, 1536, "*i64"), (1, 1536, "*i64"), (8, 40, "*i32")):
        BT, BD = kg.block_sizes(D)
        sig = {"src": f"*{DT}", "idx": idx, "out": f"*{DT}", "T": "i32", "D": "i32", "stride_src": "i32",
               "stride_out": "i32", "K": "constexpr", "BT": "constexpr", "BD": "constexpr"}
        src = ASTSource(fn=kg.moe_gather_sum_fwd_kernel, signature=sig, constexprs=dict(K=K, BT=BT, BD=BD))
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": kg.NUM_WARPS})
        assert compiled.asm["cubin"]
        print("compiled gather_sum", K, D, idx, flush=True)


def test_moe_swiglu_compiles_for_sm90(compile_jobs):
    rc, out, err = compile_jobs("swiglu")
    assert rc == 0, out[-3000:] + err[-6000:]
    assert out.count("compiled swiglu") == 2, out


def _compile_swiglu() -> None:
    """The experts' SwiGLU forward and its fused backward, bf16 rows and fp32 routing weights, blocks as the
    launchers set them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import harts.kernels.moe_swiglu as ks

    fwd = {"gu": f"*{DT}", "s": "*fp32", "h": f"*{DT}", "M": "i32", "F": "i32", "stride_gu": "i32",
           "stride_h": "i32", "BM": "constexpr", "BF": "constexpr"}
    bwd = {"gu": f"*{DT}", "s": "*fp32", "dh": f"*{DT}", "dgu": f"*{DT}", "h": f"*{DT}", "ds": "*fp32", "M": "i32",
           "F": "i32", "stride_gu": "i32", "stride_dh": "i32", "stride_dgu": "i32", "stride_h": "i32",
           "BM": "constexpr", "BF": "constexpr"}
    for name, fn, sig in (("fwd", ks.moe_swiglu_fwd_kernel, fwd), ("bwd", ks.moe_swiglu_bwd_kernel, bwd)):
        src = ASTSource(fn=fn, signature=sig, constexprs=dict(BM=ks.BM, BF=ks.BF))
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": ks.NUM_WARPS})
        assert compiled.asm["cubin"]
        print("compiled swiglu", name, flush=True)


def test_attn_merge_compiles_for_sm90(compile_jobs):
    rc, out, err = compile_jobs("attn_merge")
    assert rc == 0, out[-3000:] + err[-6000:]
    assert out.count("compiled attn_merge") == 2, out


def _compile_attn_merge() -> None:
    """The merge of four groups into bf16 rows at Qwen3.5's value head (256) and of one group at Ling-3.0's
    MLA value head (128), blocks as the launcher picks them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import harts.kernels.attn_merge as km

    group = ["*bf16", "*fp32"] + ["i32"] * 8  # per group: o, lse, B, r0, then the o and lse strides
    names = km.attn_merge_fwd_kernel.arg_names[6:6 + 10 * km.MAX_GROUPS]
    for NG, Dv in ((4, 256), (1, 128)):
        BD = triton.next_power_of_2(Dv)
        consts = dict(NG=NG, BL=max(1, min(64, 8192 // BD)), BD=BD)
        sig = {"out": "*bf16", "out_lse": "*fp32", "so_r": "i32", "so_h": "i32", "sl_r": "i32", "sl_h": "i32",
               **dict(zip(names, group * 4)), "L": "i32", "DV": "i32", **{k: "constexpr" for k in consts}}
        src = ASTSource(fn=km.attn_merge_fwd_kernel, signature=sig, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert compiled.asm["cubin"]
        print("compiled attn_merge", NG, Dv, flush=True)


def test_short_conv_compiles_for_sm90(compile_jobs):
    rc, out, err = compile_jobs("short_conv")
    assert rc == 0, out[-3000:] + err[-6000:]
    assert out.count("compiled short_conv") == 8, out
    # the kernels stream rows: x / dy rows must be read as vectors, not bf16 by bf16 (P % 16 == 0, as at the
    # models' widths, where Triton's launch specialises P and the pointers on divisibility by 16)
    assert out.count("vector row loads: yes") == 8, out


def _compile_short_conv() -> None:
    """Forward and backward, with and without SiLU and ancestor context, bf16 rows, a 256-channel block on
    2 warps (one of the autotuned configs), with the divisibility-by-16 hints a launch at P = 2,048 gets."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import harts.kernels.short_conv as kc

    def jit_fn(kernel):
        while not isinstance(kernel, triton.runtime.jit.JITFunction):
            kernel = kernel.fn
        return kernel

    common = {"cu": "*i64", "chunks_N2": "*i64", "ctx_Q3": "*i32", "P": "i32"}
    for which in ("fwd", "bwd"):
        for silu in (True, False):
            for has_ctx in (True, False):
                consts = dict(BT=kc.BT, BD=256, SILU=silu, HAS_CONTEXT=has_ctx)
                if which == "fwd":
                    fn, sig = kc.short_conv_fwd_kernel, {"x": f"*{DT}", "w": "*fp32", "y": f"*{DT}", **common}
                else:
                    fn, sig = kc.short_conv_bwd_kernel, {"x": f"*{DT}", "w": "*fp32", "dy": f"*{DT}", "dx": f"*{DT}",
                                                         "dw_NP4": "*fp32", "dctx_Q3P": "*fp32", **common}
                names = [*sig, *consts]
                aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if n != "w"}
                src = ASTSource(fn=jit_fn(fn), signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts,
                                attrs=aligned)
                compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2})
                assert compiled.asm["cubin"]
                ptx = compiled.asm["ptx"]
                vector = "ld.global.b16" not in ptx and ("ld.global.v2" in ptx or "ld.global.v4" in ptx)
                print("compiled short_conv", which, silu, has_ctx, "vector row loads:", "yes" if vector else "no",
                      flush=True)


if __name__ == "__main__":
    if sys.argv[1] in ("adamw", "gather_sum", "swiglu", "attn_merge", "short_conv"):
        {"adamw": _compile_adamw, "gather_sum": _compile_gather_sum, "swiglu": _compile_swiglu,
         "attn_merge": _compile_attn_merge,
         "short_conv": _compile_short_conv}[sys.argv[1]]()
    else:
        _compile_all(int(sys.argv[1]))
