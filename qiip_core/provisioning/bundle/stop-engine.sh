#!/usr/bin/env bash
# Stop the engine: `stop-engine.sh llamacpp|vllm [--force]` (SIGTERM to its process group, SIGKILL after 30 s;
# --force: SIGKILL at once). Stopping an engine that is not running succeeds.
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
force=0
[[ "${2:-}" == "--force" ]] && force=1
stop_pid_file "$RUN_DIR/$1.pid" "$force"
echo "# Stopped: $1"
