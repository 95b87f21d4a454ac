"""``docs/configuration.md`` from the configuration classes themselves, so the reference cannot drift.

    python -m harts.bench.docgen            # rewrite docs/configuration.md
    python -m harts.bench.docgen --check    # exit 1 if the file differs from what the classes give

Sources: the trainer's ``HartsJobConfig`` (harts/train/config.py; every section and field the trainer
reads, with its default and the docstring written under the field, torchtitan's included) and the model's
``LingConfig`` (harts/models/ling/config.py; fields with their comments and the presets' values).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import textwrap

from harts.bench.output import write_or_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_MD = os.path.join(ROOT, "docs", "configuration.md")


def field_docs(cls) -> dict[str, str]:
    """Field name -> its documentation, over the class and its dataclass bases (nearest class wins): the
    string literal under the field, else the comment at the end of its line or on the lines above it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = src.splitlines()
        body = ast.parse(src).body[0].body
        for i, node in enumerate(body):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            name, text = node.target.id, ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                text = inspect.cleandoc(nxt.value.value)
            else:
                line = lines[node.lineno - 1]
                if "#" in line:
                    text = line.split("#", 1)[1].strip()
                above, j = [], node.lineno - 2
                while j >= 0 and lines[j].strip().startswith("#"):
                    above.insert(0, lines[j].strip()[1:].strip())
                    j -= 1
                if not text and above:
                    text = " ".join(above)
            docs[name] = " ".join(text.split())
    return docs


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _cell(x) -> str:
    if isinstance(x, str):
        return f'`"{x}"`'
    if isinstance(x, bool):
        return f"`{str(x).lower()}`"
    return f"`{x}`"


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("typing.", "").replace("|", "\\|")


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def trainer_section() -> list[str]:
    from harts.train.config import _OURS, _USED, HartsJobConfig

    out = ["## Trainer (`train.py --config FILE.toml [--section.key=value ...]`)", "",
           "A TOML file has one table per section; any field can be overridden on the command line as",
           "`--section.key=value` (precedence: command line, then TOML, then these defaults). Sections `ling`, "
           "`harts`,",
           "`data`, `rl` and `profile` are HARTS's; the others are torchtitan 0.2.2's, of which only the fields",
           "listed here are read. Setting any other torchtitan field is an error at load, so a config never silently",
           "does nothing.", ""]
    for sec in dataclasses.fields(HartsJobConfig):
        cls = type(_default(sec))
        if not dataclasses.is_dataclass(cls):
            continue
        if sec.name not in _OURS and sec.name not in _USED:
            continue
        docs = field_docs(cls)
        used = None if sec.name in _OURS else _USED[sec.name]
        rows = [f for f in dataclasses.fields(cls) if used is None or f.name in used]
        if not rows:
            continue
        origin = "HARTS" if sec.name in _OURS else "torchtitan" + (", extended by HARTS" if cls.__module__.startswith(
            "harts") else "")
        out += [f"### `[{sec.name}]` ({origin})", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in rows:
            out.append(f"| `{f.name}` | {_type(f)} | {_cell(_default(f))} | {_esc(docs.get(f.name, ''))} |")
        out.append("")
    return out


def model_section() -> list[str]:
    from harts.models.ling import LingConfig

    docs = field_docs(LingConfig)
    presets = ("ling3-tiny", "ling3-tiny-debug")
    cfgs = {p: LingConfig.preset(p) for p in presets}
    out = ["## Model (`LingConfig`, harts/models/ling/config.py)", "",
           "Field names follow the released Ling-3.0 `config.json`, so a checkpoint's config round-trips. In the",
           "trainer, `[ling] preset` picks a column and the `[ling]` keys above override a few fields.", "",
           "| field | type | " + " | ".join(f"`{p}`" for p in presets) + " | meaning |",
           "|---|---|" + "---|" * len(presets) + "---|"]
    for f in dataclasses.fields(LingConfig):
        vals = " | ".join(_cell(getattr(cfgs[p], f.name)) for p in presets)
        out.append(f"| `{f.name}` | {_type(f)} | {vals} | {_esc(docs.get(f.name, ''))} |")
    out.append("")
    return out


def render() -> str:
    head = ["# Configuration reference", "",
            "Generated by `python -m harts.bench.docgen` from harts/train/config.py and harts/models/ling/config.py;",
            "do not edit by hand. Example configs: `configs/*.toml` (see [training.md](training.md)).", ""]
    return "\n".join(head + trainer_section() + model_section())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=CONFIG_MD)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    return write_or_check(args.out, render(), args.check, "python -m harts.bench.docgen")


if __name__ == "__main__":
    sys.exit(main())
