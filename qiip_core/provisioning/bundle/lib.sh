# Shared by every script of the node bundle: step markers, paths under the install root, the OS family.
#
# Each step prints `[STEP:<name>:START]`, then `[STEP:<name>:OK]`, `[STEP:<name>:WARN] <why>` or
# `[STEP:<name>:FAIL] <why>` on stdout, one line each; the gateway maps them to the task's steps. Everything
# else on stdout and stderr is the step's log.
#
# QIIPNODE_ROOT prefixes every path the bundle writes (/opt, /var, /etc); it is empty on a real host.

set -uo pipefail

ROOT="${QIIPNODE_ROOT:-}"
ROOT="${ROOT%/}"
STATE_DIR="$ROOT/var/lib/qiip-node"
RUN_DIR="$ROOT/var/run"
LOG_DIR="$ROOT/var/log"
mkdir -p "$STATE_DIR/done" "$RUN_DIR" "$LOG_DIR"

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
