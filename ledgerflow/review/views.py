"""What the reviewer page reads: a request's budget choices, and the artifacts a task's fold registered.

The queue and the request detail themselves come from ``ledgerflow.views.people`` (the CLI's views).
Everything here is synchronous and hits Postgres: the app calls it from a thread pool.
"""

from __future__ import annotations

import hashlib
import logging
import mimetypes
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn
from urllib.parse import urlparse

from artifacts import ArtifactCorrupt, ArtifactError, ArtifactStore, LocalStore, S3Store
from artifacts.local import path_of
from artifacts.s3 import split_s3_uri
from ledgerflow import client
from ledgerflow.client import ClientError
from rules.events import TaskCreated, parse
from rules.plan import budget_scopes
from rules.projection import fold
from runtime.settings import ConfigError, Settings
from vendors.routes import deployment_table

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
log = logging.getLogger("ledgerflow.review")
_SHOWN: Final = frozenset(MEDIA_TYPES.values())
# An artifact no media element shows, up to this size, is read by the page and shown as text (a storyboard,
# a script, a lesson, a JSON answer) when its bytes are UTF-8 text; the page never renders it as HTML.
TEXT_INLINE_MAX: Final = 256 * 1024


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


def route_names(settings: Settings) -> list[str]:
    """The deployment's route names (what a re-route may name); none if the route file is unusable (the
    worker refuses re-routes then too)."""
    try:
        return sorted(deployment_table(settings).routes)
    except ConfigError:
        return []


def task_chain(settings: Settings, task_id: str) -> list[str]:
    """The task's budget scopes, outermost first (``project:P``, ``episode:P/E``, ``task:T``): what a login's
    scopes are checked against. ClientError if there is no such task."""
    chain = task_chains(settings, [task_id]).get(task_id)
    if chain is None:
        raise ClientError(f"no task {task_id!r} in the ledger")
    return chain


def task_chains(settings: Settings, task_ids: Iterable[str]) -> dict[str, list[str]]:
    """Each task's budget scopes, from its first event (the plan it was created with); a task the ledger
    does not hold is left out. One connection for all of them."""
    rec = client.recorder(settings)
    try:
        out: dict[str, list[str]] = {}
        for task_id in task_ids:
            first = rec.read_events(task_id, limit=1)
            if first and isinstance(created := parse(first[0]), TaskCreated):
                out[task_id] = [scope for scope, _ in budget_scopes(created.plan, task_id)]
        return out
    finally:
        rec.dispose()


def find_artifact(settings: Settings, task_id: str, sha256: str) -> dict[str, Any] | None:
    """The artifact with this sha256 that the task's fold registered, if any: a node's output (made, or
    reused), which is also what every stage downstream receives through ``inputs:``. Nothing else in the
    ledger names an artifact the page may serve: a value that merely looks like a reference (a ``uri`` and a
    ``sha256`` in a plan's free ``input``, say) is what someone typed, not what a worker stored. ClientError
    if there is no such task."""
    p = fold(client.events(settings, task_id))
    for node in p.nodes.values():
        for output in node.outputs:
            if output.artifact.get("sha256") == sha256:
                return output.artifact
    return None


def in_store(store: ArtifactStore, uri: str) -> bool:
    """Whether ``uri`` lies inside ``store`` as configured: under the local store's root (after ``..`` and
    symlinks are resolved), or in the S3 store's bucket under its prefix. The stores themselves read any URI
    of their kind (an earlier root's, another prefix's); the page serves only the configured store's."""
    try:
        if isinstance(store, LocalStore):
            path = Path(os.path.realpath(path_of(uri)))
            return path.is_relative_to(store.root) and path != store.root
        if isinstance(store, S3Store):
            bucket, key = split_s3_uri(uri)
            parts = key.split("/")
            if bucket != store.bucket or any(part in ("", ".", "..") for part in parts):
                return False
            return not store.prefix or key.startswith(f"{store.prefix}/")
    except (ArtifactError, ValueError):
        return False
    return False


def verified(chunks: Iterable[bytes], sha256: str, size: int | None, what: str) -> Iterator[bytes]:
    """``chunks`` as they come, checked against the recorded ``sha256`` (and ``size``, if recorded).

    The last chunk is held back until the whole stream has hashed to ``sha256``: bytes that do not match
    never arrive whole. A mismatch (or more bytes than recorded) is logged as an error naming ``what`` and
    raised as ArtifactCorrupt, which makes the server break the connection instead of ending the response
    as if it were fine (the client sees a body cut short)."""
    digest = hashlib.sha256()
    total = 0
    held: bytes | None = None
    for chunk in chunks:
        total += len(chunk)
        if size is not None and total > size:
            _corrupt(what, f"holds more than the {size} bytes recorded")
        digest.update(chunk)
        if held is not None:
            yield held
        held = chunk
    if digest.hexdigest() != sha256:
        _corrupt(what, f"does not hash to its sha256 (the store's bytes hash to {digest.hexdigest()[:16]}…)")
    if size is not None and total != size:
        _corrupt(what, f"holds {total} bytes, not the {size} recorded")
    if held is not None:
        yield held


def _corrupt(what: str, problem: str) -> NoReturn:
    message = f"{what} {problem}: the response was ended before its last bytes"
    log.error(message)
    raise ArtifactCorrupt(message)


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
