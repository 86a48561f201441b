"""The route table: which vendor serves each executor, through which adapter, on what terms.

A route file (YAML; ``LEDGERFLOW_ROUTES_FILE``) maps every executor a plan may name to a route::

    routes:
      video.motion:
        adapter: predictions          # a name in the entry point group ``ledgerflow.adapters``: the built-in
                                      # jobs | predictions | openai | queue | local, or a plugin's
        base_url: https://api.example.com
        credential_env: MOTION_API_KEY  # the NAME of the variable holding the key, never the key
        auth: {scheme: bearer}        # how the key is sent (vendors/auth.py): bearer (the default) | header |
                                      # basic | query | oauth2_client_credentials | signed
        headers: {X-Api-Version: "2024-06-01"}  # static headers to its own origin (no secrets)
        mode: lookup_only             # what the vendor can do after a crash (reconcile.operations)
        key_retention: 24h            # how long the vendor remembers an idempotency key
        max_accept_seconds: 30        # how long after the client gave up a submit may still create a job
        price: {per_second: 0.30}     # used where the vendor reports no cost
        concurrency: 8                # jobs in flight at once, across every task and worker
        monthly_cap: 500              # spend per calendar month (UTC) on this route, across every task
        timeouts: {request: 10s}
        allow_hosts: [cdn.example.com]  # origins besides base_url's that receive the key (https://host:443;
                                        # "*.cdn.example.com": its subdomains, https only)
        allow_private: []             # origins on private/loopback addresses result URLs may name (no key)
        max_result_bytes: 2GiB        # a result larger than this is refused (invalid_output, at its cost)
        max_json_bytes: 16MiB         # an API answer larger than this is unreadable
        webhook_url: "https://hooks.example.com/callbacks/video.motion?operation_key={operation_key}"
        callback: {secret_env: MOTION_WEBHOOK_SECRET}  # its calls verified by `ledgerflow webhooks serve`
      image.keyframe:
        adapter: jobs
        paths: {submit: /v2/tasks, get: "/v2/tasks/{job_id}"}  # the adapter's paths, relative to base_url
        shape: {id_field: task_id, status_field: state,         # the jobs protocol in the vendor's words
                statuses: {queued: running, done: succeeded, error: failed, aborted: cancelled}}
    reviewers: [compliance.rules, content.llm]

Adapters are plugins (``vendors.plugins``, ``docs/vendor-plugins.md``): ``adapter`` names an entry point of
the group ``ledgerflow.adapters``; a route file naming one that is not installed, is installed twice, cannot
be imported or speaks another protocol version is refused at load, in one line. ``paths`` (templates whose
``{placeholders}`` are those of the adapter's own defaults: ``jobs``'s are submit, get, cancel, find,
charges) and ``shape`` are read by adapters that declare them (``ROUTE_PATHS``, ``ROUTE_SHAPE``: ``jobs``).

``monthly_cap`` is the vendor contract's ceiling, not a plan's: a budget account per month,
``route:video.motion:2026-12``, created by the month's first dispatch with the cap as its ceiling; every
dispatch this route serves reserves its price there too, and one that does not fit is refused and escalated
naming that scope (an operator raises it: ``ledgerflow budget set route:video.motion:2026-12 600``). A cap
changed in the file applies from the next month's account; ``budget set`` changes the current one.

Everything is validated at load with one line naming the route and field (``RouteError``); ``json_schema()``
is the file's JSON schema (``ledgerflow routes schema``). Without a file, every executor of the built-in table
runs on the ``jobs`` adapter at ``LEDGERFLOW_VENDOR_URL`` (the simulator in the embedded stack) and
``code.validate`` runs locally.

Secrets: a route names the environment variable of its credential (and ``auth``'s ``*_env`` names: a basic
user, an OAuth2 client id); the adapter reads them inside the worker. Nothing here is ever put in a workflow
argument, result, heartbeat or error.
"""

from __future__ import annotations

