"""Reachability checks for the stores behind billing and quotas (used by `sluice doctor`).

Lives here because only `storage/` touches SQL and Redis (docs/architecture.md §3).
"""

from __future__ import annotations

import redis
import sqlalchemy as sa


def check_database(url: str, timeout_s: float = 3.0) -> str:
    """Connect and ask for the server version; raises on failure."""
    connect_args: dict[str, object] = {}
    if url.startswith(("postgresql", "postgres")):
        connect_args["connect_timeout"] = max(1, int(timeout_s))
    engine = sa.create_engine(url, connect_args=connect_args, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "postgresql":
                version = conn.execute(sa.text("show server_version")).scalar_one()
                return f"PostgreSQL {version}"
            conn.execute(sa.text("select 1"))
            return engine.dialect.name
    finally:
        engine.dispose()


def check_redis(url: str, timeout_s: float = 3.0) -> str:
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
        info = client.info("server")
        return f"Redis {info.get('redis_version', '?')}"
    finally:
        client.close()
