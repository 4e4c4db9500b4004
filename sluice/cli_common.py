"""What every CLI command shares: settings loaded once, logging set up, JSON output."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from sluice.settings import Settings, SettingsError, load_settings

S = TypeVar("S", bound=Settings)

# every Typer app and sub-app of `sluice` takes these; help uses a wide terminal's width
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 120}

# Every command that reads or writes the data dir takes this flag; unset, the settings
# read SLUICE_DATA_DIR (default ~/.sluice), so both name the same directory.
DataDir = Annotated[
    Path | None,
    typer.Option(
        help="Where models and state live; overrides $SLUICE_DATA_DIR.",
        show_default="~/.sluice",
    ),
]

# the settings field each command-line flag overrides, so a bad value names the flag
FLAGS = {
    "host": "--host",
    "port": "--port",
    "model": "--model",
    "served_model_name": "--served-model-name",
    "dtype": "--dtype",
    "data_dir": "--data-dir",
    "lora_modules": "--lora",
}


def settings_or_exit(cls: type[S], **overrides: Any) -> S:
    """Settings from the environment plus flags; a bad value exits 2 naming its fix."""
    try:
        settings = load_settings(cls, flags=FLAGS, **overrides)
    except SettingsError as exc:
        typer.echo(f"configuration error:\n{exc}", err=True)
        raise typer.Exit(2) from exc
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if settings.log_level != "DEBUG":
        for name, level in QUIETED_LOGGERS.items():
            logging.getLogger(name).setLevel(level)
    return settings


# what narrates routine work at INFO: librdkafka's reconnects, Celery's every task (the
# batch sweep runs every 10 s), Alembic's migration context at every start; their
# warnings and errors still show
QUIETED_LOGGERS = {
    "sluice.bus.kafka.rdkafka": logging.ERROR,
    "celery.app.trace": logging.WARNING,
    "alembic.runtime.migration": logging.WARNING,
}


# storage.db.embedded_url's file; SQLite gives its -wal and -shm files the same mode
EMBEDDED_DB_FILES = ("sluice.db", "sluice.db-wal", "sluice.db-shm")


def secure_data_dir(settings: Settings) -> None:
    """Without SLUICE_DATABASE_URL: make the data dir owner-only (0700) and its SQLite
    file 0600 before anything opens them (it holds tenants, key hashes and usage).
    Created so when missing; an existing dir or file of this user is tightened (the
    dir with a line on stderr).
    """
    if settings.database_url is not None:
        return
    data_dir = settings.data_dir.expanduser()
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(data_dir, 0o700, say=True)
    # created here with its mode, so SQLAlchemy never creates it with the umask's 0644
    os.close(os.open(data_dir / EMBEDDED_DB_FILES[0], os.O_CREAT | os.O_RDWR, 0o600))
    for name in EMBEDDED_DB_FILES:
        if (data_dir / name).exists():
            _tighten(data_dir / name, 0o600, say=False)


def _tighten(path: Path, mode: int, *, say: bool) -> None:
    info = path.stat()
    if info.st_uid != os.getuid() or (stat.S_IMODE(info.st_mode) & 0o077) == 0:
        return
    path.chmod(mode)
    if say:
        typer.echo(f"{path}: made owner-only ({mode:o}): it holds the tenant store", err=True)


def emit_json(payload: Any) -> None:
    typer.echo(json.dumps(payload, indent=2, default=str))


def emit(result: Any, render: Callable[[Any], str], as_json: bool) -> None:
    """A command's result as JSON (`--json`) or as its human rendering."""
    if as_json:
        emit_json(result)
    else:
        typer.echo(render(result))


API_KEY_FILE = "api_key"  # in the data dir: the key `serve` generated, kept across starts


def key_file(settings: Settings) -> Path:
    return settings.data_dir.expanduser() / API_KEY_FILE


def read_key(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def served_key() -> str | None:
    """The key a `sluice serve` on this machine generated (its data dir from
    $SLUICE_DATA_DIR), if there is one to read."""
    try:
        settings = load_settings(Settings)
    except SettingsError:
        return None
    try:
        return read_key(key_file(settings))
    except OSError:  # not ours to read: another user's data dir
        return None
