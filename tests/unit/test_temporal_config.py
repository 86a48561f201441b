"""Connecting to a hosted Temporal: the SDK's environment configuration (TEMPORAL_* and its TOML file) gives
TLS and API keys; ledgerflow's own address and namespace settings still win where set."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.service import TLSConfig

from runtime.settings import ConfigError, Settings
from runtime.temporal_config import connect_options

TEMPORAL_VARS = (
    "TEMPORAL_ADDRESS",
    "TEMPORAL_NAMESPACE",
    "TEMPORAL_API_KEY",
    "TEMPORAL_PROFILE",
    "TEMPORAL_TLS",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in TEMPORAL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(tmp_path / "absent.toml"))


def settings(tmp_path: Path, **fields: object) -> Settings:
    return Settings(state_dir=tmp_path / "no-stack", **fields)  # type: ignore[arg-type]


def test_an_api_key_from_the_environment_turns_tls_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TEMPORAL_ADDRESS", "my-ns.a1b2c.tmprl.cloud:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "my-ns.a1b2c")
    monkeypatch.setenv("TEMPORAL_API_KEY", "cloud-key-123")
    options = connect_options(settings(tmp_path))
    assert options["target_host"] == "my-ns.a1b2c.tmprl.cloud:7233"
    assert options["namespace"] == "my-ns.a1b2c"
    assert options["api_key"] == "cloud-key-123" and options["tls"] is True


def test_mtls_from_a_config_file_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "client.pem").write_text("CERT")
    (tmp_path / "client.key").write_text("KEY")
    config = tmp_path / "temporal.toml"
    config.write_text(
        f"""
[profile.prod]
address = "temporal.internal:7233"
namespace = "pipelines"
[profile.prod.tls]
client_cert_path = "{tmp_path / "client.pem"}"
client_key_path = "{tmp_path / "client.key"}"
server_name = "temporal.internal"
"""
    )
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(config))
    monkeypatch.setenv("TEMPORAL_PROFILE", "prod")
    options = connect_options(settings(tmp_path))
    assert (options["target_host"], options["namespace"]) == ("temporal.internal:7233", "pipelines")
    tls = options["tls"]
    assert isinstance(tls, TLSConfig)
    assert (tls.client_cert, tls.client_private_key, tls.domain) == (b"CERT", b"KEY", "temporal.internal")


def test_ledgerflows_own_address_and_namespace_win(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TEMPORAL_ADDRESS", "elsewhere:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "theirs")
    options = connect_options(settings(tmp_path, temporal_address="here:7233", namespace="ours"))
    assert (options["target_host"], options["namespace"]) == ("here:7233", "ours")
    assert "api_key" not in options and "tls" not in options  # plain, like the dev server


def test_nothing_configured_is_the_local_default(tmp_path: Path) -> None:
    assert connect_options(settings(tmp_path)) == {"target_host": "localhost:7233", "namespace": "default"}


def test_an_unreadable_config_file_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[profile.default\naddress = ")
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(bad))
    with pytest.raises(ConfigError) as e:
        connect_options(settings(tmp_path))
    assert str(e.value).startswith("Temporal's client configuration") and "\n" not in str(e.value)
