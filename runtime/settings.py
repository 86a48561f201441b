"""Configuration, read from the environment (prefix ``LEDGERFLOW_``) and ``.ledgerflow/stack.json``.

Secrets (vendor, LLM and approver keys) live here and are only ever read inside activities: nothing in
this module may be passed into a workflow argument, result, heartbeat or error, because all of those
are stored in Temporal's history.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

STATE_DIR = Path(".ledgerflow")
STACK_FILE = STATE_DIR / "stack.json"
SIM_VENDOR_KEY = "sim-vendor-key"  # the simulator's keys: defaults in dev mode, refused outside it
SIM_LLM_KEY = "sim-llm-key"


class Settings(BaseSettings):
    """Every knob of a ledgerflow process. Unset addresses fall back to the embedded stack's stack.json."""

    model_config = SettingsConfigDict(env_prefix="LEDGERFLOW_", extra="ignore")

    temporal_address: str | None = None
    # The Temporal Web UI's base URL, for links to a task's page (the embedded stack's by default).
    ui_url: str | None = None
    namespace: str = "default"
    task_queue: str = "ledgerflow"
    database_url: str | None = None
    vendor_url: str | None = None
    llm_url: str | None = None
    llm_model: str = "sim-planner-1"
    vendor_api_key: SecretStr = SecretStr(SIM_VENDOR_KEY)
    llm_api_key: SecretStr = SecretStr(SIM_LLM_KEY)
    artifact_dir: Path = Field(default=STATE_DIR / "artifacts")
    # Where artifacts live: None → the local directory above; ``s3://bucket/prefix`` → an S3-compatible
    # store shared by workers on several hosts (endpoint and keys from AWS_ENDPOINT_URL or
    # LEDGERFLOW_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).
    artifact_store: str | None = None
    # A route paused by a credentials error is tried again this often (until a person resumes it).
    route_pause_retry_seconds: float = Field(default=30.0, gt=0)
    state_dir: Path = STATE_DIR
    # Price of inference tokens, in currency units per 1k tokens (LLM decision and review calls).
    llm_price_per_1k_tokens: str = "0.002"
    # A running vendor job is polled after poll_interval_seconds, then half as long again each time, up to
    # max_poll_interval_seconds.
    poll_interval_seconds: float = 0.05
    max_poll_interval_seconds: float = Field(default=5.0, gt=0, le=300)
    # A new task's price book learns each route's price from its last this-many settled results in the
    # ledger (rules.pricing); 0: learn nothing (declared prices and estimates only — the test suite, whose
    # tests share one ledger and make its routes misbehave on purpose, sets this).
    price_history: int = Field(default=50, ge=0, le=10_000)
    # … read at most this often per worker (a burst of new tasks reads the ledger once; each records it).
    price_cache_seconds: float = Field(default=60.0, ge=0, le=86_400)
    # A signed decision counts only if issued within this many seconds of reaching Temporal (either way):
    # a decision replayed later, or signed ahead, is refused and the refusal recorded (rules.people). The
    # audit re-verifies recorded decisions with the same window.
    decision_window_seconds: float = Field(default=600.0, gt=0, le=86_400)
    # Open requests a project's people can hold (rules.pressure): above it, fan-outs widen slowly. 0: off.
    human_capacity: int = Field(default=0, ge=0, le=100_000)
    # Tasks of one task queue that run their work at once (ledger.admission): a new task past it waits, in
    # order (hero first), before its first dispatch. A task stopped for a person does not count. Set it the
    # same on every worker of a queue (docs/operations.md#admission). 0: no bound.
    active_tasks: int = Field(default=0, ge=0, le=1_000_000)
    # Activities one worker runs at once (executors, ledger writes, closes).
    max_concurrent_activities: int = Field(default=64, ge=1, le=1000)
    # The worker's ledger connections: this many kept open, as many again opened under a burst (so at most
    # 2 × db_pool_size per worker). An activity holds one only for a statement or a transaction (ms), so 10
    # serve 64 concurrent activities; size N workers × 2 × db_pool_size below Postgres's max_connections
    # (100 by default; the embedded stack sets 200) with room for the CLI and the reviewer page.
    db_pool_size: int = Field(default=10, ge=1, le=200)
    # How long a workflow task waits for the worker that ran the workflow last (its cache) before any worker
    # may take it (Temporal's default, 10 s). Shorter, and a busy worker's workflows are replayed elsewhere
    # from their full histories (at 2 s a quarter of the soak's workflow tasks were). An activity retried
    # after its worker died frees its workflow at once (runtime/stickiness.py); a dead worker's other
    # workflows wait up to this long.
    sticky_schedule_to_start_seconds: float = Field(default=10.0, gt=0, le=60)
    # What the vendor can do after a crash: idempotent (same key → same job), lookup_only, or none. Applies to
    # the built-in route table only; a route file sets each route's mode.
    vendor_mode: Literal["idempotent", "lookup_only", "none"] = "idempotent"
    # The route table (vendors/routes.py, read by ``deployment_table``): which adapter and vendor serve each
    # executor. None: built in.
    routes_file: Path | None = None
    # How long a worker stopping on SIGTERM lets in-flight activities finish (`ledgerflow down` waits 30 s).
    graceful_shutdown_seconds: float = Field(default=20.0, ge=0, le=3600)
    # How long a worker may go silent before Temporal gives its activity to another worker.
    heartbeat_timeout_seconds: float = 30.0
    # ``dev`` (LEDGERFLOW_ENV=dev: the embedded stack passes it to the processes it starts, the tests set it)
    # allows the demo approver keys and default secrets; anything else is production, where they are refused.
    # Read from the environment at process start only: never from stack.json or any other file (issue 24 §7).
    env: str | None = None
    # The reviewer page's login tokens: approver name -> token, as a JSON object (LEDGERFLOW_REVIEW_TOKENS).
    # A token only logs a person in: every decision is still signed in their browser with their own key.
    review_tokens: SecretStr = SecretStr("{}")
    # What each token's approver may see on the page: approver name -> scopes, as a JSON object
    # (LEDGERFLOW_REVIEW_SCOPES; ledgerflow.review.auth.parse_scopes). None: every token sees every project.
    review_scopes: str | None = None
    # The key the reviewer page signs its session cookies with (LEDGERFLOW_REVIEW_SESSION_SECRET, 32+
    # characters): the same on every replica, so each accepts the others' cookies. Required outside dev mode
    # (the page will not start without it); unset in dev mode, a random one per process.
    review_session_secret: SecretStr | None = None
    # Root public keys (LEDGERFLOW_KEY_ROOTS, comma-separated, 64 hex digits each): when set, workers and the
    # audit trust only approver keys whose registry entry one of them endorsed (`ledgerflow keys endorse`).
    # Configuration, never the database: whoever can write the registry cannot add a root.
    key_roots: str | None = None
    # People are told (docs/reviewers.md): per project, the URL a signed notification (Standard Webhooks) is
    # POSTed to when one of its task's requests opens, nears its deadline or is resolved
    # (LEDGERFLOW_NOTIFY_WEBHOOKS: a JSON object project -> URL; "*" for every project), signed with the
    # secret LEDGERFLOW_NOTIFY_SECRET holds; each links to the request on the page at LEDGERFLOW_REVIEW_URL.
    notify_webhooks: dict[str, str] = Field(default_factory=dict)
    # Days an ended task's artifacts are kept, per project ("*": every other), unless a release or a task
    # still open references them (``ledgerflow retention``); none named: artifacts are kept for ever.
    artifact_retention_days: dict[str, float] = Field(default_factory=dict)
    notify_secret_env: str = "LEDGERFLOW_NOTIFY_SECRET"
    review_url: str | None = None

    def notify_url(self, project: str) -> str | None:
        """Where a project's people are told of its requests (None: nobody is)."""
        return self.notify_webhooks.get(project) or self.notify_webhooks.get("*")

    def credential(self, env_name: str) -> str:
        """The secret a route's ``credential_env`` names. Read inside the worker only, never passed on."""
        known = {"LEDGERFLOW_VENDOR_API_KEY": self.vendor_api_key, "LEDGERFLOW_LLM_API_KEY": self.llm_api_key}
        if env_name in known:
            return known[env_name].get_secret_value()
        value = os.environ.get(env_name)
        if not value:
            raise ConfigError(f"the credential variable {env_name} (named by a route) is not set")
        return value

    def store_location(self) -> str:
        return self.artifact_store or str(self.artifact_dir)

    def stack(self) -> dict[str, object]:
        path = self.state_dir / "stack.json"
        if path.exists():
            return dict(json.loads(path.read_text()))
        return {}

    def task_ui_link(self, workflow_id: str) -> str | None:
        """The task's page in the Temporal Web UI (LEDGERFLOW_UI_URL, else the embedded stack's), if known."""
        base = self.ui_url or self.stack().get("ui_url")
        return (
            f"{str(base).rstrip('/')}/namespaces/{self.namespace}/workflows/{workflow_id}" if base else None
        )

    def resolved_temporal_address(self) -> str:
        return self.temporal_address or str(self.stack().get("temporal_address") or "localhost:7233")

    def resolved_database_url(self) -> str:
        url = self.database_url or self.stack().get("database_url")
        if not url:
            raise ConfigError(
                "no ledger database: set LEDGERFLOW_DATABASE_URL or run `ledgerflow up` (the embedded stack)"
            )
        return str(url)

    def vendor_url_or_none(self) -> str | None:
        """The vendor's URL: the setting, else the embedded stack's simulator, else None."""
        return str(self.vendor_url or self.stack().get("vendor_url") or "") or None

    def resolved_vendor_url(self) -> str:
        url = self.vendor_url_or_none()
        if not url:
            raise ConfigError(
                "no vendor: set LEDGERFLOW_VENDOR_URL or start the embedded stack with `ledgerflow up`"
            )
        return url

    def resolved_llm_url(self) -> str:
        return self.llm_url or self.resolved_vendor_url()

    def default_secret(self) -> str | None:
        """The first secret still at its simulator default, named by its setting (None if there is none)."""
        for name, value, default in (
            ("LEDGERFLOW_VENDOR_API_KEY", self.vendor_api_key, SIM_VENDOR_KEY),
            ("LEDGERFLOW_LLM_API_KEY", self.llm_api_key, SIM_LLM_KEY),
        ):
            if value.get_secret_value() == default:
                return f"{name} is the simulator's default key: set the real one (or LEDGERFLOW_ENV=dev)"
        return None

    @property
    def dev(self) -> bool:
        """Dev mode: LEDGERFLOW_ENV=dev when the process started. A file (stack.json in the working directory)
        turns nothing on; the CLI learns it from the stack it talks to (``ledgerflow.client.stack_dev``)."""
        return self.env == "dev"

    @property
    def decision_window(self) -> timedelta:
        """How far a signed decision's issued-at may be from when it reached Temporal (rules.people)."""
        return timedelta(seconds=self.decision_window_seconds)

    def root_keys(self) -> frozenset[str]:
        """LEDGERFLOW_KEY_ROOTS as a set of public keys (64 lowercase hex digits each); ConfigError (one line)
        naming the first that is not an Ed25519 public key."""
        roots = [r.strip().lower() for r in (self.key_roots or "").split(",") if r.strip()]
        for root in roots:
            if not re.fullmatch(r"[0-9a-f]{64}", root):
                raise ConfigError(
                    f"LEDGERFLOW_KEY_ROOTS: {root[:80]!r} is not a root public key (64 hex digits)"
                )
        return frozenset(roots)

    def review_token_map(self) -> dict[str, str]:
        """The reviewer page's tokens. ConfigError (naming no token) if not a JSON object of strings."""
        try:
            tokens = json.loads(self.review_tokens.get_secret_value())
        except ValueError:
            raise ConfigError("LEDGERFLOW_REVIEW_TOKENS is not valid JSON") from None
        if tokens == {} and self.dev:
            tokens = self.stack().get("review_tokens") or {}  # the embedded stack's, made by `ledgerflow up`
        if not isinstance(tokens, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) and len(v) >= 16 for k, v in tokens.items()
        ):
            raise ConfigError(
                "LEDGERFLOW_REVIEW_TOKENS must be a JSON object of approver name -> token (16+ characters)"
            )
        return tokens


class ConfigError(Exception):
    """A configuration value is missing or unusable (a user error: reported in one line)."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
