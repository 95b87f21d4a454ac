"""The CPU reference path stays cheap to start: a forward (and a backward of its hidden states) of the debug
model does not import torch.distributed.tensor, which torch.utils.checkpoint pulls in through torch._dynamo
(about a second per process). The KDA references recompute their chunks in backward with
``harts.ops.recompute.recompute_in_backward`` instead; its gradients equal plain autograd's.

Legend: H heads, K and V state dims, L steps.
"""
import subprocess
import sys

import pytest
import torch

from harts.ops.recompute import recompute_in_backward

_HEAVY = ("torch.distributed.tensor", "torch._dynamo")

_MODEL_RUN = """
import sys
import torch
from harts.models.ling import LingConfig, LingForCausalLM

torch.manual_seed(0)
m = LingForCausalLM(LingConfig.preset("ling3-tiny-debug", backend="reference")).double()
ids = torch.randint(0, m.config.vocab_size, (40,))
pos = torch.cat([torch.arange(23), torch.arange(17)])
cu = torch.tensor([0, 23, 40])
if sys.argv[1] == "no_grad":
    with torch.no_grad():
        h = m(ids, pos, cu)
else:
    h = m(ids, pos, cu)
    (h.square().sum() + sum(s.z_loss for s in m.router_stats())).backward()
    assert m.model.layers[0].attention.A_log.grad.abs().sum() > 0  # the backward went through a KDA layer
assert h.dtype == torch.float64
print(sorted(name for name in {heavy!r} if name in sys.modules))
"""


@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_reference_forward_does_not_import_distributed_tensor(mode):
    """A fresh process: the debug model on the float64 reference path, without and with a backward."""
    out = subprocess.run([sys.executable, "-c", _MODEL_RUN.format(heavy=_HEAVY), mode], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{mode} run imported {out.stdout.strip()}"


def _step(S_HKV, x_LHK, w_LH):
    """A small recurrence with several uses of each input and two outputs (state, per-step outputs)."""
    outs = []
    for t in range(x_LHK.shape[0]):
        S_HKV = S_HKV * torch.sigmoid(x_LHK[t])[:, :, None] + w_LH[t, :, None, None] * S_HKV.tanh()
        outs.append(torch.einsum("hk,hkv->hv", x_LHK[t], S_HKV))
    return S_HKV, torch.stack(outs)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
            for s in ((2, 3, 4), (10, 2, 3), (10, 2))]


def _chain(fn, S_HKV, x_LHK, w_LH, use):
    """Two steps over slices of the inputs with the state handed on, as the KDA references chain chunks."""
    S1, o1 = fn(_step, S_HKV, x_LHK[:5], w_LH[:5])
    S2, o2 = fn(_step, S1, x_LHK[5:], w_LH[5:])
    return {"all": o1.sin().sum() + o2.cos().sum() + S2.square().sum(), "state_only": S2.sum(),
            "outputs_only": (o1 * o2).sum(), "state_also_outside": S2.sum() + S1.square().mean()}[use]


def _grads(fn, use):
    ins = _inputs()
    _chain(fn, *ins, use).backward()
    return [x.grad for x in ins]


@pytest.mark.parametrize("use", ["all", "state_only", "outputs_only"])
def test_recompute_in_backward_matches_plain_autograd_bitwise(use):
    """Unused outputs get no gradient, so the backward sums the same terms in the same order as plain
    autograd."""
    plain = _grads(lambda f, *a: f(*a), use)
    for a, b in zip(plain, _grads(recompute_in_backward, use)):
        assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


def test_recompute_in_backward_input_with_outside_use_matches_to_rounding():
    """S1 feeds the second step and a term outside it: the step's contributions are summed first, so the
    same terms add in another order."""
    plain = _grads(lambda f, *a: f(*a), "state_also_outside")
    for a, b in zip(plain, _grads(recompute_in_backward, "state_also_outside")):
        torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15)


def test_recompute_in_backward_inputs_without_grad_and_no_graph_kept():
    S, x, w = _inputs()
    w.requires_grad_(False)
    S1, o = recompute_in_backward(_step, S, x, w)
    # only the inputs are kept: the graph node is the recompute Function, not the step's ops
    assert type(o.grad_fn).__name__ == "_RecomputeBackward"
    o.sum().backward()
    S2, x2, w2 = _inputs()
    _step(S2, x2, w2.detach())[1].sum().backward()
    assert torch.equal(S.grad, S2.grad) and torch.equal(x.grad, x2.grad) and w.grad is None
    with torch.no_grad():
        assert recompute_in_backward(_step, S, x, w)[1].grad_fn is None


def test_recompute_in_backward_rejects_non_tensors():
    S, x, w = _inputs()
    with pytest.raises(TypeError, match=r"_step takes tensors only.*\{2: 'float'\}"):
        recompute_in_backward(_step, S, x, 1.0)
    with pytest.raises(TypeError, match="no tensor arguments"):
        recompute_in_backward(_step)


def test_recompute_in_backward_refuses_double_backward():
    """The first-order gradient carries no graph: differentiating it again is an error, never a silent 0."""
    S, x, w = _inputs()
    o = recompute_in_backward(_step, S, x, w)[1]
    (gS,) = torch.autograd.grad(o.sum(), S, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        gS.sum().backward()
    (gS,) = torch.autograd.grad(o, S, torch.ones_like(o, requires_grad=True), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gS.sum().backward()


_LIBRARY_IMPORTS = """
import sys
import harts, harts.models, harts.ops, harts.runtime, harts.train, harts.planning
import harts.models.family, harts.train.trainer, harts.train.model, harts.data
print(sorted(name for name in sys.modules if name == "benchmarks" or name.startswith("benchmarks.")))
"""


def test_library_does_not_import_the_benchmarks():
    """The benchmarks and tools (top-level ``benchmarks``, run from a checkout, not installed) use the library;
    the library never imports them."""
    out = subprocess.run([sys.executable, "-c", _LIBRARY_IMPORTS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_no_library_module_imports_the_benchmarks():
    """No import of ``benchmarks`` anywhere in the library's source, function-level imports included."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted([*(root / "harts").rglob("*.py"), *(root / "kernels").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not bad, bad
