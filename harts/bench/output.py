"""Where the benchmarks' results go: ``NAME.json`` and, when matplotlib is installed (the ``bench``
extra), ``NAME.png``; a missing matplotlib is said, not hidden. Torch-free, so the metrics-only benches
stay light."""
from __future__ import annotations

import json
import os


def write_results(out: str, name: str, res: dict, plot=None) -> None:
    """``res`` as ``out/NAME.json`` (non-JSON values as strings); ``plot(res, path)`` draws ``out/NAME.png``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    if plot is None:
        return
    try:
        plot(res, os.path.join(out, f"{name}.png"))
    except ImportError as e:  # matplotlib is a bench extra
        print(f"no PNG: {e}")
