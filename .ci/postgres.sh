# Source me: install (Debian's packages) and start a throwaway PostgreSQL on 127.0.0.1:5433,
# then export LORAPLEX_TEST_PG_URL for tests/gateway/test_pg.py. Stopped when the shell exits.
pg_setup() {
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql \
      >/dev/null || return 1
  fi
  local bin
  bin=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
  PG_DATA=$(mktemp -d /tmp/loraplex-pg.XXXXXX)
  chown postgres:postgres "$PG_DATA"
  runuser -u postgres -- "$bin/initdb" -D "$PG_DATA" -A trust -U postgres >/dev/null || return 1
  runuser -u postgres -- "$bin/pg_ctl" -D "$PG_DATA" -o "-h 127.0.0.1 -p 5433 -k /tmp" \
    -l "$PG_DATA/server.log" -w start >/dev/null || return 1
  PG_CTL="$bin/pg_ctl"
  trap 'runuser -u postgres -- "$PG_CTL" -D "$PG_DATA" -m fast stop >/dev/null 2>&1' EXIT
  runuser -u postgres -- psql -q -h 127.0.0.1 -p 5433 -U postgres \
    -c "CREATE USER loraplex PASSWORD 'loraplex';" \
    -c "CREATE DATABASE loraplex_test OWNER loraplex;" >/dev/null || return 1
  export LORAPLEX_TEST_PG_URL=postgresql+asyncpg://loraplex:loraplex@127.0.0.1:5433/loraplex_test
}
if pg_setup; then
  echo "PostgreSQL test server on 127.0.0.1:5433"
else
  echo "WARNING: could not start PostgreSQL; the PostgreSQL tests will be skipped" >&2
fi
