"""The simulator's configuration: per-executor profiles of latency, price and every way a vendor misbehaves.

Each profile switch mirrors a habit of real paid vendors that costs money when the client handles it badly:
charge-then-drop, charge-then-503 (a gateway), jobs created after the client gave up, idempotency keys
forgotten after a while, outputs purged, results served from another host, odd cost figures, rotated keys,
408s and slow answers. All rates are drawn per request from a seeded RNG (``Draw``), so a workload replays
identically. ``WebhookHabits`` are the predictions dialect's callbacks and the ways a real sender spoils them
(dropped, replayed, forged, sent before the work is done), drawn per prediction (``WebhookFate``).
"""

from __future__ import annotations

import base64
import binascii
import random
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_CHAT = '{"verdict": "pass", "scores": {"overall": 0.9}, "reasons": []}'

Rate = Annotated[float, Field(ge=0, le=1)]


class ExecutorProfile(BaseModel):
    """How one executor behaves: latency, price and the probability of each fault."""

    model_config = ConfigDict(extra="forbid")

    latency_seconds: float = Field(default=0.0, ge=0)
    cost: Decimal | None = Field(default=None, ge=0, description="None charges the request's estimate")
    cost_multiplier: Decimal = Field(default=Decimal(1), ge=0)
    fail_technical: Rate = 0.0
    reject_content: Rate = 0.0
    drop_response: Rate = 0.0
    rate_limit: Rate = 0.0
    server_error: Rate = 0.0
    server_error_status: int = Field(
        default=500, ge=500, le=599, description="the status a server error answers"
    )
    hang: Rate = 0.0
    corrupt_result: Rate = Field(
        default=0.0, description="serve bytes that do not match the advertised sha256"
    )
    bad_media: Rate = Field(
        default=0.0,
        description="deliver media outside what was asked (and say so): half the size, twice the duration",
    )
    false_claim: Rate = Field(
        default=0.0, description="deliver what was asked but claim other media metadata than the file has"
    )
    missing_rights: Rate = Field(default=0.0, description="report no rights metadata with the artifact")
    no_result: bool = Field(
        default=False, description="a finished job names no file, as a delete or an unpublish does"
    )
    broken_code: Rate = Field(default=0.0, description="a drafted lesson's last code example raises")
    truncated: Rate = Field(
        default=0.0, description="deliver the file cut short (its sha256 advertised for the cut bytes)"
    )
    # ── the unkind switches: what real vendors do ─────────────────────────────────────────────────────
    late_accept: Rate = Field(
        default=0.0, description="a POST creates its job only after late_accept_seconds"
    )
    late_accept_seconds: float = Field(default=0.0, ge=0)
    slow: Rate = Field(default=0.0, description="answer after slow_seconds (the job exists meanwhile)")
    slow_seconds: float = Field(default=0.0, ge=0)
    request_timeout: Rate = Field(default=0.0, description="answer a POST 408: nothing accepted")
    gateway_error: Rate = Field(
        default=0.0,
        description="create (and charge) the job, then answer the POST gateway_error_status: a gateway whose "
        "upstream timed out after it accepted (nginx, Envoy and cloud load balancers answer 502/503/504)",
    )
    gateway_error_status: int = Field(default=503, ge=500, le=599, description="what a gateway error answers")
    key_retention_seconds: float | None = Field(
        default=None,
        gt=0,
        description="idempotent mode: a key is forgotten this long after its job was created",
    )
    purge_after_seconds: float | None = Field(
        default=None, ge=0, description="result downloads answer 404 this long after the job finished"
    )
    forget_after_seconds: float | None = Field(
        default=None, ge=0, description="GET /jobs/{id} answers 404 this long after the job finished"
    )
    absolute_urls: bool = Field(default=False, description="results on the CDN (another port), absolute URLs")
    result_url_template: str | None = Field(
        default=None, description="a raw result URL, e.g. '@{cdn}/files/{job}' ({cdn}: host:port of the CDN)"
    )
    # ── result downloads that misbehave (issue 24 §5) ─────────────────────────────────────────────────
    result_redirect: str | None = Field(
        default=None,
        description="the result download answers 302 to this Location ({cdn}: host:port of the CDN, {job}; "
        "a Location naming the result itself is a redirect loop)",
    )
    download_status: int | None = Field(
        default=None,
        ge=400,
        le=599,
        description="every result download (API and CDN) answers this status (403: an expired presigned URL)",
    )
    drip_seconds: float = Field(
        default=0.0, ge=0, description="serve a result a few bytes at a time, waiting this long between them"
    )
    cost_decimals: int | None = Field(
        default=None,
        ge=5,
        le=12,
        description="report and bill the cost with this many decimals (just under it)",
    )
    cost_override: str | None = Field(
        default=None, max_length=40, description="report and bill exactly this figure ('-1', 'NaN', '1e12' …)"
    )
    predict_time_override: str | None = Field(
        default=None,
        max_length=40,
        description="a prediction reports this metrics.predict_time ('-5', 'NaN', '1e400' → a raw JSON "
        "number, Infinity for 1e400), billed as usual",
    )


