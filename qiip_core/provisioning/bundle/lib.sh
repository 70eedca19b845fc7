# Shared by every script of the node bundle: step markers, paths under the install root, the OS family.
#
# Each step prints `[STEP:<name>:START]`, then `[STEP:<name>:OK]`, `[STEP:<name>:WARN] <why>` or
# `[STEP:<name>:FAIL] <why>` on stdout, one line each; the gateway maps them to the task's steps. Everything
# else on stdout and stderr is the step's log.
#
# QIIPNODE_ROOT prefixes every path the bundle writes (/opt, /var, /etc); it is empty on a real host.
#
# Every script holds an exclusive flock on the install root's lock ($STATE_DIR/bundle.lock, file descriptor 9)
# for its whole run, so two runs never overlap on a host; a run that finds it held waits QIIPNODE_LOCK_WAIT_S
# seconds, then fails. What a script starts to outlive it (the engine, the agent) closes descriptor 9 first. The
# gateway records each run's process group beside it ($STATE_DIR/runs/<pgid>), so a new operation ends a run whose
# gateway died before it takes the lock.

set -uo pipefail

ROOT="${QIIPNODE_ROOT:-}"
ROOT="${ROOT%/}"
STATE_DIR="$ROOT/var/lib/qiip-node"
RUN_DIR="$ROOT/var/run"
LOG_DIR="$ROOT/var/log"
mkdir -p "$STATE_DIR/done" "$RUN_DIR" "$LOG_DIR"

LOCK_FILE="$STATE_DIR/bundle.lock"
exec 9>>"$LOCK_FILE"
if ! flock -n 9; then
  echo "waiting for the install root's lock $LOCK_FILE: another run of the node bundle holds it"
  if ! flock -w "${QIIPNODE_LOCK_WAIT_S:-60}" 9; then
    echo "the install root's lock $LOCK_FILE is still held after ${QIIPNODE_LOCK_WAIT_S:-60} s by another run;" \
      "is another gateway working on this host?" >&2
    exit 75
  fi
fi

step_start() { printf '[STEP:%s:START]\n' "$1"; }
step_ok() { printf '[STEP:%s:OK]%s\n' "$1" "${2:+ $2}"; }
step_warn() { printf '[STEP:%s:WARN] %s\n' "$1" "$2"; }
step_fail() {
  printf '[STEP:%s:FAIL] %s\n' "$1" "$2"
  exit 1
}

# done_as STEP VALUE: true when STEP was completed before with exactly VALUE (the pinned versions it used).
done_as() { [[ -f "$STATE_DIR/done/$1" && "$(cat "$STATE_DIR/done/$1")" == "$2" ]]; }
mark_done() { printf '%s' "$2" >"$STATE_DIR/done/$1"; }

# The OS family from os-release: rhel (dnf) or debian (apt-get); empty when neither.
os_family() {
  local file="$ROOT/etc/os-release" ids
  [[ -f "$file" ]] || file=/etc/os-release
  ids="$(. "$file" && printf '%s %s' "${ID:-}" "${ID_LIKE:-}")"
  case " $ids " in
    *" rhel "* | *" fedora "* | *" centos "* | *" rocky "* | *" almalinux "*) echo rhel ;;
    *" debian "* | *" ubuntu "*) echo debian ;;
    *) echo "" ;;
  esac
}

# redact_url TEXT: TEXT with the credentials of any scheme://user:password@ URL in it replaced.
redact_url() { printf '%s' "$1" | sed -E 's#([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@[:space:]]+@#\1[redacted]@#g'; }

# lock_holder FILE...: "<pid> <file>" for the first FILE some process holds a lock on (flock, POSIX or OFD, as
# /proc/locks lists them by inode; pid -1 for an OFD lock), or nothing.
lock_holder() {
  local file inode
  for file in "$@"; do
    [[ -e "$file" ]] || continue
    inode="$(stat -c %i "$file" 2>/dev/null)" || continue
    awk -v inode="$inode" -v file="$file" \
      '$2 != "->" { n = split($6, dev, ":"); if (dev[n] == inode) { print $5, file; exit } }' /proc/locks
  done
}

# wait_package_manager FAMILY: wait while another process (an unattended upgrade on a host that just booted, a
# re-imaged host's first-boot update) holds the package manager's locks, at most QIIPNODE_PACKAGE_LOCK_WAIT_S
# seconds (the gateway passes its inactivity deadline less a margin, so the wait ends before it); false after that.
wait_package_manager() {
  local locks holder waited=0 limit="${QIIPNODE_PACKAGE_LOCK_WAIT_S:-600}"
  case "$1" in
    debian) locks=("$ROOT/var/lib/dpkg/lock-frontend" "$ROOT/var/lib/dpkg/lock" "$ROOT/var/lib/apt/lists/lock"
      "$ROOT/var/cache/apt/archives/lock") ;;
    *) locks=("$ROOT/var/lib/rpm/.rpm.lock" "$ROOT/var/lib/dnf/rpmdb_lock.pid" "$ROOT/var/cache/dnf/metadata_lock.pid") ;;
  esac
  holder="$(lock_holder "${locks[@]}")"
  [[ -z "$holder" ]] && return 0
  echo "waiting for the package manager: process ${holder%% *} ($(cat "/proc/${holder%% *}/comm" 2>/dev/null ||
    echo unknown)) holds ${holder#* }"
  while [[ -n "$holder" ]]; do
    if ((waited >= limit)); then
      PACKAGE_LOCK_HOLDER="$holder"
      return 1
    fi
    sleep 1
    waited=$((waited + 1))
    holder="$(lock_holder "${locks[@]}")"
  done
  echo "the package manager is free after ${waited} s"
}

# True when an NVIDIA GPU answers (the driver is loaded and sees at least one device).
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }

# The installed NVIDIA driver version, or nothing.
driver_version() {
  local out
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  # Without a loaded driver nvidia-smi prints a sentence and exits non-zero: that is "no driver".
  out="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null)" || return 0
  printf '%s\n' "$out" | head -n1 | tr -d ' '
}

# stop_pid_file FILE FORCE: stop the process the PID file names (SIGTERM, SIGKILL after 30 s or with FORCE=1).
stop_pid_file() {
  local file="$1" force="$2" pid i
  [[ -f "$file" ]] || return 0
  pid="$(cat "$file")"
  if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
    if [[ "$force" == 1 ]]; then
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
    else
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
      for ((i = 0; i < 300; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -0 "$pid" 2>/dev/null && { kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null; }
    fi
    for ((i = 0; i < 50; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  fi
  rm -f "$file"
}
