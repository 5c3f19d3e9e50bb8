#!/usr/bin/env bash
# Private database servers for log-based capture (dbtrigger.cdc), started from the
# server binaries already installed, in a directory of your choice, on a port of your
# choice. The shared services on 5432/3306 are never touched or reconfigured.
#
#   scripts/cdc-servers.sh start postgres DIR PORT [-c name=value ...]
#   scripts/cdc-servers.sh stop  postgres DIR
#   scripts/cdc-servers.sh url   postgres DIR PORT     # prints the SQLAlchemy URL
#   scripts/cdc-servers.sh start mariadb DIR PORT [--name=value ...]
#   scripts/cdc-servers.sh stop  mariadb DIR
#   scripts/cdc-servers.sh url   mariadb DIR PORT
#
# PostgreSQL runs with wal_level=logical (what PgLogicalSource needs), trust auth for
# the local user "postgres" on 127.0.0.1 only, and fsync off (a throw-away server:
# never put data you care about in it). Extra "-c name=value" settings are passed on
# (the tests add max_slot_wal_keep_size experiments at run time with ALTER SYSTEM).
# Run as root, the server runs as the "postgres" user (initdb refuses root).
#
# MariaDB (or MySQL's mysqld, MARIADB_BIN) runs with the binary log BinlogSource needs:
# --log-bin, binlog_format=ROW, binlog_row_image=FULL, binlog_row_metadata=FULL (where
# the server has it), server_id=1, a user root@127.0.0.1 without a password, and
# durability off (innodb_flush_log_at_trx_commit=2, sync_binlog=0). Extra "--name=value"
# options are passed on. Run as root, the server runs as the "mysql" user.
set -euo pipefail

usage() { sed -n '2,27p' "$0" >&2; exit 64; }
[ $# -ge 2 ] || usage
action=$1; kind=$2; shift 2
case $kind in
  postgres|mariadb) ;;
  *) echo "cdc-servers: unknown server kind '$kind' (postgres, mariadb)" >&2; exit 64 ;;
esac

mariadb_bin() { # the server daemon and the datadir initialiser
  local d
  for d in ${MARIADB_BIN:-} /usr/sbin /usr/bin /usr/local/mysql/bin; do
    [ -x "$d/mariadbd" ] && { echo "$d/mariadbd"; return; }
    [ -x "$d/mysqld" ] && { echo "$d/mysqld"; return; }
  done
  echo "cdc-servers: no MariaDB/MySQL server binary (mariadbd) found; install the" \
       "mariadb-server package or set MARIADB_BIN" >&2
  exit 69
}

start_mariadb() {
  local dir=$1 port=$2; shift 2
  local server init owner=""
  server=$(mariadb_bin)
  # A temporary directory of its own: a server that starts deletes every '#sql*' file
  # in its tmpdir as left over from an earlier run, so with the shared /tmp one server
  # starting took the temporary tables from under another's mariadb-install-db
  # ("Could not remove temporary table ... Unknown table 'mysql.tmp_user_sys'", or a
  # crash), now and then when several start at once (parallel test workers).
  mkdir -p "$dir/tmp"
  if [ "$(id -u)" = 0 ]; then owner=mysql; chown mysql "$dir" "$dir/tmp"; fi
  if [ ! -d "$dir/data/mysql" ]; then
    init=$(command -v mariadb-install-db || command -v mysql_install_db || true)
    [ -n "$init" ] || { echo "cdc-servers: mariadb-install-db not found" >&2; exit 69; }
    "$init" --no-defaults --datadir="$dir/data" --tmpdir="$dir/tmp" ${owner:+--user=$owner} \
      --auth-root-authentication-method=normal --skip-test-db >"$dir/install.log" 2>&1 \
      || { cat "$dir/install.log" >&2; rm -rf "$dir/data"; exit 1; }
  fi
  local metadata=--binlog-row-metadata=FULL
  "$server" --no-defaults --help --verbose 2>/dev/null | grep -q '^binlog-row-metadata' || metadata=
  "$server" --no-defaults --datadir="$dir/data" --tmpdir="$dir/tmp" ${owner:+--user=$owner} --port="$port" \
    --bind-address=127.0.0.1 --socket="$dir/mysqld.sock" --pid-file="$dir/mysqld.pid" \
    --log-error="$dir/server.log" --log-bin="$dir/data/binlog" --binlog-format=ROW \
    --binlog-row-image=FULL $metadata --server-id=1 --skip-name-resolve \
    --innodb-buffer-pool-size=64M --innodb-flush-log-at-trx-commit=2 --sync-binlog=0 \
    --max-connections=300 "$@" >/dev/null 2>&1 &
  # Until it listens (its socket and pid file are there), it exits, or 120 s pass: a
  # loaded machine (parallel test workers) can take well over the 30 s this waited.
  local pid=$! deadline=$((SECONDS + 120))
  while [ $SECONDS -lt $deadline ]; do
    if [ -S "$dir/mysqld.sock" ] && [ -f "$dir/mysqld.pid" ]; then
      echo "mysql+pymysql://root@127.0.0.1:$port/mysql"
      return
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "cdc-servers: MariaDB did not listen within 120 s; stopped it (see $dir/server.log)" >&2
    kill -TERM "$pid" 2>/dev/null || true
  else
    echo "cdc-servers: MariaDB exited while starting (see $dir/server.log):" >&2
    tail -n 20 "$dir/server.log" >&2 2>/dev/null || true
  fi
  exit 1
}

stop_mariadb() {
  local dir=$1 pid i
  [ -f "$dir/mysqld.pid" ] || return 0
  pid=$(cat "$dir/mysqld.pid")
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

if [ "$kind" = mariadb ]; then
  case $action in
    start) [ $# -ge 2 ] || usage; start_mariadb "$@" ;;
    stop) [ $# -ge 1 ] || usage; stop_mariadb "$1" ;;
    url) [ $# -ge 2 ] || usage; echo "mysql+pymysql://root@127.0.0.1:$2/mysql" ;;
    *) usage ;;
  esac
  exit 0
fi

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
