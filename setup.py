"""Package discovery only (metadata lives in pyproject.toml).

The Triton kernels live in the top-level folder ``kernels/`` (product layout) but are installed
as ``harts.kernels``, so HARTS never shadows the PyPI package named ``kernels``.
"""
from setuptools import find_packages, setup

kernel_pkgs = ["harts.kernels" + p[len("kernels"):] for p in find_packages(include=["kernels", "kernels.*"])]
setup(
    packages=find_packages(include=["harts", "harts.*"]) + kernel_pkgs,
    package_dir={"harts.kernels": "kernels"},
    # autotune winners per GPU architecture (harts.ops.tuning)
    package_data={"harts.ops": ["tuned/*.json"]},
)
