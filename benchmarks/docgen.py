"""``docs/configuration.md`` from the configuration classes themselves, so the reference cannot drift.

    python -m benchmarks.docgen            # rewrite docs/configuration.md
    python -m benchmarks.docgen --check    # exit 1 if the file differs from what the classes give

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
import typing

from benchmarks.output import write_or_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
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


def _type(f: dataclasses.Field, hint=None) -> str:
    """The field's type; a ``Literal`` is written as its allowed values (``"a" \\| "b"``)."""
    t = f.type if hint is None else hint
    if typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    if typing.get_origin(t) is typing.Literal:
        return " \\| ".join(_cell(v) for v in typing.get_args(t))
    t = t if isinstance(t, str) else getattr(t, "__name__", None) if isinstance(t, type) else str(t)
    return t.replace("typing.", "").replace("|", "\\|")


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def trainer_section() -> list[str]:
    from harts.train.config import HartsJobConfig

    out = ["## Trainer (`train.py --config FILE.toml [--section.key=value ...]`)", "",
           "A TOML file has one table per section; any field can be overridden on the command line as",
           "`--section.key=value` (precedence: command line, then TOML, then these defaults; `python train.py "
           "--help`",
           "lists the same). A field with a fixed set of values names them in its type; any other value is an "
           "error. Sections",
           "`job` to `comm` carry torchtitan 0.2.2's names, defaults and meanings for the settings the trainer "
           "reads (plus HARTS's",
           "additions); `model`, `harts`, `data`, `rl`, `online` and `profile` are HARTS's. Every key listed is "
           "read; any other",
           "key is an error at load, so a config never silently does nothing.", ""]
    hints = typing.get_type_hints(HartsJobConfig)
    for sec in dataclasses.fields(HartsJobConfig):
        cls = hints[sec.name]
        docs = field_docs(cls)
        field_hints = typing.get_type_hints(cls, include_extras=True)
        rows = dataclasses.fields(cls)
        if not rows:
            continue
        out += [f"### `[{sec.name}]`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in rows:
            out.append(f"| `{f.name}` | {_type(f, field_hints[f.name])} | {_cell(_default(f))} | "
                       f"{_esc(docs.get(f.name, ''))} |")
        out.append("")
    return out


def model_section() -> list[str]:
    from harts.models.ling import LingConfig

    docs = field_docs(LingConfig)
    presets = ("ling3-tiny", "ling3-tiny-debug")
    cfgs = {p: LingConfig.preset(p) for p in presets}
    out = ["## Model (`LingConfig`, harts/models/ling/config.py)", "",
           "Field names follow the released Ling-3.0 `config.json`, so a checkpoint's config round-trips. In the",
           "trainer, `[model] preset` picks a column and the `[model]` keys above override a few fields.", "",
           "| field | type | " + " | ".join(f"`{p}`" for p in presets) + " | meaning |",
           "|---|---|" + "---|" * len(presets) + "---|"]
    for f in dataclasses.fields(LingConfig):
        vals = " | ".join(_cell(getattr(cfgs[p], f.name)) for p in presets)
        out.append(f"| `{f.name}` | {_type(f)} | {vals} | {_esc(docs.get(f.name, ''))} |")
    out.append("")
    return out


def render() -> str:
    head = ["# Configuration reference", "",
            "Generated by `python -m benchmarks.docgen` from harts/train/config.py and harts/models/ling/config.py;",
            "do not edit by hand. Example configs: `configs/*.toml` (see [training.md](training.md)).", ""]
    return "\n".join(head + trainer_section() + model_section())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.docgen", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=CONFIG_MD)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    return write_or_check(args.out, render(), args.check, "python -m benchmarks.docgen")


if __name__ == "__main__":
    sys.exit(main())
