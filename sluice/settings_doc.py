"""The settings reference: every `SLUICE_*` variable, its default and what it does.

Generated from the settings classes' fields, so it cannot drift from them:
`render_settings_reference()` is `docs/settings.md` (regenerate it with
`python -m sluice.settings_doc > docs/settings.md`; a unit test fails while it is stale),
and `render_settings_table()` is what `sluice config` prints, with each variable's value
in the current environment beside its default.
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel

from sluice.settings import (
    ENV_PREFIX,
    BatchSettings,
    BusSettings,
    CommonSettings,
    EngineWorkerSettings,
    GatewaySettings,
    Settings,
    StoreSettings,
)
from sluice.settings_fields import is_secret
from sluice.settings_model import ModelSettings

REGENERATE = "python -m sluice.settings_doc > docs/settings.md"


@dataclass(frozen=True, slots=True)
class Section:
    """The settings one class adds, and the processes that read them."""

    title: str
    read_by: str
    cls: type[BaseModel]
    base: type[BaseModel] | None = None  # its fields are listed in their own sections

    def fields(self) -> list[str]:
        inherited = set(self.base.model_fields) if self.base is not None else set()
        return [name for name in self.cls.model_fields if name not in inherited]


SECTIONS: tuple[Section, ...] = (
    Section("Every process", "every `sluice` command that serves or works", CommonSettings),
    Section("The bus", "every process on the bus", BusSettings),
    Section("Stores", "every process that keeps state", StoreSettings),
    Section(
        "The model and the engine",
        "the engine workers (`sluice serve`, `sluice worker engine`); the gateway reads"
        " the model's name and parsers",
        ModelSettings,
    ),
    Section("Batches", "the gateway and `sluice worker batches`", BatchSettings),
    Section("The gateway", "`sluice serve`, `sluice gateway`", GatewaySettings, Settings),
    Section(
        "The engine worker",
        "`sluice serve`, `sluice worker engine`",
        EngineWorkerSettings,
        Settings,
    ),
)


@dataclass(frozen=True, slots=True)
class Row:
    variable: str
    default: str
    description: str


def format_value(value: Any) -> str:
    """A setting's value as it would be written in its variable ("unset" for None)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value) if value else "empty"
    if isinstance(value, Path):
        home = Path.home()
        return f"~/{value.relative_to(home)}" if value.is_relative_to(home) else str(value)
    if isinstance(value, float):
        return repr(value).removesuffix(".0")
    return str(value) if value != "" else "empty"


def _shown(value: Any) -> str:
    """`format_value`, with a URL's password hidden: `sluice config` prints to terminals."""
    if isinstance(value, str) and "://" in value:
        parts = urlsplit(value)
        if parts.password:
            value = value.replace(f":{parts.password}@", ":***@", 1)
    if isinstance(value, list):
        return format_value([_shown(v) for v in value]) if value else "empty"
    return format_value(value)


def rows(section: Section) -> list[Row]:
    """One row per setting the section's class adds, in the order it declares them."""
    out = []
    for name in section.fields():
        info = section.cls.model_fields[name]
        default = info.get_default(call_default_factory=True)
        description = info.description or ""
        out.append(Row(ENV_PREFIX + name.upper(), format_value(default), description))
    return out


def _markdown(text: str) -> str:
    """A table cell: variables in code, and nothing a renderer reads as HTML or a column."""
    text = text.replace("|", "\\|").replace("<", "&lt;")
    return re.sub(r"(?<!`)\b(SLUICE_[A-Z0-9_]+)\b(?!`)", r"`\1`", text)


