from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qiip_core import ConfigError
from qiip_core.config import load_settings

pytestmark = pytest.mark.usefixtures("clean_env")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "qiip.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    settings = load_settings()
    assert settings.routing.max_attempts == 3
    assert settings.server.max_body_bytes == 32 * 1024 * 1024
    assert settings.upstream.keepalive_expiry_s < 5
    assert settings.registry.backend == "embedded"


def test_toml_file_and_env_nesting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(
        tmp_path,
        """
[routing]
max_attempts = 2
allowed_endpoint_hosts = ["*.lab"]

[health]
interval_s = 2.5

[[nodes]]
id = "gpu01"
endpoint = "http://gpu01.lab:8000"
model = "org/model"
engine = "llama_cpp"
""",
    )
    monkeypatch.setenv("QIIP_ROUTING__ALLOWED_ENDPOINT_PORTS", "[8001,8002]")
    monkeypatch.setenv("QIIP_HEALTH__FAILURE_THRESHOLD", "5")
    settings = load_settings(config)
    assert settings.routing.max_attempts == 2
    assert settings.routing.allowed_endpoint_ports == [8001, 8002]
    assert settings.routing.allowed_endpoint_hosts == ["*.lab"]
    assert settings.health.interval_s == 2.5 and settings.health.failure_threshold == 5
    assert settings.nodes[0].engine.value == "llama_cpp"


def test_env_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(tmp_path, "[routing]\nmax_attempts = 2\n")
    monkeypatch.setenv("QIIP_ROUTING__MAX_ATTEMPTS", "4")
    assert load_settings(config).routing.max_attempts == 4


def test_invalid_value_names_setting_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QIIP_ROUTING__MAX_ATTEMPTS", "0")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "routing.max_attempts (QIIP_ROUTING__MAX_ATTEMPTS)" in info.value.message
    assert "greater than or equal to 1" in info.value.message


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "[routing]\nmax_atempts = 2\n"))
    assert "routing.max_atempts: unknown setting" in info.value.message


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as bad:
        load_settings(write(tmp_path, "[routing\n"))
    assert "not valid TOML" in bad.value.message
    with pytest.raises(ConfigError) as missing:
        load_settings(tmp_path / "nope.toml")
    assert "does not exist" in missing.value.message


