# Source me (as root): install Debian's PostgreSQL if missing, start a throwaway server on
# loopback (a free port, or $LORAPLEX_PG_PORT), create a database the tests may wipe, and export
# LORAPLEX_TEST_PG_URL for the PostgreSQL tests (tests/gateway/test_pg*.py). The server and its
# data directory go away when the sourcing shell exits. Returns non-zero, saying why, on failure.
pg_fail() {
  echo "postgres.sh: $*" >&2
  if [ -n "${PG_DATA:-}" ] && [ -f "$PG_DATA/server.log" ]; then tail -n 20 "$PG_DATA/server.log" >&2; fi
  return 1
}

pg_setup() {
  if [ "$(id -u)" != 0 ]; then
    pg_fail "must run as root (installs packages, runs the server as the postgres user)"
    return 1
  fi
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql \
      >/dev/null; } || { pg_fail "apt-get install postgresql failed"; return 1; }
  fi
  local bin port
  bin=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
  port=${LORAPLEX_PG_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
  PG_DATA=$(mktemp -d /tmp/loraplex-pg.XXXXXX)
  PG_CTL="$bin/pg_ctl"
  trap 'runuser -u postgres -- "$PG_CTL" -D "$PG_DATA" -m fast stop >/dev/null 2>&1; rm -rf "$PG_DATA"' EXIT
  chown postgres:postgres "$PG_DATA"
  runuser -u postgres -- "$bin/initdb" -D "$PG_DATA" -A trust -U postgres >/dev/null \
    || { pg_fail "initdb failed"; return 1; }
  runuser -u postgres -- "$bin/pg_ctl" -D "$PG_DATA" -o "-h 127.0.0.1 -p $port -k $PG_DATA" \
    -l "$PG_DATA/server.log" -w -t 60 start >/dev/null || { pg_fail "the server did not start"; return 1; }
  runuser -u postgres -- "$bin/psql" -q -h 127.0.0.1 -p "$port" -U postgres \
    -c "CREATE USER loraplex PASSWORD 'loraplex';" \
    -c "CREATE DATABASE loraplex_test OWNER loraplex;" >/dev/null \
    || { pg_fail "could not create the test database"; return 1; }
  PGPASSWORD=loraplex "$bin/psql" -q -h 127.0.0.1 -p "$port" -U loraplex -d loraplex_test \
    -c "SELECT 1" >/dev/null || { pg_fail "cannot connect as loraplex"; return 1; }
  export LORAPLEX_TEST_PG_URL="postgresql+asyncpg://loraplex:loraplex@127.0.0.1:$port/loraplex_test"
  echo "PostgreSQL test server on 127.0.0.1:$port"
}

pg_setup
