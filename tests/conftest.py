"""Test configuration.

On a machine without CUDA, Triton kernels (fla's and ours) run under the Triton interpreter in
float32. TRITON_INTERPRET is read when ``@triton.jit`` is applied, so it is set here, before anything
imports fla or harts.kernels. Two shims make fla 0.6.0's kernels interpreter-safe (see
docs/testing.md): autotune benchmarking needs a GPU driver, and interpreter loop variables are
Python ints where fla calls ``.to()`` on them. Our own kernels do not need the shims.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    import ast

    from triton.runtime import autotuner, interpreter

    # (1) no GPU driver -> no benchmarker: skip autotune benchmarking, the first (pruned) config wins.
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]

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

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """GPU tests are deselected by the default marker expression; make a direct -m gpu run on CPU fail loudly."""
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)"))


@pytest.fixture
def fla_interpreter_patches(monkeypatch):
    """fla 0.6.0's safe-gate KDA kernels under the Triton interpreter: the interpreter has no ``tl.gather``
    and rejects the 'bf16x3' dot precision, so take fla's own non-gather branch and 'ieee' dots (the
    compiled GPU kernels are unaffected; this only lets CPU CI execute the same kernel code)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    import fla.ops.kda.chunk_intra as chunk_intra

    monkeypatch.setattr(chunk_intra, "IS_GATHER_SUPPORTED", False)
    monkeypatch.setattr(chunk_intra, "SAFE_GATE_DOT_PRECISION", tl.constexpr("ieee"))
