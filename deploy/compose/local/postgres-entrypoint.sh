#!/bin/sh
# The first start makes the cluster (user, password, database from POSTGRES_*); every
# start then runs the server as `postgres`. UTF8 names the encoding: without a locale in
# the image initdb would pick SQL_ASCII, which psycopg hands back as bytes.
# Any other command (psql …) runs as given.
set -eu
if [ "$#" -gt 0 ]; then exec "$@"; fi
as_pg() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:?}" > "$pwfile"
  chown postgres "$pwfile"
  as_pg initdb -D "$PGDATA" -U "${POSTGRES_USER:-postgres}" --pwfile="$pwfile" \
    --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ -n "${POSTGRES_DB:-}" ]; then
    as_pg pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
    as_pg psql -v ON_ERROR_STOP=1 -U "${POSTGRES_USER:-postgres}" -d postgres \
      -c "CREATE DATABASE \"$POSTGRES_DB\""
    as_pg pg_ctl -D "$PGDATA" -m fast -w stop
  fi
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups \
  postgres -D "$PGDATA" -c listen_addresses='*'
