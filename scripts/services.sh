#!/usr/bin/env bash
# Make sure PostgreSQL and MariaDB are up on 127.0.0.1; start them if they are down.
# The integration tests need both: a missing service is a failure, never a skip.
set -uo pipefail

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null || python3 - <<'PY' 2>/dev/null
import socket; socket.create_connection(("127.0.0.1", 5432), 1).close()
PY
}
maria_up() { mysqladmin -uroot -h127.0.0.1 ping >/dev/null 2>&1 || python3 - <<'PY' 2>/dev/null
import socket; socket.create_connection(("127.0.0.1", 3306), 1).close()
PY
}

wait_for() { # name check
  for _ in $(seq 1 60); do "$2" && return 0; sleep 0.5; done
  echo "services: $1 did not come up" >&2; return 1
}

status=0
if ! pg_up; then
  echo "services: starting PostgreSQL"
  if ls /etc/postgresql >/dev/null 2>&1; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
  wait_for PostgreSQL pg_up || status=1
fi
if ! maria_up; then
  echo "services: starting MariaDB"
  if [ -x /usr/sbin/mariadbd ]; then
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
  fi
  wait_for MariaDB maria_up || status=1
fi
exit $status
