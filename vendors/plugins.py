"""Vendor adapters are plugins, found by name through the entry point group ``ledgerflow.adapters``.

A distribution registers an adapter the way ledgerflow registers its four (``pyproject.toml``)::

    [project.entry-points."ledgerflow.adapters"]
    acme = "acme_vendor.adapter:AcmeAdapter"

and a route names it: ``adapter: acme``. The entry point names a **factory** of the adapter, one of:

* a class with a ``build(context: AdapterContext) -> VendorAdapter`` classmethod — every
  ``vendors.httpbase.HttpVendor`` subclass inherits one that builds ``cls(route, base_url, api_key,
  client=..., credentials=...)``, so an HTTP adapter built like ``jobs`` needs nothing more;
* a function ``factory(context: AdapterContext) -> VendorAdapter``.

:class:`AdapterContext` is everything an adapter may be built from: the route, its base URL, the credential
reader, the worker's shared HTTP client and the artifact stores (the ``local`` adapter reads its inputs
through them). The factory (or its module) may declare ``ADAPTER_PROTOCOL_VERSION`` — the major version of
``vendors.adapter``'s protocol it was written for (an int, or ``"1.2"``); one declaring another major than
this ledgerflow's is refused. Not declared: taken as written for the current one.

Every refusal is one line naming the route, the adapter and why (``RouteError``), never a traceback: a name
that is not installed (with the installed ones), a name two distributions claim, a plugin that cannot be
imported (the entry point and the error), another protocol version. A route file is checked when it loads
(``check_table``, from ``vendors.routes.parse_table``) and every table again when the worker's adapters are
set up (``vendors.registry.Adapters``). The built-in names resolve even where ledgerflow runs from a source
tree whose entry points were never installed.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version
from typing import TYPE_CHECKING, Any, Final

import httpx

from vendors.adapter import ADAPTER_PROTOCOL_VERSION, VendorAdapter
from vendors.auth import SignedAuth, load_hook
from vendors.routes import RouteError, RouteSpec, RouteTable, placeholders

if TYPE_CHECKING:
    from artifacts.store import ArtifactStore

ADAPTER_GROUP: Final = "ledgerflow.adapters"
OWN_DISTRIBUTION: Final = "ledgerflow"
# The built-in adapters, as pyproject.toml registers them (and where its entry points are not installed).
BUILTIN: Final = {
    "jobs": "vendors.jobs:JobsAdapter",
    "predictions": "vendors.predictions:PredictionsAdapter",
    "openai": "vendors.openai:OpenAIAdapter",
    "local": "vendors.local:LocalAdapter",
    "queue": "vendors.queue:QueueAdapter",
}
# What every adapter the registry builds must have (vendors.adapter.VendorAdapter).
PROTOCOL: Final = ("route", "capabilities", "submit", "get", "find_by_key", "cancel", "download", "charged")
PROTOCOL_METHODS: Final = ("aclose",)

Factory = Callable[["AdapterContext"], VendorAdapter]


@dataclass(frozen=True, slots=True)
class AdapterContext:
    """What a factory builds a route's adapter from (adapter protocol version 1).

    Args:
        route_name: The route's name in the table (an executor, or a fallback route).
        route: The route as validated (its ``auth``, ``headers``, ``paths``, ``shape`` among the rest).
        base_url: The route's ``base_url``, else the deployment's vendor URL; None where neither is set.
        credential: Reads the secret an environment variable NAME holds (``Settings.credential``: raises
            ConfigError if unset). Read inside the worker only; never put a secret in an error or a log.
        client: The HTTP client every adapter of the worker shares (do not close it).
        store_for: The artifact store that can read a URI (inputs the worker reads itself).
    """

    route_name: str
    route: RouteSpec
    base_url: str | None
    credential: Callable[[str], str]
    client: httpx.AsyncClient
    store_for: Callable[[str], ArtifactStore]

    def require_base_url(self) -> str:
        """The base URL; RouteError where the route names none and the deployment has no vendor URL."""
        if not self.base_url:
            raise RouteError(
                f"route {self.route_name!r}: no base_url, and no LEDGERFLOW_VENDOR_URL to default to"
            )
        return self.base_url

    def api_key(self) -> str:
        """The route's credential (the variable its ``credential_env`` names)."""
        return self.credential(self.route.credential_env)


