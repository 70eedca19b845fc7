#!/usr/bin/env bash
# Stop the engine: `stop-engine.sh llamacpp|vllm|ollama [--force]` (SIGTERM to its process group, SIGKILL after
# 30 s; --force: SIGKILL at once). Stopping an engine that is not running succeeds. The store of QIIP's Ollama
# daemon ($STATE_DIR/ollama, its OLLAMA_MODELS) goes once the daemon has: QIIP pushes the model again at the next
# setup. A host's own Ollama store (/var/lib/ollama) is never touched.
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
force=0
[[ "${2:-}" == "--force" ]] && force=1
stop_pid_file "$RUN_DIR/$1.pid" "$force"
if [[ "$1" == ollama ]]; then
  store="$STATE_DIR/ollama"
  rm -rf "$store" || { echo "cannot free QIIP's Ollama store $store" >&2; exit 1; }
  echo "# Freed: $store"
fi
echo "# Stopped: $1"
