"""Gated DeltaNet core (harts.ops.gdn) and its run on the KDA-family rounds.

- The reference (padded, all sequences at once, blocks recomputed in backward) equals a brute-force loop over
  sequences, tokens and value heads written from the recurrence, outputs, final states and gradients, with
  grouped value heads, initial states, an empty and a one-token sequence.
- On a compact batch, ``harts.runtime.compact.kda_rounds`` with the scalar decay broadcast over K equals the
  packed core run trajectory by trajectory (values and gradients of the per-row inputs), forks at B-1, B, B+1.
"""
import numpy as np
import pytest
import torch

from harts.ops.gdn import gated_delta_rule, gated_delta_rule_reference
from harts.runtime import pack
from harts.runtime.compact import kda_rounds
from tests.helpers import fork_tree


def brute_force(q, k, v, g, beta, cu, h0=None, scale=None):
    """o [T, HV, V] and final states, one token, one value head at a time."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    scale = K ** -0.5 if scale is None else scale
    o = torch.zeros(T, HV, V, dtype=torch.float64)
    finals = []
    for n in range(len(cu) - 1):
        heads = []
        for h in range(HV):
            S = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[n, h].clone()
            kh = h // (HV // H)
            for t in range(cu[n], cu[n + 1]):
                qt = q[t, kh] / torch.sqrt((q[t, kh] ** 2).sum() + 1e-6) * scale
                kt = k[t, kh] / torch.sqrt((k[t, kh] ** 2).sum() + 1e-6)
                S = torch.exp(g[t, h]) * S
                S = S + beta[t, h] * torch.outer(kt, v[t, h] - kt @ S)
                o[t, h] = qt @ S
            heads.append(S)
        finals.append(torch.stack(heads))
    return o, torch.stack(finals)


def inputs(T, H, HV, K, V, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = dict(q=torch.randn(T, H, K, generator=g, dtype=torch.float64),
             k=torch.randn(T, H, K, generator=g, dtype=torch.float64),
             v=torch.randn(T, HV, V, generator=g, dtype=torch.float64),
             g=-torch.rand(T, HV, generator=g, dtype=torch.float64) * 2,
             beta=torch.rand(T, HV, generator=g, dtype=torch.float64))
    return {n: x.requires_grad_(requires_grad) for n, x in t.items()}


@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4)])
def test_reference_equals_brute_force(H, HV):
    cu = [0, 5, 5, 6, 81]  # an empty and a one-token sequence; 75 tokens cross a recomputation block
    T, K, V = cu[-1], 8, 6
    x = inputs(T, H, HV, K, V, seed=H + HV, requires_grad=True)
    h0 = torch.randn(len(cu) - 1, HV, K, V, dtype=torch.float64, requires_grad=True)
    o, fin = gated_delta_rule_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.tensor(cu),
                                        initial_state_NHKV=h0, output_final_state=True, scale=0.3)
    o_ref, fin_ref = brute_force(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, h0, scale=0.3)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin, fin_ref, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(o)
    leaves = [*x.values(), h0]
    grads = torch.autograd.grad((o * w).sum() + fin.square().sum(), leaves)
    grads_ref = torch.autograd.grad((o_ref * w).sum() + fin_ref.square().sum(), leaves)
    for name, a, b in zip([*x, "h0"], grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_dispatch_and_validation():
    x = inputs(6, 2, 4, 4, 4, seed=0)
    cu = torch.tensor([0, 6])
    o, _ = gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu)  # auto on CPU -> reference
    torch.testing.assert_close(o, brute_force(x["q"], x["k"], x["v"], x["g"], x["beta"], [0, 6])[0])
    with pytest.raises(ValueError, match="g must be the per-head log decay"):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"][..., None].expand(6, 4, 4), x["beta"], cu)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule(x["q"], x["k"], x["v"][:, :3], x["g"][:, :3], x["beta"][:, :3], cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="fast backend for kda requested but unavailable"):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, backend="fast")


@pytest.mark.parametrize("B", [4, 5])
def test_rounds_equal_packed_core_per_trajectory(B):
    """Per-row inputs on the compact rows; HARTS: one kda_rounds call (q, k repeated to the value heads, g
    broadcast over K); reference: each trajectory's rows gathered and run through the packed core."""
    trajs = fork_tree(B, np.random.default_rng(B))
    # One extra token per trajectory: the rows of every original position are then logprob rows.
    ext = [t + [7] for t in trajs]
    batch = pack(ext, chunk_size=B)
    P, H, HV, K, V = batch.num_phys, 2, 4, 8, 4
    x = inputs(P, H, HV, K, V, seed=B, requires_grad=True)
    rows = [r[: len(t)] for r, t in zip(batch.split(batch.logprob_rows), trajs)]

    o_P = kda_rounds(x["q"].repeat_interleave(2, 1), x["k"].repeat_interleave(2, 1), x["v"],
                     x["g"][..., None].expand(P, HV, K), x["beta"], batch, chunk_size=B, backend="reference")
    flat = torch.cat(rows)
    cu = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    o_T, _ = gated_delta_rule(*(x[n].index_select(0, flat) for n in ("q", "k", "v", "g", "beta")), cu)
    torch.testing.assert_close(o_P.index_select(0, flat), o_T, rtol=1e-11, atol=1e-12)
    w = torch.randn_like(o_T)
    g_h = torch.autograd.grad((o_P.index_select(0, flat) * w).sum(), list(x.values()))
    g_b = torch.autograd.grad((o_T * w).sum(), list(x.values()))
    for name, a, b in zip(x, g_h, g_b):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert batch.stats["replay_tokens"] > 0 and batch.stats["boundary_states"] > 0