@pytest.mark.parametrize(
    ("env", "value", "fragment"),
    [
        ("QIIP_ROUTING__ALLOWED_ENDPOINT_NETWORKS", '["10.0.0.0/33"]', "not a CIDR network"),
        ("QIIP_ROUTING__ALLOWED_ENDPOINT_PORTS", "[0]", "routing.allowed_endpoint_ports.0"),
        (
            "QIIP_ROUTING__ALLOWED_ENDPOINT_PORTS",
            "8001,8002",
            "could not be parsed: QIIP_ROUTING__ALLOWED_ENDPOINT_PORTS",
        ),
        ("QIIP_LOGGING__LEVEL", "LOUD", "logging.level"),
        ("QIIP_UPSTREAM__CONNECT_TIMEOUT_S", "-1", "upstream.connect_timeout_s"),
        ("QIIP_ENGINES__LLAMACPP__SHA256", "xyz", "64 hexadecimal"),
        ("QIIP_PROVISIONING__OLLAMA_SHA256", "ABC", "provisioning.ollama_sha256 (QIIP_PROVISIONING__OLLAMA_SHA256)"),
        ("QIIP_PROVISIONING__OLLAMA_VERSION", "v0.9.6", "is not a version: digits first"),
        ("QIIP_PROVISIONING__OLLAMA_VERSION", "0.9;reboot", "is not a version"),
        ("QIIP_PROVISIONING__OLLAMA_VERSION", "0.9.6\n", "is not a version"),
        ("QIIP_PROVISIONING__OLLAMA_SHA256", "a" * 64 + "\n", "provisioning.ollama_sha256"),
        *(
            ("QIIP_PROVISIONING__OLLAMA_URL_TEMPLATE", template, f"(QIIP_PROVISIONING__OLLAMA_URL_TEMPLATE): {why}")
            for template, why in (
                ("https://mirror.lab/ollama-{version}-{arch}.zip", "it must contain {version} and its path end"),
                ("https://mirror.lab/ollama-linux-{arch}.tgz", "it must contain {version}"),
                ("ollama-{version}.tgz", "it must be an http:// or https:// URL with a host"),
                ("file:///srv/ollama-{version}.tgz", "it must be an http:// or https:// URL with a host"),
                ("https://mirror.lab/{os}/ollama-{version}.tgz", "it may name only {version} and {arch} in braces"),
                ("https://mirror.lab/ollama-{version}.tgz{", "it may name only {version} and {arch} in braces"),
                ("https://mirror.lab/ollama-{version:>8}-{arch}.tgz", "it may name only {version} and {arch}"),
                ("https://mirror.lab/ollama-{{version}}-{arch}.tgz", "it may name only {version} and {arch}"),
                ("https://mirror.lab/ollama-{version}-{arch!s}.tgz", "it may name only {version} and {arch}"),
            )
        ),
    ],
)
def test_invalid_values(monkeypatch: pytest.MonkeyPatch, env: str, value: str, fragment: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert fragment in info.value.message


def test_json_or_toml_nested_too_deeply_is_refused_naming_where(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="config file .* nests arrays or tables too deeply"):
        load_settings(write(tmp_path, "a = " + "[" * 1500))
    monkeypatch.setenv("QIIP_ROUTING__ALLOWED_ENDPOINT_PORTS", "[" * 1500)
    with pytest.raises(ConfigError, match="QIIP_ROUTING__ALLOWED_ENDPOINT_PORTS nests JSON .* too deeply"):
        load_settings()


def test_duplicate_node_ids(tmp_path: Path) -> None:
    text = '[[nodes]]\nid="a"\nendpoint="http://127.0.0.1:1"\nmodel="m"\n' * 2
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    assert "declared twice" in info.value.message


def test_every_setting_is_documented_in_env_example() -> None:
    from qiip_core.config import Settings

    example = (Path(__file__).parents[3] / ".env.example").read_text()
    missing = [name for name in _env_names(Settings) if name not in example]
    assert missing == []


def _env_names(model: type, prefix: str = "QIIP_") -> list[str]:
    from pydantic import BaseModel

    names = []
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += _env_names(annotation, f"{prefix}{name.upper()}__")
        else:
            names.append(f"{prefix}{name.upper()}")
    return names


@pytest.mark.parametrize(("value", "fragment"), [("", "state_dir is empty"), ("state", "is relative")])
def test_state_dir_must_be_absolute(monkeypatch: pytest.MonkeyPatch, value: str, fragment: str) -> None:
    monkeypatch.setenv("QIIP_STATE_DIR", value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert fragment in info.value.message


def test_state_dir_expands_the_home_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QIIP_STATE_DIR", "~/qiip-state")
    assert load_settings().state_dir.is_absolute()


def test_a_dotenv_shared_with_the_console_is_fine(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("QIIP_URL=http://127.0.0.1:9000\nQIIP_TOKEN=t\nQIIP_ROUTING__MAX_ATTEMPTS=2\n")
    assert load_settings().routing.max_attempts == 2


def test_a_bad_value_from_the_environment_is_not_blamed_on_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QIIP_HEALTH__INTERVAL_S", "-1")
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "[routing]\nmax_attempts = 2\n"))
    assert info.value.message.startswith("Invalid settings:") and "QIIP_HEALTH__INTERVAL_S" in info.value.message


def test_server_keeps_idle_connections_longer_than_load_balancers_and_has_cors_off() -> None:
    server = load_settings().server
    assert server.keep_alive_s >= 75  # above AWS ALB's 60 s idle timeout, nginx's 75 s keepalive_timeout
    assert server.cors_allow_origins == []


def test_keep_alive_and_cors_origins_from_the_file(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        '[server]\nkeep_alive_s = 620\ncors_allow_origins = ["https://app.example.com", "http://[::1]:3000", "*"]\n',
    )
    server = load_settings(config).server
    assert server.keep_alive_s == 620
    assert server.cors_allow_origins == ["https://app.example.com", "http://[::1]:3000", "*"]


def test_forwarded_headers_are_believed_from_no_one_and_only_loopback_names_are_allowed_by_default() -> None:
    server = load_settings().server
    assert server.forwarded_allow_ips == [] and server.allowed_hosts == []


def test_forwarded_addresses_and_host_names_from_the_file(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        '[server]\nforwarded_allow_ips = ["10.0.0.5", "10.1.0.0/16", "::1"]\n'
        'allowed_hosts = ["Gateway.Example.com.", "*.lab.example.com"]\n',
    )
    server = load_settings(config).server
    assert server.forwarded_allow_ips == ["10.0.0.5", "10.1.0.0/16", "::1"]
    assert server.allowed_hosts == ["gateway.example.com", "*.lab.example.com"]


@pytest.mark.parametrize(
    ("setting", "value", "fragment"),
    [
        ("forwarded_allow_ips", '["*"]', "'*' is not an IP address or a CIDR network"),
        ("forwarded_allow_ips", '["lb.example.com"]', "is not an IP address or a CIDR network"),
        ("allowed_hosts", '["gateway.example.com:8080"]', "is not a host name, *.suffix or *"),
        ("allowed_hosts", '["https://gateway.example.com"]', "is not a host name, *.suffix or *"),
        ("allowed_hosts", '["*example.com"]', "is not a host name, *.suffix or *"),
    ],
)
def test_a_forwarded_address_or_host_name_that_is_none_is_refused(
    tmp_path: Path, setting: str, value: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, f"[server]\n{setting} = {value}\n"))
    assert f"server.{setting}" in info.value.message and fragment in info.value.message


