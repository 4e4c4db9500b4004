"""What every CLI command shares: settings loaded once, logging set up, JSON output."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from sluice.settings import Settings, SettingsError, load_settings

S = TypeVar("S", bound=Settings)


def settings_or_exit(cls: type[S], **overrides: Any) -> S:
    """Settings from the environment plus flags; a bad value exits 2 naming its fix."""
    try:
        settings = load_settings(cls, **overrides)
    except SettingsError as exc:
        typer.echo(f"configuration error:\n{exc}", err=True)
        raise typer.Exit(2) from exc
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if settings.log_level != "DEBUG":
        # librdkafka's own log (bus.kafka.rdkafka) narrates reconnects; keep its errors
        logging.getLogger("bus.kafka.rdkafka").setLevel(logging.ERROR)
    return settings


def emit_json(payload: Any) -> None:
    typer.echo(json.dumps(payload, indent=2, default=str))


def emit(result: Any, render: Callable[[Any], str], as_json: bool) -> None:
    """A command's result as JSON (`--json`) or as its human rendering."""
    if as_json:
        emit_json(result)
    else:
        typer.echo(render(result))
