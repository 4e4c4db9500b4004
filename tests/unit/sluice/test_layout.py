"""The installed layout: one top-level package, `sluice`, holding every part of the flow.

The repository keeps a folder per part at its root; `sluice/` links each one, so the wheel
installs `sluice.api`, `sluice.engine`, ... and nothing that could clash with another
distribution's top-level package. An import by the old top-level name would still run
from a checkout (the repository root is on `sys.path`) and load a second copy of the
module, so none may remain.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[3]
PARTS = ("api", "bus", "consumers", "engine", "billing", "storage", "tracing", "migrations")


def test_every_part_installs_under_sluice_and_benchmarks_stay_out() -> None:
    packages = find_packages(str(ROOT), include=["sluice*"])
    assert {p.split(".")[0] for p in packages} == {"sluice"}
    for part in PARTS:
        assert f"sluice.{part}" in packages
        link = ROOT / "sluice" / part
        assert link.is_symlink() and link.resolve() == ROOT / part
    assert not any(p.startswith("sluice.benchmarks") for p in packages)


def _parse(path: Path) -> ast.Module:
    source = path.read_text()
    for _ in range(3):
        # CPython 3.11 counts ast.parse's recursion per interpreter, not per thread, so a
        # parse on a thread an earlier test left running throws the count off
        # (SystemError "recursion depth mismatch"); the same parse again succeeds
        with contextlib.suppress(SystemError):
            return ast.parse(source, str(path))
    return ast.parse(source, str(path))


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_code_imports_a_part_by_its_old_top_level_name() -> None:
    roots = [*PARTS, "sluice", "benchmarks", "tests", "scripts"]
    offenders = []
    for folder in roots:
        for path in (ROOT / folder).rglob("*.py"):
            wrong = _top_level_imports(path) & set(PARTS)
            if wrong:
                offenders.append(f"{path.relative_to(ROOT)}: {sorted(wrong)}")
    assert offenders == []