@pytest.mark.parametrize(("text", "expected"), [('"auto"', "auto"), ("2", 2), ('"3"', 3), ("8", 8)])
def test_worker_processes_one_per_core_by_default_or_as_written(tmp_path: Path, text: str, expected: object) -> None:
    server = load_settings().server
    assert server.workers == "auto" and server.worker_count() == max(1, min(8, len(os.sched_getaffinity(0))))
    config = load_settings(write(tmp_path, f"[server]\nworkers = {text}\n")).server
    assert config.workers == expected


@pytest.mark.parametrize("text", ["0", "9", '"many"', "true", "1.5", "-1"])
def test_a_worker_count_out_of_range_is_refused_with_the_range(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, f"[server]\nworkers = {text}\n"))
    assert 'server.workers (QIIP_SERVER__WORKERS): must be a whole number from 1 to 8, or "auto"' in info.value.message


@pytest.mark.parametrize(
    ("origin", "fragment"),
    [
        ("app.example.com", "is not * or an origin scheme://host[:port]"),
        ("null", "is not * or an origin scheme://host[:port]"),
        ("https://*.example.com", "is not * or an origin scheme://host[:port]"),
        ("https://ops@app.example.com", "is not * or an origin scheme://host[:port]"),
        ("https://app.example.com:99999", "is not * or an origin scheme://host[:port]"),
        ("https://app.example.com/", "use 'https://app.example.com'"),
        ("https://app.example.com/chat", "use 'https://app.example.com'"),
        ("https://App.Example.com", "use 'https://app.example.com'"),
        ("https://app.example.com:443", "use 'https://app.example.com'"),
        ("http://[0:0::1]:3000", "use 'http://[::1]:3000'"),
    ],
)
def test_a_cors_origin_must_be_as_browsers_send_it(monkeypatch: pytest.MonkeyPatch, origin: str, fragment: str) -> None:
    monkeypatch.setenv("QIIP_SERVER__CORS_ALLOW_ORIGINS", json.dumps(["https://ok.example.com", origin]))
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = info.value.message
    assert "server.cors_allow_origins (QIIP_SERVER__CORS_ALLOW_ORIGINS)" in message
    assert repr(origin) in message and fragment in message


@pytest.mark.parametrize("value", ["0", "2.5", "86401"])
def test_keep_alive_is_whole_seconds_from_one(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("QIIP_SERVER__KEEP_ALIVE_S", value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "server.keep_alive_s (QIIP_SERVER__KEEP_ALIVE_S)" in info.value.message


@pytest.mark.parametrize(
    "node",
    [
        {"id": "a", "model": "m"},
        {"id": "a", "model": "m", "gguf": "/m.gguf", "artifact_id": "0" * 64},
    ],
)
def test_a_local_node_serves_one_file_or_one_artifact(node: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="exactly one of gguf"):
        load_settings(local_nodes=[node])
    assert load_settings(local_nodes=[{"id": "a", "model": "m", "artifact_id": "0" * 64}]).local_nodes[0].gguf is None


@pytest.mark.parametrize("alias", ["a\x07b", "a\nb", " a"])
def test_a_local_node_alias_follows_the_model_name_rule(alias: str) -> None:
    with pytest.raises(ConfigError, match=r"local_nodes\.0\.model .*model must be printable"):
        load_settings(local_nodes=[{"id": "a", "model": alias, "gguf": "/m.gguf"}])


def test_models_settings_refuse_a_bad_endpoint_and_host() -> None:
    with pytest.raises(ConfigError, match="hub_endpoint must be an http"):
        load_settings(models={"hub_endpoint": "ftp://hub"})
    with pytest.raises(ConfigError, match="is not a host name"):
        load_settings(models={"allowed_download_hosts": ["https://x"]})


def test_routing_policy_per_model_from_the_file(tmp_path: Path) -> None:
    assert load_settings().routing.policy == "prefix_affinity"
    config = write(
        tmp_path,
        '[routing]\npolicy = "least_connections"\nprefix_ttl_s = 60\n\n'
        '[routing.model_policy]\n"org/chat:q4" = "prefix_affinity"\n',
    )
    routing = load_settings(config).routing
    assert routing.policy == "least_connections" and routing.prefix_ttl_s == 60
    assert routing.model_policy == {"org/chat:q4": "prefix_affinity"}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            'policy = "sticky"',
            "routing.policy (QIIP_ROUTING__POLICY): 'sticky' is not a routing policy; use one of least_connections, ",
        ),
        (
            '[routing.model_policy]\n"org/chat:q4" = "round_robin"',
            "model 'org/chat:q4' has 'round_robin', which is not a routing policy",
        ),
        ("prefix_imbalance_requests = -1", "routing.prefix_imbalance_requests"),
        ("prefix_cache_entries = 0", "routing.prefix_cache_entries"),
    ],
)
def test_a_bad_routing_policy_is_refused_by_name(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, f"[routing]\n{text}\n"))
    assert fragment in info.value.message


def test_an_ollama_mirror_url_may_carry_a_query() -> None:
    template = "https://mirror.lab/ollama/v{version}/ollama-linux-{arch}.tar.zst?download=1"
    assert load_settings(provisioning={"ollama_url_template": template}).provisioning.ollama_url_template == template
