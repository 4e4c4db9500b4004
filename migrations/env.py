"""Alembic environment: the engine comes from `storage.db.alembic_config` (no alembic.ini)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from sluice.storage.tables import Base

target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = context.config.attributes.get("engine")
    if engine is None:
        url = context.config.get_main_option("sqlalchemy.url")
        if not url:
            raise RuntimeError("run migrations through `sluice migrate` or storage.db.migrate")
        engine = sa.create_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported")
run_migrations_online()
