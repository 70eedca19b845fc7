#!/usr/bin/env bash
# Install and start `qiip agent`, the live GPU telemetry agent, on a provisioned GPU node. Non-fatal: a node whose
# agent cannot be installed still serves; the step ends with WARN and says why.
#
# Environment (set by the gateway when provisioning.telemetry_agent is on; see qiip_core.provisioning):
#   QIIPNODE_AGENT_PACKAGE       the pip requirement of QIIP installed in /opt/qiip-agent (qiip==0.1.0, a wheel URL)
#   QIIPNODE_PIP_INDEX           the package index
#   QIIPNODE_AGENT_NODE_ID       the node id the readings are published under (the host's name at the gateway)
#   QIIPNODE_AGENT_SETTINGS      the agent's settings, one QIIP_NAME=value per line (registry, etcd, telemetry)
#   agent.token (next to this script, uploaded by the gateway with the embedded registry): the endpoint's token
#
# Result: /etc/qiip/agent.env (mode 600) holds the settings; under systemd the unit qiip-agent.service runs
# `/opt/qiip-agent/bin/qiip agent` (Restart=always); elsewhere it runs in the background like the engine, with
# PID file var/run/qiip-agent.pid and log var/log/qiip-agent.log. Running the script again restarts the agent.
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"

step_start telemetry_agent
warn() {
  step_warn telemetry_agent "$1; the node serves without live GPU telemetry"
  exit 0
}
venv="$ROOT/opt/qiip-agent"
spec="${QIIPNODE_AGENT_PACKAGE:?QIIPNODE_AGENT_PACKAGE is required}"
node_id="${QIIPNODE_AGENT_NODE_ID:?QIIPNODE_AGENT_NODE_ID is required}"
if [[ -x "$venv/bin/qiip" && "$(cat "$venv/.qiip-agent-package" 2>/dev/null)" == "$spec" ]]; then
  echo "$spec already installed in $venv"
else
  python3 -m venv "$venv" || warn "cannot create the virtual environment $venv"
  "$venv/bin/pip" install -q --index-url "${QIIPNODE_PIP_INDEX:-https://pypi.org/simple}" "$spec" ||
    warn "pip could not install $spec"
  printf '%s' "$spec" >"$venv/.qiip-agent-package"
fi

conf_dir="$ROOT/etc/qiip"
env_file="$conf_dir/agent.env"
mkdir -p "$conf_dir" "$ROOT/var/lib/qiip-agent"
umask 077
{
  printf 'QIIP_STATE_DIR=%s\n' "$ROOT/var/lib/qiip-agent"
  printf 'QIIP_TELEMETRY__NODE_ID=%s\n' "$node_id"
  printf '%s\n' "${QIIPNODE_AGENT_SETTINGS:-}"
} >"$env_file.part" && mv "$env_file.part" "$env_file" || warn "cannot write $env_file"
if [[ -f "$here/agent.token" ]]; then
  # The gateway uploaded the endpoint's token (embedded registry) next to this script, mode 600.
  install -m 600 "$here/agent.token" "$conf_dir/agent.token" && rm -f "$here/agent.token" ||
    warn "cannot install the agent's token in $conf_dir"
fi
if grep -q '^QIIP_REGISTRY__BACKEND=embedded' "$env_file" && [[ ! -f "$conf_dir/agent.token" ]]; then
  warn "the embedded registry needs the agent's bearer token in $conf_dir/agent.token (chmod 600)"
fi

if [[ -z "$ROOT" ]] && command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
  unit=/etc/systemd/system/qiip-agent.service
  cat >"$unit.part" <<UNIT
[Unit]
Description=QIIP telemetry agent (live GPU readings through NVML)
Wants=network-online.target
After=network-online.target nvidia-persistenced.service

[Service]
EnvironmentFile=$env_file
ExecStart=$venv/bin/qiip agent
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
UNIT
  mv "$unit.part" "$unit" && chmod 644 "$unit" || warn "cannot write $unit"
  systemctl daemon-reload && systemctl enable qiip-agent.service && systemctl restart qiip-agent.service ||
    warn "systemctl could not start qiip-agent.service"
  step_ok telemetry_agent "qiip-agent.service running as node $node_id"
else
  pid_file="$RUN_DIR/qiip-agent.pid"
  stop_pid_file "$pid_file" 0
  (
    set -a
    . "$env_file"
    set +a
    exec setsid nohup "$venv/bin/qiip" agent >>"$LOG_DIR/qiip-agent.log" 2>&1 </dev/null 9>&-
  ) &
  echo $! >"$pid_file"
  step_ok telemetry_agent "qiip agent running as node $node_id (PID $(cat "$pid_file"), no systemd)"
fi
exit 0
