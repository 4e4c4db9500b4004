"""Connecting to the billing database and migrating it (PostgreSQL or embedded SQLite).

Embedded mode keeps `sluice.db` in the data dir, in WAL mode with a busy timeout so the
CLI can write while `sluice serve` runs. Migrations are Alembic's, configured in code
(no `alembic.ini`, no working-directory assumption): `migrate(engine)`.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.orm import Session, sessionmaker

from sluice.storage.errors import StoreUnavailable

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 5000


def embedded_url(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / 'sluice.db'}"


def make_engine(url: str, *, echo: bool = False) -> sa.Engine:
    """An engine for `url`; SQLite gets WAL, foreign keys and a busy timeout."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            url, echo=echo, connect_args={"check_same_thread": False, "timeout": 5}
        )
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return sa.create_engine(url, echo=echo, pool_pre_ping=True, pool_size=10, max_overflow=10)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def alembic_config(engine: sa.Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    return config


def migrate(engine: sa.Engine, revision: str = "head") -> None:
    command.upgrade(alembic_config(engine), revision)


def downgrade(engine: sa.Engine, revision: str = "base") -> None:
    command.downgrade(alembic_config(engine), revision)


def is_current(engine: sa.Engine) -> bool:
    head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() == head


def ensure_migrated(engine: sa.Engine) -> None:
    """Migrate when behind (embedded first use); cheap when already at head."""
    with _migration_lock(engine):
        if not is_current(engine):
            logger.info("migrating billing database %s", engine.url.render_as_string())
            migrate(engine)


@contextmanager
def _migration_lock(engine: sa.Engine) -> Iterator[None]:
    """One migrating process at a time on an embedded database: `sluice up` starts the
    billing and quota workers together, and the second to migrate failed on a table the
    first had just made. PostgreSQL's migrations run once, by `sluice migrate`."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if not path or path == ":memory:":
        yield
        return
    lock = os.open(f"{path}.migrate-lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
    finally:
        os.close(lock)


class Database:
    """An engine plus a session factory; `session()` commits or rolls back."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def connect(cls, url: str, *, migrate_if_needed: bool = False) -> Database:
        engine = make_engine(url)
        if migrate_if_needed:
            ensure_migrated(engine)
        return cls(engine)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: committed when the block returns, rolled back when it raises.

        Connection-level failures become `StoreUnavailable` (retryable).
        """
        try:
            with self._sessions.begin() as session:
                yield session
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            raise StoreUnavailable(f"billing database unavailable: {exc.orig}") from exc

    def close(self) -> None:
        self.engine.dispose()
