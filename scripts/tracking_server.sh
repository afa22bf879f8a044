#!/usr/bin/env bash
# A shared MLflow tracking server on this machine: PostgreSQL as the backend store (many writers, several
# server workers; the default SQLite file locks under concurrent runs) and artifacts served by the server
# itself (clients upload/download through HTTP as `mlflow-artifacts:/`, so they need no shared filesystem).
#
#   scripts/tracking_server.sh start  [DIR]   # initdb on first use, start PostgreSQL + mlflow server, wait for /health
#   scripts/tracking_server.sh stop   [DIR]   # stop both
#   scripts/tracking_server.sh status [DIR]   # exit 0 when both are up
#   scripts/tracking_server.sh check          # exit 3 without PostgreSQL server binaries, 4 without psycopg2
#
# DIR (default .tracking-server) holds everything: pg/ (the cluster), artifacts/, the logs and pid files.
# Environment: PG_PORT (5433), MLFLOW_PORT (5001), MLFLOW_WORKERS (2: this machine has 2 cores),
# MLFLOW_START_TIMEOUT (180 s: the first start runs MLflow's schema migrations), PG_BIN (PostgreSQL's bin
# folder, found automatically otherwise). Both services listen on 127.0.0.1 only; PostgreSQL trusts loopback
# connections (no password), which is acceptable for a server bound to loopback on a single-user box.
set -euo pipefail

CMD=${1:-}
DIR=${2:-.tracking-server}
PG_PORT=${PG_PORT:-5433}
MLFLOW_PORT=${MLFLOW_PORT:-5001}
MLFLOW_WORKERS=${MLFLOW_WORKERS:-2}
MLFLOW_START_TIMEOUT=${MLFLOW_START_TIMEOUT:-180}
PG_SUPERUSER=postgres # fixed superuser name (initdb -U), so the connection URI does not depend on who runs this
PG_DATABASE=mlflow

die() {
  echo "tracking_server: error: $*" >&2
  exit "${EXIT_CODE:-1}"
}
say() { echo "tracking_server: $*" >&2; }

