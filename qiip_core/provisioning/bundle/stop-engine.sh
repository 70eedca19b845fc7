#!/usr/bin/env bash
# Stop the engine: `stop-engine.sh llamacpp|vllm|ollama [--force]` (SIGTERM to its process group, SIGKILL after
# 30 s; --force: SIGKILL at once). Stopping an engine that is not running succeeds. Ollama's model store under the
# install root (var/lib/ollama, OLLAMA_MODELS) goes with its daemon: QIIP pushes the model again at the next setup.
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
force=0
[[ "${2:-}" == "--force" ]] && force=1
stop_pid_file "$RUN_DIR/$1.pid" "$force"
if [[ "$1" == ollama ]]; then
  rm -rf "$ROOT/var/lib/ollama" || { echo "cannot free the Ollama store $ROOT/var/lib/ollama" >&2; exit 1; }
  echo "# Freed: $ROOT/var/lib/ollama"
fi
echo "# Stopped: $1"
