"""HARTS trainer entry point: ``torchrun --nproc_per_node N train.py --config configs/X.toml``.

The trainer (issue 8) is not built yet. Until it lands, the main job is the planning demo:
``python -m harts.demo``.
"""
import sys

if __name__ == "__main__":
    sys.exit("train.py: the HARTS trainer is not built yet (see issue 8); run `python -m harts.demo` instead.")