@dataclass(frozen=True, slots=True)
class Installed:
    """One installed adapter: its name, what its entry point names, and the distribution providing it."""

    name: str
    value: str  # module:attribute
    distribution: str | None  # None: a built-in run from a source tree (no installed distribution)
    version: str | None

    @property
    def built_in(self) -> bool:
        return self.distribution in (None, OWN_DISTRIBUTION) and BUILTIN.get(self.name) == self.value

    @property
    def origin(self) -> str:
        """Where it comes from: ``ledgerflow 0.1.0 (built in)``, ``acme-vendor 1.2``."""
        label = " ".join(p for p in (self.distribution or OWN_DISTRIBUTION, self.version) if p)
        return f"{label} (built in)" if self.built_in else label

    def describe(self) -> str:
        return f"entry point {self.name} = {self.value} ({self.origin})"


_scanned: tuple[tuple[str, ...], dict[str, list[Installed]]] | None = None
_loaded: dict[Installed, Factory] = {}


def installed() -> dict[str, list[Installed]]:
    """Every adapter name installed, with each entry point claiming it (more than one: ambiguous).

    Read from the distributions' metadata (nothing is imported), once per ``sys.path``: call ``refresh``
    after installing a distribution into a directory already on it.
    """
    global _scanned
    key = tuple(sys.path)
    if _scanned is not None and _scanned[0] == key:
        return _scanned[1]
    found: dict[str, list[Installed]] = {}
    for ep in entry_points(group=ADAPTER_GROUP):
        dist = ep.dist
        entry = Installed(ep.name, ep.value, dist.name if dist else None, dist.version if dist else None)
        if entry not in found.setdefault(ep.name, []):
            found[ep.name].append(entry)
    for name, value in BUILTIN.items():  # a source tree whose entry points were never installed
        if not any(e.built_in for e in found.get(name, [])):
            found.setdefault(name, []).append(Installed(name, value, None, _own_version()))
    _scanned = (key, found)
    return found


def refresh() -> None:
    """Forget what was found and loaded (a distribution was installed or removed meanwhile)."""
    global _scanned
    _scanned = None
    _loaded.clear()
    importlib.invalidate_caches()


def _own_version() -> str | None:
    try:
        return version(OWN_DISTRIBUTION)
    except PackageNotFoundError:
        return None


def find(name: str) -> Installed:
    """The adapter ``name``; RouteError (one line, no route named) if it is not installed or is ambiguous."""
    everything = installed()
    claims = everything.get(name, [])
    if not claims:
        known = ", ".join(sorted(everything)) or "none"
        raise RouteError(f"{name!r} is not an installed adapter (installed: {known})")
    if len(claims) > 1:
        raise RouteError(
            f"{name!r} is claimed by {len(claims)} entry points of {ADAPTER_GROUP} "
            f"({'; '.join(c.describe() for c in claims)}): uninstall or rename all but one"
        )
    return claims[0]


def load(name: str) -> Factory:
    """The factory of the adapter ``name``, imported and checked (RouteError, one line)."""
    entry = find(name)
    factory = _loaded.get(entry)
    if factory is None:
        factory = _loaded[entry] = _factory(entry, _import(entry))
    return factory


def _import(entry: Installed) -> Any:
    try:
        return EntryPoint(entry.name, entry.value, ADAPTER_GROUP).load()
    except Exception as e:  # whatever a plugin raises while importing: one line, never a traceback
        raise RouteError(f"{entry.name!r}: {entry.describe()} cannot be imported: {one_line(e)}") from None


def _factory(entry: Installed, target: Any) -> Factory:
    raw, major = declared_version(target)
    if major is not None and major != ADAPTER_PROTOCOL_VERSION:
        raise RouteError(
            f"{entry.name!r}: {entry.describe()} declares ADAPTER_PROTOCOL_VERSION {raw!r}; this ledgerflow "
            f"speaks adapter protocol {ADAPTER_PROTOCOL_VERSION}"
        )
    build = getattr(target, "build", None)
    if callable(build):
        return build  # type: ignore[no-any-return]
    if isinstance(target, type) or not callable(target):
        raise RouteError(
            f"{entry.name!r}: {entry.describe()} names neither a factory function nor a class with a "
            "build(context) classmethod"
        )
    return target  # type: ignore[no-any-return]


