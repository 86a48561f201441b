"""``ledgerflow keys``: the approver key registry, the operator's side (generate, add, revoke, list).

Every change is an entry in the append-only ``approver_keys`` table with who made it and why: the registry's
audit trail. Private keys never enter the database: ``generate`` writes one to the approver's own key file.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import get_args

from rich.table import Table

from ledgerflow.client import ClientError, recorder
from rules.approvers import ANY, KEY_ID, SCOPE, KeyRecord
from rules.plan import RequestKindName
from runtime.settings import Settings
from runtime.signing import ApproverKey, KeyFileError, load_key_file, parse_public_key
from runtime.signing import generate as new_key

KINDS: tuple[str, ...] = get_args(RequestKindName)


def generate(approver: str, key_id: str, out: Path) -> ApproverKey:
    """A new key pair, its private half written to ``out`` (never overwritten)."""
    _check_id("approver", approver)
    _check_id("key id", key_id)
    if out.exists():
        raise ClientError(f"{out} exists: a key file is never overwritten")
    key = new_key(approver, key_id)
    key.write(out)
    return key


def record_from(
    *,
    key_file: Path | None,
    key_id: str | None,
    approver: str | None,
    public_key: str | None,
    kinds: list[str],
    scopes: list[str],
    not_before: str | None,
    expires: str | None,
) -> KeyRecord:
    """The registry entry the operator described (from a key file, or from the three options). ClientError
    naming the first thing wrong."""
    if key_file is not None:
        try:
            key = load_key_file(key_file)
        except KeyFileError as e:
            raise ClientError(str(e)) from None
        key_id, approver, public_key = key_id or key.key_id, approver or key.approver, key.public_key
    if key_id is None or approver is None or public_key is None:
        raise ClientError("give --key-file, or all of --key-id, --approver and --public-key")
    _check_id("key id", key_id)
    _check_id("approver", approver)
    try:
        public = parse_public_key(public_key)
    except ValueError as e:
        raise ClientError(str(e)) from None
    for k in kinds:
        if k not in KINDS:
            raise ClientError(f"--kind {k[:40]!r} is not one of {', '.join(KINDS)}")
    for s in scopes:
        if not SCOPE.fullmatch(s):
            raise ClientError(f"--scope {s[:60]!r} is not *, project:P, episode:P/E or task:T")
    start, end = _time("--not-before", not_before), _time("--expires", expires)
    if start is not None and end is not None and end <= start:
        raise ClientError("--expires must be after --not-before")
    return KeyRecord(
        key_id=key_id,
        approver=approver,
        public_key=public,
        kinds=tuple(kinds),
        scopes=tuple(scopes) or (ANY,),
        not_before=start,
        expires_at=end,
    )


def add(settings: Settings, record: KeyRecord, *, actor: str, reason: str) -> None:
    rec = recorder(settings)
    try:
        rec.add_key(record, actor=actor, reason=reason)
    finally:
        rec.dispose()


def revoke(settings: Settings, key_id: str, *, actor: str, reason: str) -> str:
    """Revoke ``key_id``; the line to print. ClientError if no such key is registered."""
    if not reason.strip():
        raise ClientError("--reason is required: it is the registry's audit trail")
    rec = recorder(settings)
    try:
        before = rec.key_registry().get(key_id)
        after = rec.revoke_key(key_id, actor=actor, reason=reason)
    finally:
        rec.dispose()
    if after is None:
        raise ClientError(f"no key {key_id!r} in the registry")
    if before is not None and before.revoked_at is not None:
        return f"key {key_id} was already revoked at {before.revoked_at.isoformat()}"
    return f"key {key_id} of {after.approver} revoked"


def listing(settings: Settings) -> list[KeyRecord]:
    rec = recorder(settings)
    try:
        return sorted(rec.key_registry().values(), key=lambda k: (k.approver, k.key_id))
    finally:
        rec.dispose()


def table(records: list[KeyRecord]) -> Table | str:
    if not records:
        return "no approver keys registered"
    t = Table("KEY", "APPROVER", "KINDS", "SCOPES", "VALID", "STATE", box=None)
    now = datetime.now(UTC)
    for k in records:
        valid = f"{_day(k.not_before) or '…'} → {_day(k.expires_at) or '…'}"
        if k.revoked_at is not None:
            state = f"revoked {_day(k.revoked_at)}: {k.revoked_reason}"
        elif k.expires_at is not None and k.expires_at <= now:
            state = "expired"
        elif k.not_before is not None and k.not_before > now:
            state = "not yet valid"
        else:
            state = "active"
        t.add_row(k.key_id, k.approver, ", ".join(k.kinds) or "all", ", ".join(k.scopes), valid, state)
    return t


def _day(t: datetime | None) -> str:
    return "" if t is None else t.strftime("%Y-%m-%d %H:%M")


def _check_id(what: str, value: str) -> None:
    if not KEY_ID.fullmatch(value):
        raise ClientError(f"{what} {value[:60]!r} may use only letters, digits, '_', '.', '-' (1–64)")


def _time(option: str, text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise ClientError(f"{option} {text[:40]!r} is not an ISO 8601 time") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)