_HEADER = f"""\
<!-- Generated from the settings classes (sluice/settings.py, sluice/settings_model.py):
edit a field's description there, then run `{REGENERATE}`. -->

# Settings

Every setting is an environment variable, validated when a process starts: a bad value
stops it with a message that names the variable and the fix. `sluice config` prints this
table with each variable's value in your environment; `sluice <command> --help` lists the
flags that override a few of them (`--model`, `--port`, `--data-dir`, ...).

A name's suffix is its unit: `_S` seconds, `_MS` milliseconds, `_BYTES` bytes, `_MB` MiB,
`_TOKENS` tokens. Booleans take `true`/`false` (or `1`/`0`); lists are comma-separated;
*unset* means the variable is not set (some settings also take `none` for it, as their
description says).
"""


def render_settings_reference() -> str:
    """`docs/settings.md`: one table per settings class, every field of each."""
    parts = [_HEADER]
    for section in SECTIONS:
        parts.append(f"\n## {section.title}\n\nRead by {section.read_by}.\n")
        parts.append("\n| variable | default | description |\n|---|---|---|\n")
        for row in rows(section):
            plain = row.default in ("unset", "empty")
            default = f"*{row.default}*" if plain else f"`{row.default}`"
            parts.append(f"| `{row.variable}` | {default} | {_markdown(row.description)} |\n")
    return "".join(parts)


def current_values(
    gateway: GatewaySettings, worker: EngineWorkerSettings
) -> dict[str, tuple[str, bool]]:
    """Each variable's value as the process kinds read it now, and whether it differs
    from the default; credentials only say whether they are set."""
    values: dict[str, tuple[str, bool]] = {}
    for section in SECTIONS:
        source: BaseModel = worker if section.cls is EngineWorkerSettings else gateway
        for name in section.fields():
            info = section.cls.model_fields[name]
            value = getattr(source, name)
            changed = value != info.get_default(call_default_factory=True)
            if is_secret(section.cls, name):
                shown = "(set)" if value else format_value(value)
            else:
                shown = _shown(value)
            values[ENV_PREFIX + name.upper()] = (shown, changed)
    return values


def _table(lines: Sequence[Sequence[str]], widths: Sequence[int]) -> list[str]:
    """Rows of cells wrapped to `widths`, a cell's lines side by side."""
    out = []
    for cells in lines:
        wrapped = [
            textwrap.wrap(c, w, break_on_hyphens=False) or [""]
            for c, w in zip(cells, widths, strict=True)
        ]
        for i in range(max(len(w) for w in wrapped)):
            parts = [
                (w[i] if i < len(w) else "").ljust(n) for w, n in zip(wrapped, widths, strict=True)
            ]
            out.append("  ".join(parts).rstrip())
    return out


def entries(current: Mapping[str, tuple[str, bool]]) -> list[dict[str, Any]]:
    """`sluice config --json`: one object per variable, in the reference's order."""
    out = []
    for section in SECTIONS:
        for row in rows(section):
            value, changed = current.get(row.variable, (row.default, False))
            out.append(
                {
                    "variable": row.variable,
                    "section": section.title,
                    "default": row.default,
                    "value": value,
                    "changed": changed,
                    "description": row.description,
                }
            )
    return out


def render_settings_table(
    current: Mapping[str, tuple[str, bool]], width: int = 120, changed_only: bool = False
) -> str:
    """What `sluice config` prints: per section, each variable, its default, its value
    here (`*` where set otherwise) and its description, wrapped to `width` columns."""
    every = [r for s in SECTIONS for r in rows(s)]
    name_w = max(len(r.variable) for r in every)
    default_w = min(22, max(len(r.default) for r in every))
    value_w = min(22, max(len(v) + 2 for v, _ in current.values()))
    widths = (name_w, default_w, value_w, max(30, width - name_w - default_w - value_w - 6))
    lines = _table([("variable", "default", "current", "description")], widths)
    for section in SECTIONS:
        cells = []
        for row in rows(section):
            value, changed = current.get(row.variable, (row.default, False))
            if changed or not changed_only:
                shown = f"* {value}" if changed else value
                cells.append((row.variable, row.default, shown, row.description))
        if cells:
            lines.append(f"\n# {section.title}: read by {section.read_by.replace('`', '')}")
            lines += _table(cells, widths)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_settings_reference())