class ChatRule(BaseModel):
    """Answer ``content`` when ``match`` occurs in the last user message (and, below 1, a seeded draw hits).

    The draw comes from ``(seed, match, message)``: the same question always gets the same answer, and
    different questions (another task's goal, a new version of a part) meet the rate independently.
    """

    match: str
    content: str
    rate: Rate = 1.0

    def applies(self, seed: int, message: str) -> bool:
        if self.match not in message:
            return False
        return self.rate >= 1 or random.Random(f"{seed}:{self.match}:{message}").random() < self.rate


class WebhookHabits(BaseModel):
    """How the predictions dialect calls a prediction's ``webhook`` back, and how it misbehaves doing so.

    Signed as Replicate signs (the Standard Webhooks scheme, https://www.standardwebhooks.com):
    ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature: v1,<base64 HMAC-SHA256>`` keyed by the
    base64 part of ``secret`` (https://replicate.com/docs/topics/webhooks/verify-webhook; the secret is served
    at ``GET /v1/webhooks/default/secret``). Each rate is drawn once per prediction (``WebhookFate``).
    """

    model_config = ConfigDict(extra="forbid")

    secret: str = Field(
        description="the signing secret, 'whsec_' and base64 (GET /v1/webhooks/default/secret)"
    )
    delay_seconds: float = Field(default=0.0, ge=0, description="how long after completion the callback goes")
    drop: Rate = Field(default=0.0, description="never send the completed callback")
    duplicate: Rate = Field(
        default=0.0, description="send the completed delivery twice: same webhook-id, timestamp and body"
    )
    forge: Rate = Field(default=0.0, description="sign the prediction's deliveries with a wrong key")
    early: Rate = Field(
        default=0.0, description="also send a body claiming 'succeeded' while the prediction still runs"
    )
    rewrite_host: str | None = Field(
        default=None,
        description="POST callbacks to this http://host:port origin instead of the webhook URL's own (path "
        "and query kept): route webhook URLs name public hosts",
    )

    @field_validator("secret")
    @classmethod
    def _whsec(cls, value: str) -> str:
        if not value.startswith("whsec_"):
            raise ValueError("a webhook secret is 'whsec_' followed by base64")
        try:
            key = base64.b64decode(value.removeprefix("whsec_"), validate=True)
        except binascii.Error as e:
            raise ValueError(f"a webhook secret's key is not base64: {e}") from None
        if not key:
            raise ValueError("a webhook secret's key is empty")
        return value

    @field_validator("rewrite_host")
    @classmethod
    def _origin(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError("rewrite_host is an origin: http://host:port")
        if parts.query or parts.fragment:
            raise ValueError("rewrite_host is an origin: http://host:port")
        return f"{parts.scheme}://{parts.netloc}"

    def key(self) -> bytes:
        """The HMAC key: the base64-decoded part of the secret after ``whsec_``."""
        return base64.b64decode(self.secret.removeprefix("whsec_"))


class SimConfig(BaseModel):
    """The whole simulator configuration; replaceable at runtime with ``PUT /admin/config``."""

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    default: ExecutorProfile = Field(default_factory=ExecutorProfile)
    executors: dict[str, ExecutorProfile] = Field(default_factory=dict)
    mode: Literal["idempotent", "lookup_only", "none"] = "idempotent"
    # None: any non-empty bearer key is accepted. A list: only these (a key rotation answers 401 to the rest).
    accepted_keys: list[str] | None = None
    chat_script: list[ChatRule] = Field(default_factory=list)
    chat_default: str = DEFAULT_CHAT
    # The chat endpoint's own faults: answer every call with this HTTP status (an outage), and take this long
    # to answer (a slow model). Off by default.
    chat_error_status: int | None = Field(default=None, ge=400, le=599)
    chat_latency_seconds: float = Field(default=0.0, ge=0)
    # What a chat or image call is billed (and so what a route's price must say for the ledger to match).
    chat_price_per_1k_tokens: Decimal = Field(default=Decimal("0.002"), ge=0)
    # A chat answer reports these usage figures instead of the real ones ({"prompt_tokens": "-500"}, "NaN" …,
    # sent as raw JSON numbers); it is billed for the real usage all the same.
    chat_usage_override: dict[str, str] | None = None
    image_price: Decimal = Field(default=Decimal("0.04"), ge=0)
    # The predictions dialect's callbacks (None: it never calls a webhook back, it only reads its label).
    webhooks: WebhookHabits | None = None

    def profile(self, executor: str) -> ExecutorProfile:
        return self.executors.get(executor, self.default)


@dataclass(frozen=True)
class Draw:
    """The fate of one POST attempt, drawn before anything else happens."""

    rate_limited: bool
    server_error: bool
    dropped: bool
    hang: bool
    failure: Literal["technical", "content_rejected"] | None
    corrupt: bool
    fail_at: float  # fraction of the latency at which a failing job fails
    bad_media: bool = False
    missing_rights: bool = False
    late: bool = False
    slow: bool = False
    request_timeout: bool = False
    broken_code: bool = False
    false_claim: bool = False
    truncated: bool = False
    server_error_status: int = 500
    gateway_error: bool = False
    gateway_error_status: int = 503

    @classmethod
    def for_attempt(cls, seed: int, key: str, attempt: int, p: ExecutorProfile) -> Draw:
        rng = random.Random(f"{seed}:{key}:{attempt}")
        # Always draw every number in the same order, so changing one rate never shifts the others' outcomes.
        # Rates added later draw after the earlier ones, so every outcome seeded before them stays the same.
        u = [rng.random() for _ in range(17)]
        failure: Literal["technical", "content_rejected"] | None = None
        if u[4] < p.fail_technical:
            failure = "technical"
        elif u[5] < p.reject_content:
            failure = "content_rejected"
        return cls(
            rate_limited=u[0] < p.rate_limit,
            server_error=u[1] < p.server_error,
            dropped=u[2] < p.drop_response,
            hang=u[3] < p.hang,
            failure=failure,
            corrupt=u[6] < p.corrupt_result,
            fail_at=0.1 + 0.8 * u[7],
            bad_media=u[8] < p.bad_media,
            missing_rights=u[9] < p.missing_rights,
            late=u[10] < p.late_accept,
            slow=u[11] < p.slow,
            request_timeout=u[12] < p.request_timeout,
            broken_code=u[13] < p.broken_code,
            false_claim=u[14] < p.false_claim,
            truncated=u[15] < p.truncated,
            server_error_status=p.server_error_status,
            gateway_error=u[16] < p.gateway_error,
            gateway_error_status=p.gateway_error_status,
        )


@dataclass(frozen=True)
class WebhookFate:
    """How one prediction's callbacks misbehave, drawn once when it is created."""

    drop: bool = False
    duplicate: bool = False
    forge: bool = False
    early: bool = False

    @classmethod
    def for_prediction(cls, seed: int, key: str, attempt: int, habits: WebhookHabits) -> WebhookFate:
        # A stream of its own (not more numbers in Draw's): turning callbacks on never shifts a prediction's
        # other outcomes. Every number is drawn, in a fixed order, whatever the rates.
        rng = random.Random(f"{seed}:{key}:{attempt}:webhook")
        u = [rng.random() for _ in range(4)]
        return cls(
            drop=u[0] < habits.drop,
            duplicate=u[1] < habits.duplicate,
            forge=u[2] < habits.forge,
            early=u[3] < habits.early,
        )
