"""HARTS Triton kernels, installed as ``harts.kernels``.

Import them as ``harts.kernels`` (never ``kernels``: that name belongs to a PyPI package).
Every kernel here also runs under ``TRITON_INTERPRET=1`` in float32 at small shapes.
"""
