#!/usr/bin/env bash
# Private database servers for log-based capture (dbtrigger.cdc), started from the
# server binaries already installed, in a directory of your choice, on a port of your
# choice. The shared services on 5432/3306 are never touched or reconfigured.
#
#   scripts/cdc-servers.sh start postgres DIR PORT [-c name=value ...]
#   scripts/cdc-servers.sh stop  postgres DIR
#   scripts/cdc-servers.sh url   postgres DIR PORT     # prints the SQLAlchemy URL
#
# PostgreSQL runs with wal_level=logical (what PgLogicalSource needs), trust auth for
# the local user "postgres" on 127.0.0.1 only, and fsync off (a throw-away server:
# never put data you care about in it). Extra "-c name=value" settings are passed on
# (the tests add max_slot_wal_keep_size experiments at run time with ALTER SYSTEM).
# Run as root, the server runs as the "postgres" user (initdb refuses root).
set -euo pipefail

usage() { sed -n '2,15p' "$0" >&2; exit 64; }
[ $# -ge 2 ] || usage
action=$1; kind=$2; shift 2
[ "$kind" = postgres ] || { echo "cdc-servers: unknown server kind '$kind' (postgres)" >&2; exit 64; }

pg_bin() {
  local dir
  for dir in ${PG_BIN:-} $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r) /usr/local/pgsql/bin; do
    [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ] && { echo "$dir"; return; }
  done
  command -v initdb >/dev/null && { dirname "$(command -v initdb)"; return; }
  echo "cdc-servers: no PostgreSQL server binaries (initdb, pg_ctl) found; install the" \
       "postgresql server package or set PG_BIN" >&2
  exit 69
}

as_owner() { # run a command as the owner of the data directory
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

case $action in
  start)
    [ $# -ge 2 ] || usage
    dir=$1; port=$2; shift 2
    bin=$(pg_bin)
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --no-sync >"$dir/initdb.log"
    fi
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 -o "-p $port -k $dir \
      -c listen_addresses=127.0.0.1 -c wal_level=logical -c max_replication_slots=64 \
      -c max_wal_senders=64 -c fsync=off -c full_page_writes=off \
      $*" start >/dev/null
    echo "postgresql+psycopg://postgres@127.0.0.1:$port/postgres"
    ;;
  stop)
    [ $# -ge 1 ] || usage
    dir=$1
    bin=$(pg_bin)
    if [ -f "$dir/data/postmaster.pid" ]; then
      as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null || true
    fi
    ;;
  url)
    [ $# -ge 2 ] || usage
    echo "postgresql+psycopg://postgres@127.0.0.1:$2/postgres"
    ;;
  *) usage ;;
esac