usage() {
  sed -n '6,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# PostgreSQL's server binaries (initdb, pg_ctl, postgres) are not on PATH on Debian: they live in
# /usr/lib/postgresql/<version>/bin (some images symlink them into /usr/local/bin). Take the first folder
# that has all three: $PG_BIN, then pg_ctl on PATH, then pg_config's bindir (pg_config comes with libpq-dev
# even without the server, hence the check), then the newest Debian version, then a source build.
find_pg_bin() {
  local candidates=() d
  [[ -n ${PG_BIN:-} ]] && candidates+=("$PG_BIN")
  if command -v pg_ctl >/dev/null 2>&1; then
    candidates+=("$(dirname "$(readlink -f "$(command -v pg_ctl)")")")
  fi
  if command -v pg_config >/dev/null 2>&1; then
    candidates+=("$(pg_config --bindir 2>/dev/null || true)")
  fi
  while IFS= read -r d; do candidates+=("$d"); done < <(printf '%s\n' /usr/lib/postgresql/*/bin | sort -rV)
  candidates+=(/usr/local/pgsql/bin)
  for d in "${candidates[@]}"; do
    if [[ -x $d/initdb && -x $d/pg_ctl && -x $d/postgres ]]; then
      echo "$d"
      return 0
    fi
  done
  return 1
}

require_pg_bin() {
  PG_BIN=$(find_pg_bin) || EXIT_CODE=3 die "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found" \
    "(looked at \$PG_BIN, PATH, pg_config --bindir, /usr/lib/postgresql/*/bin, /usr/local/pgsql/bin)." \
    "On Debian/Ubuntu install them with: apt-get install -y postgresql   (or set PG_BIN to their folder)"
  PSQL=$PG_BIN/psql
  [[ -x $PSQL ]] || PSQL=$(command -v psql) || EXIT_CODE=3 die "psql not found; apt-get install -y postgresql"
}

# The mlflow of the active environment (the Makefile puts .venv/bin first on PATH), and the python next to
# it, which must import psycopg2 for the postgresql+psycopg2:// backend URI.
require_mlflow() {
  MLFLOW=$(command -v mlflow) || die "mlflow not on PATH: activate the project's venv (source .venv/bin/activate)"
  PY=$(dirname "$MLFLOW")/python
  [[ -x $PY ]] || PY=$(command -v python3)
  "$PY" -c 'import psycopg2' 2>/dev/null || EXIT_CODE=4 die "$PY cannot import psycopg2 (the PostgreSQL driver" \
    "MLflow needs): pip install -r requirements.txt (it pins psycopg2-binary)"
}

# PostgreSQL refuses to run as root ("root execution of the PostgreSQL server is not permitted"). As root
# (CI, containers) the cluster is owned by and run as the unprivileged `postgres` user, created by the
# Debian package (or here, if a source build left none); runuser needs no password and no login shell.
# The alternative, a dedicated user per checkout, would leave accounts behind for no gain.
as_pg() {
  if [[ $EUID -eq 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

ensure_pg_user() {
  [[ $EUID -eq 0 ]] || return 0
  id postgres >/dev/null 2>&1 && return 0
  say "creating the system user postgres (PostgreSQL cannot run as root)"
  useradd --system --no-create-home --shell /usr/sbin/nologin postgres
}

port_in_use() { # something already listens on 127.0.0.1:$1
  "${PY:-python3}" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
s.settimeout(1)
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
EOF
}

http_ok() { # GET $1 answers 2xx
  if command -v curl >/dev/null 2>&1; then
    curl -fsS -o /dev/null --max-time 5 "$1" 2>/dev/null
  else
    "${PY:-python3}" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" 2>/dev/null
  fi
}

mlflow_pid() { # the pid in mlflow.pid if that process is still an mlflow server (not a recycled pid)
  local pid
  [[ -f $DIR/mlflow.pid ]] || return 1
  pid=$(<"$DIR/mlflow.pid")
  grep -qa mlflow "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

pg_running() { [[ -f $PGDATA/postmaster.pid ]] && as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; }

load_saved_ports() { # stop/status use the ports the server was started with, whatever the environment says now
  if [[ -f $DIR/server.env ]]; then
    # shellcheck disable=SC1091
    source "$DIR/server.env"
  fi
}

start_pg() {
  ensure_pg_user
  if [[ ! -f $PGDATA/PG_VERSION ]]; then
    mkdir -p "$PGDATA"
    chmod 700 "$PGDATA"
    if [[ $EUID -eq 0 ]]; then
      chown postgres: "$PGDATA"
      # The postgres user must be able to walk down to DIR: under /root or pytest's 0700 folders it cannot.
      runuser -u postgres -- test -w "$PGDATA" || die "the postgres user cannot reach $PGDATA (a parent folder" \
        "is not traversable by other users). Use a DIR under a world-traversable path, e.g. /var/tmp/mlflow-tracking"
    fi
    say "initdb $PGDATA"
    # --no-locale: C collation, so the cluster does not depend on which locales the image generated.
    as_pg "$PG_BIN/initdb" -D "$PGDATA" -U "$PG_SUPERUSER" --auth=trust --encoding=UTF8 --no-locale \
      >"$DIR/initdb.log" 2>&1 || die "initdb failed, see $DIR/initdb.log"
    # Loopback TCP only; no unix socket, so neither the system's /var/run/postgresql nor a socket path
    # length limit (107 bytes, easy to hit under deep tmp folders) gets in the way.
    cat >>"$PGDATA/postgresql.conf" <<EOF

# scripts/tracking_server.sh
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
EOF
  fi
  if pg_running; then
    say "PostgreSQL already running ($PGDATA)"
  else
    touch "$DIR/postgres.log"
    [[ $EUID -eq 0 ]] && chown postgres: "$DIR/postgres.log"
    say "starting PostgreSQL on 127.0.0.1:$PG_PORT"
    as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$DIR/postgres.log" -o "-p $PG_PORT" -w -t 60 start >/dev/null ||
      die "PostgreSQL did not start, see $DIR/postgres.log"
  fi
  local psql=("$PSQL" -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" -v ON_ERROR_STOP=1 -qtA)
  if [[ -z $("${psql[@]}" -d postgres -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DATABASE'") ]]; then
    "${psql[@]}" -d postgres -c "CREATE DATABASE $PG_DATABASE" || die "could not create database $PG_DATABASE"
  fi
}

start_mlflow() {
  local uri=http://127.0.0.1:$MLFLOW_PORT pid deadline
  if pid=$(mlflow_pid); then
    say "mlflow server already running (pid $pid)"
  else
    mkdir -p "$DIR/artifacts"
    say "starting mlflow server on $uri ($MLFLOW_WORKERS workers), log: $DIR/mlflow.log"
    # MLflow 3's job runner (GenAI scorers, trace roll-ups) starts about eight huey worker processes;
    # training runs never use it, and on 2 cores it slows start-up. Off unless the caller turns it on.
    export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}
    # setsid: its own session and process group (pid = pgid), so `stop` can end the workers with it and a
    # closing terminal does not take it down. No --default-artifact-root: with --serve-artifacts new
    # experiments then get mlflow-artifacts:/ locations, i.e. clients go through this server for files.
    setsid "$MLFLOW" server \
      --backend-store-uri "postgresql+psycopg2://$PG_SUPERUSER@127.0.0.1:$PG_PORT/$PG_DATABASE" \
      --serve-artifacts --artifacts-destination "$DIR/artifacts" \
      --host 127.0.0.1 --port "$MLFLOW_PORT" --workers "$MLFLOW_WORKERS" \
      </dev/null >"$DIR/mlflow.log" 2>&1 &
    echo $! >"$DIR/mlflow.pid"
  fi
  deadline=$((SECONDS + MLFLOW_START_TIMEOUT))
  until http_ok "$uri/health"; do
    mlflow_pid >/dev/null || die "mlflow server exited during start-up, see $DIR/mlflow.log:
$(tail -n 20 "$DIR/mlflow.log")"
    ((SECONDS < deadline)) || die "mlflow server did not answer $uri/health within ${MLFLOW_START_TIMEOUT}s" \
      "(raise MLFLOW_START_TIMEOUT on a busy machine), see $DIR/mlflow.log; '$0 stop $DIR' stops what started"
    sleep 1
  done
}

stop_mlflow() {
  local pid _
  if pid=$(mlflow_pid); then
    say "stopping mlflow server (pid $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || true # the whole process group: the server and its workers
    for _ in $(seq 30); do
      kill -0 -- "-$pid" 2>/dev/null || break
      sleep 1
    done
    kill -KILL -- "-$pid" 2>/dev/null || true # still there after 30 s: do not leave workers holding the port
  fi
  rm -f "$DIR/mlflow.pid"
}

stop_pg() {
  if pg_running; then
    say "stopping PostgreSQL ($PGDATA)"
    as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -m fast -w -t 60 stop >/dev/null
  fi
}

case $CMD in
  start)
    require_pg_bin
    require_mlflow
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd) # absolute: pg_ctl and the server get paths that do not depend on the cwd
    PGDATA=$DIR/pg
    if pg_running || mlflow_pid >/dev/null; then
      load_saved_ports # a server already running in DIR keeps the ports it was started with
    fi
    # Both ports are checked before anything starts, so a clash leaves nothing half started. Without the
    # check, /health could also be answered by someone else's server on MLFLOW_PORT.
    if ! pg_running && port_in_use "$PG_PORT"; then
      die "port $PG_PORT is taken by another process; set PG_PORT to a free port"
    fi
    if ! mlflow_pid >/dev/null && port_in_use "$MLFLOW_PORT"; then
      die "port $MLFLOW_PORT is taken by another process; set MLFLOW_PORT to a free port"
    fi
    printf 'PG_PORT=%s\nMLFLOW_PORT=%s\n' "$PG_PORT" "$MLFLOW_PORT" >"$DIR/server.env"
    start_pg
    start_mlflow
    say "ready: PostgreSQL 127.0.0.1:$PG_PORT (database $PG_DATABASE), artifacts in $DIR/artifacts"
    echo "export MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT"
    ;;
  stop | status)
    [[ -d $DIR ]] || {
      say "nothing in $DIR"
      [[ $CMD == stop ]] && exit 0 || exit 3
    }
    DIR=$(cd "$DIR" && pwd)
    PGDATA=$DIR/pg
    load_saved_ports
    require_pg_bin
    if [[ $CMD == stop ]]; then
      stop_mlflow
      stop_pg
      exit 0
    fi
    up=0
    if pid=$(mlflow_pid) && http_ok "http://127.0.0.1:$MLFLOW_PORT/health"; then
      echo "mlflow server: running (pid $pid), MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT"
    else
      echo "mlflow server: not running"
      up=3
    fi
    if pg_running; then
      echo "PostgreSQL: running on 127.0.0.1:$PG_PORT ($PGDATA)"
    else
      echo "PostgreSQL: not running"
      up=3
    fi
    exit $up
    ;;
  check)
    require_pg_bin
    require_mlflow
    echo "PostgreSQL binaries: $PG_BIN; mlflow: $MLFLOW; psycopg2: importable"
    ;;
  *) usage ;;
esac
