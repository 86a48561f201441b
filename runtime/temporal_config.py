"""How every ledgerflow process connects to Temporal: Temporal's own environment configuration (the SDK's
envconfig, shared with the `temporal` CLI: `TEMPORAL_ADDRESS`, `TEMPORAL_NAMESPACE`, `TEMPORAL_API_KEY`,
`TEMPORAL_TLS`, `TEMPORAL_TLS_CLIENT_CERT_PATH` …, `TEMPORAL_PROFILE` and the TOML file at
`TEMPORAL_CONFIG_FILE`), so a hosted cluster (mTLS, or Temporal Cloud's API keys) needs no setting of ours.
`LEDGERFLOW_TEMPORAL_ADDRESS` / `LEDGERFLOW_NAMESPACE` (or the embedded stack) still win where set.

The API key and the TLS key stay in the client: never in a workflow argument, result or error.
"""

from __future__ import annotations

from typing import Any

from temporalio.envconfig import ClientConfig

from runtime.settings import ConfigError, Settings

DEFAULT_ADDRESS = "localhost:7233"


def connect_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``Client.connect`` (target host, namespace, API key, TLS, gRPC metadata).
    ConfigError, one line, if Temporal's configuration file or variables cannot be read."""
    try:
        options: dict[str, Any] = dict(ClientConfig.load_client_connect_config())
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"Temporal's client configuration (TEMPORAL_* / its config file): {first}"
        ) from None
    options["target_host"] = (
        settings.temporal_address
        or str(settings.stack().get("temporal_address") or "")
        or options.get("target_host")
        or DEFAULT_ADDRESS
    )
    if "namespace" in settings.model_fields_set or "namespace" not in options:
        options["namespace"] = settings.namespace
    return options
