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


def write_or_check(path: str, text: str, check: bool, regenerate: str) -> int:
    """A generated file: write ``text`` to ``path``, or with ``check`` compare and say how to regenerate.
    Returns the exit status (1: the file differs)."""
    if check:
        with open(path) as f:
            same = f.read() == text
        print(f"{path} {'is up to date' if same else f'differs from its sources: run {regenerate}'}")
        return 0 if same else 1
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")
    return 0
