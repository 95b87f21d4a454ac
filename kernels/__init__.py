"""HARTS Triton kernels, installed as ``harts.kernels``.

Import them as ``harts.kernels`` (never ``kernels``: that name belongs to a PyPI package).
Every kernel here also runs under ``TRITON_INTERPRET=1`` in float32 at small shapes.
"""
import sys
import threading

_register_lock = threading.Lock()


def lazy_op(module_name: str, name: str, register):
    """A module ``__getattr__`` under which ``name`` (a torch op wrapper) is built by ``register()`` on first
    access and kept in the module. Why lazily: registering a triton_op imports torch._inductor and
    torch._dynamo (seconds on a small CPU), and the ops reach these kernels only on their fast paths (the sm90
    compile test takes the kernels alone). Under torch.compile the access is the ``from ... import`` that Dynamo
    runs natively (``__import__`` resolves the names), so the registration is never traced; the lock keeps two
    threads from registering the op twice (which raises)."""

    def __getattr__(attr):
        if attr != name:
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        module = vars(sys.modules[module_name])
        with _register_lock:
            if name not in module:
                module[name] = register()
        return module[name]

    return __getattr__


def launchable(kernel):
    """``kernel`` as a triton_op body launches it: wrapped by ``torch.library.wrap_triton`` (what torch.compile
    traces), or as it is under the interpreter (torch 2.11's wrap_triton refuses the interpreter's kernel
    objects; CPU runs only, never traced)."""
    import torch

    from harts.env import ENV

    return kernel if ENV.triton_interpret else torch.library.wrap_triton(kernel)
