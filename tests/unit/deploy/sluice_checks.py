"""What the compose and Kubernetes tests check of a Sluice container: its command line
parses against the real CLI, its SLUICE_* variables are settings of that process and
load, and the YAML validates against a JSON schema kept in deploy/schemas/."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import typer

from sluice.cli import app
from sluice.settings import (
    ENV_PREFIX,
    EngineWorkerSettings,
    GatewaySettings,
    Settings,
    SettingsError,
    load_settings,
)

ROOT = Path(__file__).resolve().parents[3]
SCHEMAS = ROOT / "deploy" / "schemas"

jsonschema_rs = pytest.importorskip(
    "jsonschema_rs",
    reason="jsonschema-rs (installed with schemathesis, the test extra) validates the YAML",
)

# the settings class each command builds (sluice/cli_serving.py, cli_billing.py)
SETTINGS_OF: dict[tuple[str, ...], type[Settings]] = {
    ("gateway",): GatewaySettings,
    ("serve",): GatewaySettings,
    ("worker", "engine"): EngineWorkerSettings,
    ("worker", "batches"): GatewaySettings,
}


def dockerfile_entrypoint(path: Path) -> list[str]:
    """The exec-form ENTRYPOINT of a Dockerfile (the last one, as Docker takes it)."""
    lines = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", path.read_text(), re.MULTILINE)
    assert lines, f"{path.name} has no exec-form ENTRYPOINT"
    entrypoint: list[str] = json.loads(lines[-1])
    return entrypoint


def dockerfile_env(path: Path) -> dict[str, str]:
    """Every `ENV K=V` of a Dockerfile, continuation lines joined."""
    text = path.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV\s+(.*)$", text, re.MULTILINE):
        for key, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", line):
            env[key] = value
    return env


def parse_command(argv: Sequence[str]) -> tuple[str, ...]:
    """Resolve `sluice …` in the CLI's click group and parse its options as click would
    (unknown command, option or bad value: fails); the command path it names."""
    assert argv and argv[0] == "sluice", f"not a sluice command line: {argv}"
    command = typer.main.get_command(app)
    parent = command.make_context("sluice", [], resilient_parsing=True)
    path: list[str] = []
    args = list(argv[1:])
    while _is_group(command):
        assert args, f"{' '.join(argv)}: names a group, not a command"
        name = args.pop(0)
        sub = command.get_command(parent, name)
        assert sub is not None, f"{' '.join(argv)}: no command {name!r}"
        path.append(name)
        if _is_group(sub):
            parent = sub.make_context(name, [], parent=parent, resilient_parsing=True)
        command = sub
    try:
        command.make_context(path[-1], args, parent=parent)
    except Exception as exc:  # click's usage errors (typer may vendor its own click)
        if not hasattr(exc, "format_message"):
            raise
        pytest.fail(f"{' '.join(argv)}: {exc.format_message()}")
    return tuple(path)


def _is_group(command: Any) -> bool:
    return hasattr(command, "get_command") and hasattr(command, "list_commands")


def settings_fields(cls: type[Settings]) -> set[str]:
    return {ENV_PREFIX + name.upper() for name in cls.model_fields}


def check_settings_env(
    command: tuple[str, ...],
    env: Mapping[str, str],
    monkeypatch: pytest.MonkeyPatch,
    ambient: Mapping[str, str] | None = None,
) -> None:
    """Every SLUICE_* variable of `env` is a setting the process reads, and its settings
    load from `ambient` (the image's variables, for every process) plus `env`, values
    read from the environment as the process reads them."""
    cls = SETTINGS_OF.get(command, Settings)
    unknown = {k for k in env if k.startswith(ENV_PREFIX)} - settings_fields(cls)
    assert not unknown, f"sluice {' '.join(command)} reads no {sorted(unknown)} ({cls.__name__})"
    with monkeypatch.context() as m:
        for key in list(os.environ):
            if key.startswith(ENV_PREFIX):
                m.delenv(key)
        for key, value in {**(ambient or {}), **env}.items():
            m.setenv(key, value)
        try:
            load_settings(cls)
        except SettingsError as exc:
            pytest.fail(f"sluice {' '.join(command)}: {exc}")


def validator(schema: Mapping[str, Any]) -> Any:
    return jsonschema_rs.Draft202012Validator(schema)


def errors(validate: Any, instance: Any) -> Iterator[str]:
    for error in validate.iter_errors(instance):
        where = "/".join(str(p) for p in error.instance_path)
        yield f"{where or '<root>'}: {error.message}"
