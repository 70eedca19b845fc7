#!/usr/bin/env bash
# Start the engine in the background: `start-engine.sh llamacpp -- <llama-server argv without the program>`,
# `start-engine.sh vllm -- <vllm serve argv>` or `start-engine.sh ollama -- OLLAMA_NAME=value...` (`ollama serve`
# with that environment; the binary is the one setup.sh's ollama_install step recorded). A running engine of that
# kind is stopped first. The PID file is var/run/<engine>.pid and the log var/log/<engine>-serve.log under the
# install root.
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
engine="$1"
shift
[[ "${1:-}" == "--" ]] && shift
pid_file="$RUN_DIR/$engine.pid"
log="$LOG_DIR/$engine-serve.log"
case "$engine" in
  llamacpp)
    variant="${QIIPNODE_PROFILE:-cuda}"
    binary="$ROOT/opt/llama.cpp/${QIIPNODE_LLAMACPP_VERSION:?}-$variant/bin/llama-server"
    ;;
  vllm) binary="$ROOT/opt/vllm-venv/bin/vllm" ;;
  ollama)
    binary="$(cat "$STATE_DIR/ollama-binary" 2>/dev/null)"
    for assignment in "$@"; do
      [[ "$assignment" =~ ^OLLAMA_[A-Z_]+= ]] || { echo "not an Ollama setting: $assignment" >&2; exit 2; }
    done
    ;;
  *) echo "unknown engine $engine" >&2; exit 2 ;;
esac
[[ -n "$binary" && -x "$binary" ]] || { echo "${binary:-$engine} is not installed; run setup first" >&2; exit 1; }
stop_pid_file "$pid_file" 0
: >"$log"
alias="${QIIPNODE_MODEL_ALIAS:-unknown}"
# llama-server reads LLAMA_ARG_* variables; every sizing flag is on the command line, so none may override it. The
# bundle's own QIIPNODE_* settings (a package index URL may hold credentials) stay out of the engine's environment.
# Ollama's OLLAMA_* variables of the host's own setup stay out too: the daemon runs with QIIP's alone.
for name in $(compgen -e | grep -E '^(LLAMA_ARG_|QIIPNODE_|OLLAMA_)' || true); do unset "$name"; done
command=("$binary" "$@")
if [[ "$engine" == ollama ]]; then
  # Exported, not given to env(1): a path with '=' in it would read as one more assignment there.
  export "$@"
  command=("$binary" serve)
  # Ollama answers whoever holds the port: with another daemon there (the host's own, a leftover), QIIP's would fail
  # to bind and the setup would go on against the other one. Refused instead.
  listen="${OLLAMA_HOST%:*}"
  listen="${listen#[}"
  listen="${listen%]}"
  [[ "$listen" == 0.0.0.0 || "$listen" == :: || -z "$listen" ]] && listen=127.0.0.1
  if timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$listen" "${OLLAMA_HOST##*:}" 2>/dev/null; then
    echo "port ${OLLAMA_HOST##*:} on $listen is taken by another process; stop it (the host's own Ollama?) first" >&2
    exit 1
  fi
fi
export GGML_NO_BACKTRACE=1
# Descriptor 9 (the install root's lock) is closed: the engine outlives this run and must not hold it.
setsid nohup "${command[@]}" >>"$log" 2>&1 </dev/null 9>&- &
echo $! >"$pid_file"
echo "# Model: $alias"
echo "# PID: $(cat "$pid_file") log: $log"