import ipaddress
import re
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rules.money import Amount
from rules.plan import Routes, Seconds
from rules.pricing import RoutePrice
from rules.routing import BreakerPolicy, Candidate
from runtime.settings import ConfigError, Settings
from vendors.auth import ENV_NAME, SCHEMES, AuthConfig, BearerAuth, OAuth2ClientCredentials, static_headers

LOCAL_EXECUTORS: Final = frozenset({"code.validate", "media.assemble"})
DEFAULT_EXECUTORS: Final = frozenset(
    {
        "llm.text",
        "llm.code",
        "image.asset",
        "image.keyframe",
        "video.motion",
        "qc.check",
        "edit.assembly",
        "audio.tts",
        "audio.mix",
        "graphics.render",
        "subtitle.render",
        "color.grade",
        "release.package",
        "publish.cms",
    }
)
DEFAULT_REVIEWERS: Final = frozenset(
    {"compliance.rules", "content.llm", "qc.visual", "pedagogy.llm", "safety.rules"}
)
DEFAULT_CREDENTIAL_ENV: Final = "LEDGERFLOW_VENDOR_API_KEY"


# The embedded simulator serves its results from a CDN on its API's port + this (vendors/simulator): in dev
# mode the routes on LEDGERFLOW_VENDOR_URL allow-list that origin, and no other loopback one.
CDN_PORT_OFFSET: Final = 1
DEFAULT_MAX_RESULT_BYTES: Final = 2 << 30
DEFAULT_MAX_JSON_BYTES: Final = 16 << 20
Origin = tuple[str, str, int]  # scheme, host (lower case), port
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_UNITS: Final = {
    **{"": 1, "b": 1, "kb": 1000, "mb": 10**6, "gb": 10**9},
    **{"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30},
}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: Any) -> Any:
    """A byte count: an integer, or a string such as ``16MiB``, ``2GiB``, ``500kB``."""
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"must be a byte count such as 16MiB or 2GiB, got {value[:40]!r}")
        return int(m.group(1)) * _UNITS[m.group(2).lower()]
    return value


Bytes = Annotated[int, BeforeValidator(parse_bytes), Field(ge=1, le=1 << 40)]


def default_port(scheme: str) -> int:
    """The port a URL means when it names none: https's 443, else http's 80."""
    return _DEFAULT_PORTS["https" if scheme == "https" else "http"]