@pytest.mark.parametrize("impl", ["rounds", "fla_pieces", "fla"])
def test_fast_path_matches_reference_under_triton_interpreter(impl):
    """The CUDA paths (here the Triton interpreter, float32) against the reference: the model's fast path in
    both round implementations (``rounds``: the KDA round kernels with the broadcast decay; ``fla_pieces``:
    fla's GDN pieces with our scans; chunk 32) and fla's chunk_gated_delta_rule: outputs, final states and
    input gradients, two sequences with grouped value heads."""
    import os

    from harts.ops.gdn.fast import gated_delta_rule_fla

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.fail("the fast path needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = {n: t.float().to(dev).requires_grad_(True) for n, t in inputs(40, 2, 4, 16, 16, seed=11).items()}
    cu = torch.tensor([0, 17, 40], device=dev)
    h0 = torch.randn(2, 4, 16, 16, device=dev)
    outs = {}
    for be in ("fast", "reference"):
        if be == "fast" and impl == "fla":
            o, fin = gated_delta_rule_fla(*x.values(), cu, initial_state_NHKV=h0, output_final_state=True)
        else:
            o, fin = gated_delta_rule(*x.values(), cu, initial_state_NHKV=h0, output_final_state=True, backend=be,
                                      chunk_size=32, round_impl="fla_pieces" if impl == "fla_pieces" else "kda_kernels")
        w = torch.linspace(-1, 1, o.numel(), device=dev).view(o.shape)
        outs[be] = (o, fin, torch.autograd.grad((o * w).sum(), list(x.values())))
    for i, name in enumerate(("o", "final state")):
        a, b = outs["fast"][i], outs["reference"][i]
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5, name
    for name, a, b in zip(x, outs["fast"][2], outs["reference"][2]):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-4, f"grad {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_rounds_with_broadcast_decay_match_reference(dtype):
    """The Triton round kernels (chunk 64) with the GDN decay broadcast over K against the float32 reference
    rounds on the same compact batch: outputs and per-row input gradients. (Under the Triton interpreter the
    same check passes but takes about a minute, so it runs on the GPU only.)"""
    B = 64
    batch = pack([t + [7] for t in fork_tree(B, np.random.default_rng(0))], chunk_size=B).to("cuda")
    P, H, HV, K, V = batch.num_phys, 2, 4, 64, 64
    x = {n: t.to("cuda", torch.float32) for n, t in inputs(P, H, HV, K, V, seed=3).items()}
    res = {}
    for be, dt in (("fast", dtype), ("reference", torch.float32)):
        leaves = {n: t.to(dt).detach().requires_grad_(True) if n != "g" else t.clone().requires_grad_(True)
                  for n, t in x.items()}
        o = kda_rounds(leaves["q"].repeat_interleave(2, 1), leaves["k"].repeat_interleave(2, 1), leaves["v"],
                       leaves["g"][..., None].expand(P, HV, K), leaves["beta"], batch, chunk_size=B, backend=be)
        w = torch.linspace(-1, 1, o.numel(), device="cuda").view(o.shape).to(o.dtype)
        res[be] = (o.float(), [t.float() for t in torch.autograd.grad((o * w).sum(), list(leaves.values()))])
    # float32 inputs still run the kernels' dots in TF32 (10-bit mantissa): agreement to ~1e-3, not fp32's 1e-6
    tol = 5e-3 if dtype == torch.float32 else 3e-2
    (o_f, g_f), (o_r, g_r) = res["fast"], res["reference"]
    assert ((o_f - o_r).abs().max() / o_r.abs().max()).item() <= tol
    for name, a, b in zip(x, g_f, g_r):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 10 * tol, f"grad {name}"


def test_scalar_gate_fast_rounds_write_in_place_and_match_float64_truth(monkeypatch):
    """``kda_rounds`` with Gated DeltaNet's scalar decay g [P, HV] (q, k at the key heads) on the fast path
    (``chunk_gdn_round``; the Triton interpreter, float32) against the float64 reference rounds on a compact batch
    whose first round replays nothing and whose second replays rows: outputs and per-row input gradients within
    20x the float32 reference's own error to the float64 truth. The round without replay writes its output and its
    q and k gradients straight into the layer's rows (``chunk_gdn_round(out=, grad_out=)``), and that path runs."""
    import os

    import harts.ops.gdn_round.chunk as chunk_mod
    from tests.helpers import count_in_place_rounds, trajectories_from_spec

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.fail("the fast path needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")
    in_place = count_in_place_rounds(monkeypatch, chunk_mod)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B = 16
    batch = pack(trajectories_from_spec([(2 * B, [(20, [(5, []), (7, [])]), (11, [])])]), chunk_size=B).to(dev)
    assert [bool(r.replay_rows.numel()) for r in batch.rounds] == [False, True]
    P, H, HV, K, V = batch.num_phys, 2, 4, 16, 16
    x = inputs(P, H, HV, K, V, seed=21)

    def run(backend, dtype):
        leaves = {n: t.to(dev, dtype).requires_grad_(True) for n, t in x.items()}
        o = kda_rounds(*leaves.values(), batch, chunk_size=B, backend=backend)
        w = torch.linspace(-1, 1, o.numel(), device=dev, dtype=torch.float64).view(o.shape).to(dtype)
        return {"o": o.detach(), **dict(zip(leaves, torch.autograd.grad((o * w).sum(), list(leaves.values()))))}

    truth, ref32 = run("reference", torch.float64), run("reference", torch.float32)
    assert in_place == {"out": 0, "grad": 0}
    fast = run("fast", torch.float32)
    assert in_place == {"out": 1, "grad": 2}, in_place  # the first round's output; q's and k's gradients

    def rel_rmse(a, b):
        a, b = a.double().cpu(), b.double().cpu()
        return ((a - b).square().mean().sqrt() / b.square().mean().sqrt()).item()
    errs = {n: (rel_rmse(fast[n], truth[n]), max(rel_rmse(ref32[n], truth[n]), 1e-7)) for n in truth}
    assert all(e <= 20 * floor for e, floor in errs.values()), errs