def declared_version(target: Any) -> tuple[Any, int | None]:
    """What ``target`` (else its module) declares as ``ADAPTER_PROTOCOL_VERSION``, and its major version:
    None where nothing is declared, -1 where the declaration is not a version (``1``, ``"1.2"``)."""
    # Its own declaration, or its own module's: never one inherited (a plugin subclassing HttpVendor would
    # otherwise claim whatever version the installed ledgerflow speaks).
    raw = vars(target).get("ADAPTER_PROTOCOL_VERSION") if hasattr(target, "__dict__") else None
    if raw is None:
        module = sys.modules.get(getattr(target, "__module__", None) or "")
        raw = getattr(module, "ADAPTER_PROTOCOL_VERSION", None) if module is not None else None
    if raw is None:
        return None, None
    if isinstance(raw, bool):
        return raw, -1
    if isinstance(raw, int):
        return raw, raw
    head = str(raw).split(".", 1)[0]
    return raw, int(head) if head.isdigit() else -1


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and its message, whitespace collapsed, cut at 300 characters."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def build(context: AdapterContext) -> VendorAdapter:
    """The adapter of ``context.route``, built by its plugin's factory (RouteError, one line, if the plugin
    is unusable or builds something that is not an adapter; what the factory raises otherwise passes —
    ConfigError for a credential that is not set)."""
    name = context.route.adapter
    try:
        factory = load(name)
    except RouteError as e:
        raise RouteError(f"route {context.route_name!r}: adapter {e}") from None
    adapter = factory(context)
    missing = [a for a in (*PROTOCOL, *PROTOCOL_METHODS) if not hasattr(adapter, a)]
    if missing:
        raise RouteError(
            f"route {context.route_name!r}: adapter {name!r} built a {type(adapter).__name__} without "
            f"{', '.join(missing)} (vendors.adapter.VendorAdapter)"
        )
    return adapter


def check_table(table: RouteTable) -> None:
    """Every route's adapter is installed once and loads; its ``paths`` and ``shape`` are ones it reads
    (RouteError, one line naming the route and the field). Plugins are imported here; built-in adapters only
    where a route gives them paths or a shape to check."""
    for route_name, spec in table.routes.items():
        place = f"route {route_name!r}"
        try:
            entry = find(spec.adapter)
            target = None if entry.built_in and not spec.paths and spec.shape is None else load(spec.adapter)
        except RouteError as e:
            raise RouteError(f"{place}: adapter {e}") from None
        check_paths(place, spec, _declared(target, "ROUTE_PATHS"))
        if isinstance(spec.auth, SignedAuth):
            try:
                load_hook(spec.auth.hook)
            except ValueError as e:
                raise RouteError(f"{place}: auth.hook: {e}") from None
        if spec.shape is not None and not _declared(target, "ROUTE_SHAPE"):
            raise RouteError(
                f"{place}: shape is not read by the {spec.adapter!r} adapter (only by jobs-like ones)"
            )


def _declared(factory: Any, attribute: str) -> Any:
    # A class's ``build`` is a bound method: its class declares what it reads.
    owner = getattr(factory, "__self__", factory)
    return getattr(owner, attribute, None)


def check_paths(place: str, spec: RouteSpec, defaults: dict[str, str] | None) -> None:
    """Each of the route's ``paths`` replaces one of the adapter's (``defaults``) and holds exactly its
    placeholders: one line per mistake."""
    if not spec.paths:
        return
    if not defaults:
        raise RouteError(f"{place}: paths: the {spec.adapter!r} adapter has no paths a route may change")
    for name, template in spec.paths.items():
        if name not in defaults:
            raise RouteError(
                f"{place}: paths.{name} is not a path of the {spec.adapter!r} adapter "
                f"(its paths: {', '.join(sorted(defaults))})"
            )
        want, got = placeholders(defaults[name]), placeholders(template)
        for extra in sorted(set(got) - set(want)):
            takes = ", ".join(f"{{{w}}}" for w in want) or "none"
            raise RouteError(f"{place}: paths.{name}: {{{extra}}} is not one of its placeholders ({takes})")
        for absent in want:
            if absent not in got:
                raise RouteError(f"{place}: paths.{name} must hold {{{absent}}}")
        if len(got) != len(set(got)):
            raise RouteError(f"{place}: paths.{name} holds a placeholder twice")
