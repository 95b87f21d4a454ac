"""Drop stale entries from the packed Triton cache (docs/gpu-runbook.md: carry is capped at 64 MiB).

Usage: python scripts/prune_triton_cache.py CACHE.tar.xz OUT.tar.xz PREFIX=YYYY-MM-DDTHH:MM [...]

An entry (one compiled kernel: a hash directory with its .json metadata and .cubin) whose kernel name
starts with PREFIX and whose binary is older than the given UTC time is removed. Use it for kernels whose
source changed since (their old hashes never hit again) or whose old constexpr values are gone (e.g. the
norms' row-count classes before harts.ops.norm.fast rounded them). Autotune results and other entries are
kept. Prints how many entries and bytes each rule dropped.
"""
import calendar
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    src, dst, rules = sys.argv[1], sys.argv[2], []
    for r in sys.argv[3:]:
        prefix, _, when = r.partition("=")
        try:
            rules.append((prefix, calendar.timegm(time.strptime(when, "%Y-%m-%dT%H:%M"))))
        except ValueError:
            raise SystemExit(f"bad rule {r!r}: expected PREFIX=YYYY-MM-DDTHH:MM (UTC)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["tar", "-C", tmp, "-xJf", src], check=True)
        dropped = {p: [0, 0] for p, _ in rules}
        for meta in Path(tmp).glob("*/*.json"):
            if meta.name.startswith("__grp__") or not meta.with_suffix(".cubin").exists():
                continue
            try:
                name = json.loads(meta.read_text()).get("name", "")
            except (ValueError, AttributeError):
                continue
            t = meta.with_suffix(".cubin").stat().st_mtime
            for prefix, cut in rules:
                if name.startswith(prefix) and t < cut:
                    d = meta.parent
                    dropped[prefix][0] += 1
                    dropped[prefix][1] += sum(f.stat().st_size for f in d.iterdir())
                    shutil.rmtree(d)
                    break
        for p, (n, b) in dropped.items():
            print(f"{p}: {n} entries, {b / 1e6:.1f} MB dropped")
        with open(dst, "wb") as out:
            tar = subprocess.Popen(["tar", "-C", tmp, "-cf", "-", "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-9", "-T0"], stdin=tar.stdout, stdout=out, check=True)
            tar.wait()
    print(f"{dst}: {os.path.getsize(dst) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