def origin(entry: str) -> Origin:
    """An ``allow_hosts`` / ``allow_private`` entry as an origin: ``https://host[:port]``, ``http://host:port``,
    or a bare host name (https on its default port). ValueError for anything else (a path, a user name …).

    ``*.example.com`` (``allow_hosts`` only: ``wildcard``) stands for every subdomain of ``example.com`` —
    not the domain itself — over https only; its host is kept as ``*.example.com``."""
    raw = entry.strip()
    if raw.removeprefix("https://").startswith("*."):
        return wildcard(entry)
    if "://" not in raw:
        raw = f"https://{raw}"
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{entry[:80]!r} is not a host or an origin ({e})") from None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{entry[:80]!r} is not an http(s) origin")
    if "*" in parts.hostname:
        raise ValueError(f"{entry[:80]!r}: a wildcard is *.domain.tld (subdomains of one domain, https only)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"{entry[:80]!r} must be an origin only (scheme, host, port): no path or user")
    return parts.scheme, parts.hostname.lower(), port or default_port(parts.scheme)


def wildcard(entry: str) -> Origin:
    """A ``*.example.com`` entry (optionally ``https://`` and a port): every subdomain of a domain of two
    labels or more, over https. ValueError for a bare ``*``, a top-level domain, http, a ``*`` elsewhere."""
    raw = entry.strip().removeprefix("https://")
    host, _, port_text = raw.partition(":")
    suffix = host.removeprefix("*.")
    if "*" in suffix or suffix.count(".") < 1 or not re.fullmatch(r"[a-z0-9.-]+", suffix.lower()):
        raise ValueError(f"{entry[:80]!r}: a wildcard is *.domain.tld (subdomains of one domain, https only)")
    if port_text and not port_text.isdigit():
        raise ValueError(f"{entry[:80]!r}: the port is not a number")
    return "https", f"*.{suffix.lower()}", int(port_text) if port_text else default_port("https")


def covers(entry: Origin, where: Origin) -> bool:
    """Whether an ``allow_hosts`` origin (a wildcard's too) covers the origin ``where``."""
    scheme, host, port = entry
    if host.startswith("*."):
        return (
            where[0] == scheme and where[2] == port and where[1].endswith(host[1:]) and where[1] != host[2:]
        )
    return entry == where


def _origins(values: tuple[str, ...]) -> tuple[str, ...]:
    for value in values:
        origin(value)
    return values


class RouteError(ValueError):
    """A route file was refused; the message is one line naming the route and the field."""


class AdapterKind(StrEnum):
    """The built-in adapters' names (``RouteSpec.adapter`` is any installed adapter's name: a string; these
    compare equal to it)."""

    JOBS = "jobs"  # submit / poll with an Idempotency-Key (vendors/jobs.py)
    PREDICTIONS = "predictions"  # Replicate's predictions API, no idempotency key (vendors/predictions.py)
    OPENAI = "openai"  # OpenAI-compatible chat and image generation, synchronous (vendors/openai.py)
    LOCAL = "local"  # work that costs no vendor money, run by the worker itself (vendors/local.py)
    QUEUE = "queue"  # a queue-style API (fal's): submit, status, result, cancel; no key (vendors/queue.py)


class VendorMode(StrEnum):
    """What the vendor can do for us after a crash (reconcile.operations)."""

    IDEMPOTENT = "idempotent"  # same key → same job, no new charge (while it remembers the key), and lookup
    LOOKUP_ONLY = "lookup_only"  # no deduplication, but jobs can be found by key
    NONE = "none"  # neither: after a crash the vendor cannot say whether it ran


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


ADAPTER_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")  # what an entry point name may be
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
JobStatusName = Literal["running", "succeeded", "failed", "cancelled"]
_FIELD_NAME = r"^[A-Za-z_][A-Za-z0-9_-]{0,99}$"


def placeholders(template: str) -> list[str]:
    """The ``{names}`` of a path template, in order."""
    return _PLACEHOLDER.findall(template)


def path_template(value: str) -> str:
    """A path template's syntax (ValueError, one line): relative to the route's base URL, beginning with
    ``/``, no scheme, host, fragment or ``..`` segment, ``{placeholders}`` balanced and named."""
    if not value.startswith("/") or value.startswith("//") or "://" in value:
        raise ValueError(f"must be a path beginning with / (no scheme or host), got {value[:60]!r}")
    if "#" in value or any(c.isspace() or ord(c) < 0x20 for c in value):
        raise ValueError(f"must hold no fragment, space or control character: {value[:60]!r}")
    if ".." in value.split("?", 1)[0].split("/"):
        raise ValueError(f"must hold no '..' segment: {value[:60]!r}")
    if _PLACEHOLDER.sub("", value).count("{") or _PLACEHOLDER.sub("", value).count("}"):
        raise ValueError(f"has an unbalanced brace: {value[:60]!r}")
    for name in placeholders(value):
        if not name.isidentifier():
            raise ValueError(f"{{{name}}} is not a placeholder name: {value[:60]!r}")
    return value


class JobShape(_Strict):
    """The jobs protocol in a vendor's words (the ``jobs`` adapter; the defaults are the simulator's).

    ``statuses`` replaces the vocabulary whole: every word the vendor reports, mapped to ours (a word not
    listed is an unreadable answer, ``VendorBadResponse``); it must name a running, a succeeded and a failed
    word.
    """

    id_field: str = Field(default="id", pattern=_FIELD_NAME)
    status_field: str = Field(default="status", pattern=_FIELD_NAME)
    list_field: str = Field(default="jobs", pattern=_FIELD_NAME)  # the lookup's list in its answer
    statuses: dict[Annotated[str, Field(min_length=1, max_length=100)], JobStatusName] = Field(
        default_factory=lambda: {s: s for s in ("running", "succeeded", "failed", "cancelled")},
        max_length=100,
    )

    @field_validator("statuses")
    @classmethod
    def _every_end(cls, value: dict[str, str]) -> dict[str, str]:
        missing = [s for s in ("running", "succeeded", "failed") if s not in value.values()]
        if missing:
            raise ValueError(f"must map a vendor word to {', '.join(missing)}")
        return value


class Price(_Strict):
    """What a call costs where the vendor does not say (every part optional; they add up)."""

    per_call: Amount = Decimal(0)
    per_second: Amount = Decimal(0)  # per second of output (or of compute, as the vendor bills)
    per_1k_input_tokens: Amount = Decimal(0)
    per_1k_output_tokens: Amount = Decimal(0)

    def cost(self, *, seconds: float = 0.0, tokens_in: int = 0, tokens_out: int = 0) -> Decimal:
        """The priced cost of one call, not yet rounded (rules.money.vendor_amount rounds it up)."""
        return (
            self.per_call
            + self.per_second * Decimal(repr(float(seconds)))
            + self.per_1k_input_tokens * tokens_in / 1000
            + self.per_1k_output_tokens * tokens_out / 1000
        )


class Timeouts(_Strict):
    request: Seconds = 10.0  # one HTTP request (a submit, a poll, a download's first byte)
    download: Seconds = 300.0  # a whole result download


class Breaker(_Strict):
    """When the route's shared circuit breaker opens, and for how long (rules.routing.BreakerPolicy)."""

    window: Seconds = 60.0  # calls counted for the error rate
    min_calls: int = Field(default=4, ge=1)  # fewer calls in the window never trip it
    error_rate: float = Field(default=0.5, gt=0, le=1)  # failures / calls at or above this trips it
    open_for: Seconds = 30.0  # rest before the half-open probe
    quality_window: Seconds = 3600.0  # first-pass reviews counted for the pass rate
    quality_min_reviews: int = Field(default=4, ge=1)
    quality_pass_rate: float = Field(default=0.5, ge=0, le=1)  # a first-pass rate below this trips it

    def policy(self) -> BreakerPolicy:
        return BreakerPolicy(
            window_s=self.window,
            min_calls=self.min_calls,
            error_rate=self.error_rate,
            open_for_s=self.open_for,
            quality_window_s=self.quality_window,
            quality_min_reviews=self.quality_min_reviews,
            quality_pass_rate=self.quality_pass_rate,
        )


class UploadSpec(_Strict):
    """Where a vendor that fetches no outside URL takes input files (``inputs: upload``): a multipart POST of
    each file to ``path`` (its own origin, its own credential), the URL it answers to use in the request."""

    path: str = Field(pattern=r"^/[A-Za-z0-9_./~-]{0,300}$")  # relative to base_url, like the adapter's paths
    field: str = Field(default="content", pattern=r"^[A-Za-z0-9_.-]{1,64}$")  # the multipart field
    # Where the answer's JSON holds the file's URL: a dotted path ("urls.get": Replicate's Files API).
    url_field: str = Field(default="url", pattern=r"^[A-Za-z0-9_]{1,64}(\.[A-Za-z0-9_]{1,64}){0,4}$")
    max_bytes: Bytes = 256 * 1024 * 1024  # a larger input is not sent (the node fails, nothing paid)


class CallbackSpec(_Strict):
    """How the vendor's calls to ``webhook_url`` are verified by the webhook receiver (``ledgerflow webhooks
    serve``, ``ledgerflow.webhooks``). A callback only wakes the worker waiting on its operation: the worker
    then reads the job from the vendor itself, so nothing in a callback's body is trusted for money or
    output."""

    # The NAME of the variable holding the signing secret (like credential_env), read by the receiver only.
    secret_env: str = Field(pattern=ENV_NAME)
    # standard: Standard Webhooks (webhook-id, webhook-timestamp, webhook-signature; Replicate's);
    # hmac-sha256: the hex HMAC-SHA256 of the raw body in ``header`` (an optional ``sha256=`` prefix).
    scheme: Literal["standard", "hmac-sha256"] = "standard"
    header: str = Field(default="X-Signature", pattern=r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,100}$")
    # How long a worker waits for a callback before it polls the vendor anyway (the polling fallback).
    window: Seconds = 60.0
    # standard: the most a callback's webhook-timestamp may be from the receiver's clock, either way.
    tolerance: Seconds = 300.0


class RouteSpec(_Strict):
    """One executor's route (or a fallback route another route lists)."""

    # The name of an installed adapter (an entry point of ``ledgerflow.adapters``; AdapterKind: the built-in
    # ones). Checked against what is installed when a route file loads (``vendors.plugins.check_table``).
    adapter: str = AdapterKind.JOBS.value
    base_url: str | None = None  # None: LEDGERFLOW_VENDOR_URL (the embedded simulator)
    credential_env: str = Field(default=DEFAULT_CREDENTIAL_ENV, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
    # How the credential is sent (vendors/auth.py): bearer by default; the secrets are always *_env names.
    auth: AuthConfig = BearerAuth()
    # Static headers of every request to the route's own origin: no Authorization, Cookie, Host …
    headers: dict[str, str] = Field(default_factory=dict, max_length=50)
    # The adapter's request paths by name, overriding its defaults (``jobs``: submit, get, cancel, find,
    # charges), relative to base_url; each holds exactly the {placeholders} of the default it replaces.
    paths: dict[str, Annotated[str, AfterValidator(path_template)]] = Field(
        default_factory=dict, max_length=50
    )
    shape: JobShape | None = None  # the jobs protocol's words (None: the defaults)
    mode: VendorMode = VendorMode.IDEMPOTENT
    key_retention: Seconds = 24 * 3600.0
    max_accept_seconds: Seconds = 30.0
    price: Price = Price()
    # Jobs in flight on this route at once, across every task and worker (None: no quota). A dispatch that
    # finds it full waits in the route's queue by its task's priority (rules.routing.rank); every
    # ``priority_aging`` waited moves it up a class, so nothing starves.
    concurrency: int | None = Field(default=None, ge=1, le=10000)
    priority_aging: Seconds = 60.0
    # Spend per calendar month (UTC) on this route, across every task and worker: the vendor contract's
    # ceiling (None: no cap). A budget scope of its own, ``route:NAME:YYYY-MM`` (ledger.accounts.hold_route).
    monthly_cap: Amount | None = Field(
        default=None,
        description="spend per calendar month (UTC) on this route across every task: the account"
        " route:NAME:YYYY-MM, created with this ceiling by the month's first dispatch",
    )
    timeouts: Timeouts = Timeouts()
    # Origins besides base_url's that receive the key with a result download (a CDN that wants it): a bare
    # host is https on port 443; ``http://host:port`` only in dev mode (deployment_table refuses it outside).
    allow_hosts: tuple[str, ...] = ()
    # Origins on loopback, private or link-local addresses that result URLs may name (downloaded without the
    # key). Any other result URL resolving there (a cloud's metadata address, the object store, /metrics) is
    # refused before anything connects. The route's own origin and its allow_hosts need no entry here.
    allow_private: tuple[str, ...] = ()
    max_result_bytes: Bytes = DEFAULT_MAX_RESULT_BYTES  # a larger result is refused (invalid_output)
    max_json_bytes: Bytes = DEFAULT_MAX_JSON_BYTES  # a larger API answer is unreadable (VendorBadResponse)
    model: str | None = Field(default=None, max_length=200)  # a predictions version or an OpenAI model
    # Where the vendor calls back when a job ends, with ``{operation_key}`` in it (filled in, URL-encoded,
    # per call). A predictions route sends it as the prediction's ``webhook`` (events: completed). Replicate
    # never returns it, so it is not how a lost prediction is found (that is by its version and input).
    webhook_url: str | None = Field(default=None, max_length=1000)
    # How its callbacks are verified and how long a worker waits for one (None: no callbacks; the worker
    # polls). Needs webhook_url.
    callback: CallbackSpec | None = None
    # How input files reach the vendor: ``url`` (default) a URL the store makes for each send (presigned on
    # S3), which the vendor fetches; ``upload`` each file POSTed to the vendor first (``upload``), for a
    # vendor that fetches nothing from outside.
    inputs: Literal["url", "upload"] = "url"
    upload: UploadSpec | None = None
    # The rights the vendor's terms grant its outputs (license, holder …), recorded with each artifact whose
    # answer states none: Replicate's and OpenAI's APIs carry no rights metadata, and the compliance check
    # (rules.checks) blocks an artifact without. A vendor's own rights metadata, where it gives some, wins.
    rights: dict[str, Annotated[str, Field(max_length=200)]] | None = Field(default=None, max_length=20)
    breaker: Breaker = Breaker()
    # 5xx answers this vendor gives only when it did NOT take the request: refusals, so a request refused this
    # way may be resent or go to a fallback. None by default: a route lists a status only where its vendor
    # documents that the status means nothing was accepted (a gateway in front of it — nginx, Envoy, a cloud
    # load balancer — answers 502/503/504 when its upstream timed out, after it may have accepted). Any
    # other 5xx, a timeout or a reset leaves the send maybe-sent: it is looked up before anything is resent.
    refused_statuses: tuple[int, ...] = ()
    # Fallbacks, in order: other routes of this table that may serve this executor while its breaker is open.
    fallbacks: tuple[str, ...] = ()
    # As a fallback: the request fields it names differently ({ours: theirs}), its regression set (a file,
    # relative to the route file) and how long a passed regression run qualifies it.
    convert: dict[str, str] = Field(default_factory=dict)
    regression: str | None = None
    qualification_max_age: Seconds = 7 * 86400.0

    @field_validator("allow_hosts", "allow_private")
    @classmethod
    def _origin_list(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if info.field_name == "allow_private" and any("*" in entry for entry in value):
            raise ValueError("a wildcard is for allow_hosts only (a private address is named exactly)")
        return _origins(value)

    @field_validator("adapter", mode="before")
    @classmethod
    def _adapter_name(cls, value: Any) -> Any:
        value = value.value if isinstance(value, AdapterKind) else value  # a plain str, however it was given
        if isinstance(value, str) and not ADAPTER_NAME.match(value):
            raise ValueError(f"{value[:60]!r} is not an adapter name (letters, digits, '_', '.', '-')")
        return value

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        return static_headers(value)

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http(s) URL, got {value[:60]!r}")
        if value.count("{operation_key}") != 1 or re.search(r"\{(?!operation_key\})", value):
            raise ValueError("must hold {operation_key} once, and no other {placeholder}")
        return value

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http(s) URL, got {value[:60]!r}")
        return value.rstrip("/") if value else value

    @model_validator(mode="after")
    def _callback_has_url(self) -> RouteSpec:
        if self.callback is not None and self.webhook_url is None:
            raise ValueError(
                "callback needs webhook_url (where the vendor calls, with {operation_key} in it)"
            )
        return self

    @model_validator(mode="after")
    def _upload_has_a_place(self) -> RouteSpec:
        if self.inputs == "upload" and self.upload is None:
            raise ValueError("inputs: upload needs upload: {path: …} (where the vendor takes the files)")
        return self

    @model_validator(mode="after")
    def _auth_header_apart(self) -> RouteSpec:
        named = getattr(self.auth, "name", None) if self.auth.scheme == "header" else None
        if named is not None and named.lower() in {h.lower() for h in self.headers}:
            raise ValueError(f"headers: {named!r} is the auth header (auth.name): it carries the credential")
        return self


class RouteTable(_Strict):
    """Every route of this deployment, and the reviewers it can run."""

    routes: dict[str, RouteSpec]
    reviewers: frozenset[str] = DEFAULT_REVIEWERS

    def route(self, executor: str) -> RouteSpec:
        try:
            return self.routes[executor]
        except KeyError:
            raise RouteError(f"executor {executor!r} has no route") from None

    @model_validator(mode="after")
    def _fallbacks_exist(self) -> RouteTable:
        for name, spec in self.routes.items():
            for fb in spec.fallbacks:
                if fb == name or fb not in self.routes:
                    raise ValueError(f"route {name!r}: fallback {fb!r} is not another route of this table")
                if self.routes[fb].regression is None:
                    raise ValueError(f"route {fb!r}: a fallback needs a regression set (regression: FILE)")
        return self

    def names(self) -> Routes:
        """What plan validation checks a plan against."""
        unpriced = frozenset(
            executor
            for executor in self.routes
            if any(not r.free and not r.declared for r in self.prices(executor))
        )
        return Routes(executors=frozenset(self.routes), reviewers=self.reviewers, unpriced=unpriced)

    def prices(self, executor: str) -> tuple[RoutePrice, ...]:
        """The declared prices of the routes that may serve ``executor``, primary first (rules.pricing)."""
        return tuple(self._price(c.route) for c in self.chain(executor))

    def _price(self, name: str) -> RoutePrice:
        spec, price = self.routes[name], self.routes[name].price
        return RoutePrice(
            route=name,
            per_call=price.per_call,
            per_second=price.per_second,
            per_1k_tokens=max(price.per_1k_input_tokens, price.per_1k_output_tokens),
            free=spec.adapter == AdapterKind.LOCAL,
        )

    def caps(self, executor: str) -> tuple[tuple[str, Decimal], ...]:
        """``(route, monthly_cap)`` of the routes that may serve ``executor`` and have a cap (``Routing``)."""
        return tuple(
            (c.route, cap)
            for c in self.chain(executor)
            if (cap := self.routes[c.route].monthly_cap) is not None
        )

    def chain(self, executor: str) -> tuple[Candidate, ...]:
        """The routes that may serve ``executor``, primary first (rules.routing.choose)."""
        spec = self.route(executor)
        primary = Candidate(executor, spec.breaker.open_for)
        return (
            primary,
            *(
                Candidate(fb, self.routes[fb].breaker.open_for, self.routes[fb].qualification_max_age)
                for fb in spec.fallbacks
            ),
        )


def default_table(mode: VendorMode = VendorMode.IDEMPOTENT) -> RouteTable:
    """The built-in table: every default executor on the ``jobs`` adapter, local work on ``local``."""
    routes = {name: RouteSpec(mode=mode) for name in sorted(DEFAULT_EXECUTORS)}
    routes.update({name: RouteSpec(adapter=AdapterKind.LOCAL) for name in sorted(LOCAL_EXECUTORS)})
    return RouteTable(routes=routes)


DEFAULT_ROUTES: Final = default_table().names()


def parse_table(raw: Any, *, where: str = "routes") -> RouteTable:
    """Validate a route document; RouteError names the route and field of the first problem."""
    if not isinstance(raw, dict) or not isinstance(raw.get("routes"), dict) or not raw["routes"]:
        raise RouteError(f"{where}: the document must be a mapping with a non-empty `routes:` mapping")
    try:
        table = RouteTable.model_validate(raw)
    except ValidationError as e:
        raise RouteError(_one_line(e, where)) from None
    from vendors.plugins import check_table  # imports installed plugins: never while this module loads

    try:
        check_table(table)
    except RouteError as e:
        raise RouteError(f"{where}: {e}") from None
    return table


def _one_line(e: ValidationError, where: str) -> str:
    """The first problem of a route document, as one line naming the route and the field."""
    first = e.errors()[0]
    loc = [str(p) for p in first["loc"]]
    if len(loc) > 3 and loc[0] == "routes" and loc[2] == "auth" and loc[3] in SCHEMES:
        del loc[3]  # the scheme's tag: the route file has no such level
    if loc[:1] == ["routes"] and len(loc) >= 2:  # a route's field, or the route as a whole (its message
        place = f"route {loc[1]!r}:" + (f" {'.'.join(loc[2:])}" if len(loc) > 2 else "")  # names the field)
    elif not loc:  # the table as a whole (a fallback naming another route): the message names the route
        place = ""
    else:
        place = ".".join(loc)
    msg = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "is not a known field"
    elif first["type"] == "missing":
        msg = "is required"
    elif first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        tag = (first.get("ctx") or {}).get("tag")
        msg = (f"scheme {tag!r} is not one of " if tag else "needs a scheme: one of ") + ", ".join(SCHEMES)
    return f"{where}: {place} {msg}" if place else f"{where}: {msg}"


def load_table(path: Path | None, *, mode: VendorMode = VendorMode.IDEMPOTENT) -> RouteTable:
    """The route file at ``path``, or the built-in table (with ``mode``) when there is none."""
    if path is None:
        return default_table(mode)
    try:
        text = path.read_text()
    except OSError as e:
        raise RouteError(f"route file {path}: {e.strerror or e}") from None
    # An operator's file, not a plan author's: anchors and aliases are allowed here (tools that write route
    # files, yaml.safe_dump among them, emit them for repeated values).
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise RouteError(
            f"route file {path}: not valid YAML" + (f" at line {mark.line + 1}" if mark else "")
        ) from None
    return parse_table(raw, where=f"route file {path}")


def deployment_table(settings: Settings) -> RouteTable:
    """This deployment's routes (``LEDGERFLOW_ROUTES_FILE``, or the built-in table in the configured vendor
    mode). ConfigError (one line) if the route file is unusable."""
    try:
        table = load_table(settings.routes_file, mode=VendorMode(settings.vendor_mode))
    except RouteError as e:
        raise ConfigError(str(e)) from None
    if settings.dev:
        return with_simulator_cdn(table, settings.vendor_url_or_none())
    for name, spec in table.routes.items():  # outside dev mode the key never travels in clear text
        for entry in spec.allow_hosts:
            if origin(entry)[0] != "https":
                raise ConfigError(f"route {name!r}: allow_hosts {entry!r} is not https (only in dev mode)")
        if isinstance(spec.auth, OAuth2ClientCredentials) and not spec.auth.token_url.startswith("https://"):
            raise ConfigError(f"route {name!r}: auth.token_url is not https (only in dev mode)")
    return table


def with_simulator_cdn(table: RouteTable, vendor_url: str | None) -> RouteTable:
    """Dev mode: the routes on a loopback LEDGERFLOW_VENDOR_URL (the embedded simulator) allow-list its CDN
    (the simulator's port + ``CDN_PORT_OFFSET``), and only that: every other loopback port stays refused.
    A predictions route's outputs need the token (Replicate's do, and so do the simulator's): its CDN is on
    ``allow_hosts``; every other route fetches from it without the key (``allow_private``)."""
    if not vendor_url:
        return table
    parts = urlsplit(vendor_url)
    try:
        loopback = ipaddress.ip_address(parts.hostname or "").is_loopback
    except ValueError:
        loopback = parts.hostname == "localhost"
    if not loopback or parts.port is None:
        return table
    cdn = f"{parts.scheme}://{parts.hostname}:{parts.port + CDN_PORT_OFFSET}"

    def allowed(spec: RouteSpec) -> RouteSpec:
        if spec.base_url is not None or spec.adapter == AdapterKind.LOCAL:
            return spec
        field = "allow_hosts" if spec.adapter == AdapterKind.PREDICTIONS else "allow_private"
        have: tuple[str, ...] = getattr(spec, field)
        return spec if cdn in have else spec.model_copy(update={field: (*have, cdn)})

    routes = {name: allowed(spec) for name, spec in table.routes.items()}
    return table.model_copy(update={"routes": routes})


def json_schema() -> dict[str, Any]:
    """The route file's JSON schema (for editors and CI)."""
    return RouteTable.model_json_schema()
