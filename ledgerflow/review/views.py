"""What the reviewer page reads: a request's budget choices, and the artifacts a task's ledger names.

The queue and the request detail themselves come from ``ledgerflow.views.people`` (the CLI's views).
Everything here is synchronous and hits Postgres: the app calls it from a thread pool.
"""

from __future__ import annotations

import mimetypes
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlparse

from ledgerflow import client
from rules.plan import budget_scopes
from rules.projection import fold
from runtime.settings import Settings

# A probed media format (media.probe's short names) -> the content type a browser plays or shows.
MEDIA_TYPES: Final = {
    "mp4": "video/mp4",
    "mov": "video/quicktime",
    "3gp": "video/3gpp",
    "3g2": "video/3gpp2",
    "webm": "video/webm",
    "matroska": "video/x-matroska",
    "m4a": "audio/mp4",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "ogg": "audio/ogg",
    "flac": "audio/flac",
    "png": "image/png",
    "jpeg": "image/jpeg",
    "mjpeg": "image/jpeg",
    "gif": "image/gif",
    "webp": "image/webp",
}
OCTET_STREAM: Final = "application/octet-stream"
_SHOWN: Final = frozenset(MEDIA_TYPES.values())


@dataclass(frozen=True, slots=True)
class BudgetChoices:
    """The scopes an add_budget may raise (outermost first) and the one to offer first."""

    scopes: list[str]
    default: str


def budget_choices(settings: Settings, task_id: str, request_id: str) -> BudgetChoices:
    """The task's budget scopes; the default is the scope that refused (a budget escalation names it), else
    the task's own. ClientError if there is no such task."""
    p = fold(client.events(settings, task_id))
    scopes = [scope for scope, _ in budget_scopes(p.plan, task_id)]
    r = p.requests.get(request_id)
    refused = r.request.budget_scope if r is not None else None
    return BudgetChoices(scopes, refused if refused in scopes else scopes[-1])


def find_artifact(settings: Settings, task_id: str, sha256: str) -> dict[str, Any] | None:
    """The artifact reference with this sha256 that the task's ledger records, if any: the page serves only
    what a task it shows produced or used, never an arbitrary URI. ClientError if there is no such task."""
    for stored in client.events(settings, task_id):
        for ref in _refs(stored.payload):
            if ref["sha256"] == sha256:
                return ref
    return None


def _refs(value: Any) -> Iterator[dict[str, Any]]:
    """Every artifact reference (a mapping with a ``uri`` and a ``sha256``) anywhere in an event payload."""
    if isinstance(value, dict):
        if isinstance(value.get("uri"), str) and isinstance(value.get("sha256"), str):
            yield value
            return
        for v in value.values():
            yield from _refs(v)
    elif isinstance(value, list):
        for v in value:
            yield from _refs(v)


def media_type(artifact: dict[str, Any]) -> str:
    """The content type to serve an artifact with: from its probed format (the file's own word, recorded
    when it was stored), else the URI's extension, else ``application/octet-stream``. Only the media types
    above are ever served as themselves: anything else (HTML, SVG: scripts on this origin) is a download."""
    media = artifact.get("media")
    fmt = media.get("format") if isinstance(media, dict) else None
    if isinstance(fmt, str) and fmt.lower() in MEDIA_TYPES:
        return MEDIA_TYPES[fmt.lower()]
    guessed, _ = mimetypes.guess_type(urlparse(str(artifact.get("uri", ""))).path)
    return guessed if guessed in _SHOWN else OCTET_STREAM


def element(content_type: str) -> str | None:
    """The HTML element that shows this content type inline (``img``, ``video``, ``audio``), if any."""
    kind = content_type.partition("/")[0]
    return {"image": "img", "video": "video", "audio": "audio"}.get(kind)
