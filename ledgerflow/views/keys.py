"""``ledgerflow keys``: the approver key registry, the operator's side (generate, add, revoke, list), and the
root key ceremony (root-generate, entry, endorse, add-endorsement).

Every change is an entry in the append-only ``approver_keys`` table with who made it and why: the registry's
audit trail. Private keys never enter the database: ``generate`` writes one to the approver's own key file.

A deployment that sets ``LEDGERFLOW_KEY_ROOTS`` trusts only entries a root key endorsed (``rules.approvers``).
The ceremony moves files, never keys: ``entry`` (online) writes what a key's registry entry lets it do;
``endorse`` (on the offline machine that holds the root key file, no database, no network) shows the entry to
the custodian and writes the root's signature over it; ``add-endorsement`` (online) checks that signature
against the entry as the registry holds it and records it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, get_args

from rich.table import Table

from ledger.errors import LedgerError
from ledgerflow.client import ClientError, recorder
from rules.approvers import ANY, KEY_ID, SCOPE, KeyRecord, endorsement_message
from rules.changes import key_kind
from rules.events import ChangeKind
from rules.plan import RequestKindName
from runtime.files import write_private
from runtime.settings import Settings
from runtime.signing import ApproverKey, KeyFileError, load_key_file, parse_public_key, verify
from runtime.signing import generate as new_key

# What a key may sign, where it lists kinds: answers to requests of a kind, changes of a kind (rules.changes
# ``key_kind``), releases (``ledgerflow release``). A key listing none may sign every kind but ``release``.
KINDS: tuple[str, ...] = (
    *get_args(RequestKindName),
    *(key_kind(k) for k in ChangeKind),
    "release",
)
ROOT: Final = "root"  # the approver name a root key file carries (a root never signs decisions)
ENTRY_FORMAT: Final = "ledgerflow_key_entry"
ENDORSEMENT_FORMAT: Final = "ledgerflow_key_endorsement"


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
    t = Table("KEY", "APPROVER", "KINDS", "SCOPES", "VALID", "STATE", "ENDORSED BY", box=None)
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
        message = endorsement_message(k.entry())
        roots = ", ".join(
            f"{root[:12]}…" if verify(root, message, sig) else f"{root[:12]}… (bad signature)"
            for root, sig in k.endorsements
        )
        kinds = ", ".join(k.kinds) or "all"
        t.add_row(k.key_id, k.approver, kinds, ", ".join(k.scopes), valid, state, roots or "no")
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


# ── the root key ceremony ────────────────────────────────────────────────────────────────────────────


def root_generate(key_id: str, out: Path) -> ApproverKey:
    """A new root key pair, its private half written to ``out`` (never overwritten): for the offline
    machine. Its public key is what ``LEDGERFLOW_KEY_ROOTS`` lists."""
    return generate(ROOT, key_id, out)


def entry(settings: Settings, key_id: str, out: Path) -> KeyRecord:
    """Write ``key_id``'s registry entry (what it lets the key do) to ``out``, for the root's custodian."""
    rec = recorder(settings)
    try:
        found = rec.key_registry().get(key_id)
    finally:
        rec.dispose()
    if found is None:
        raise ClientError(f"no key {key_id!r} in the registry")
    _write_new(out, {ENTRY_FORMAT: 1, **found.entry()})
    return found


def endorse(entry_file: Path, root_key_file: Path, out: Path) -> tuple[KeyRecord, dict[str, Any]]:
    """Sign the entry in ``entry_file`` with the root key in ``root_key_file`` and write the endorsement to
    ``out``; the entry (for the custodian to read before carrying the file back) and what was written. Reads
    no database and no network: for the offline machine."""
    record = _entry_record(_read_json(entry_file, ENTRY_FORMAT), entry_file)
    try:
        root = load_key_file(root_key_file)
    except KeyFileError as e:
        raise ClientError(str(e)) from None
    if root.approver != ROOT:
        raise ClientError(f"{root_key_file} is {root.approver}'s approver key, not a root key")
    body = record.entry()
    endorsement = {
        ENDORSEMENT_FORMAT: 1,
        "entry": body,
        "root": root.public_key,
        "signature": root.sign(endorsement_message(body)),
    }
    _write_new(out, endorsement)
    return record, endorsement


def add_endorsement(settings: Settings, file: Path, *, actor: str, reason: str) -> str:
    """Record the endorsement in ``file`` after checking it: a valid signature by its root over the entry
    exactly as the registry holds it now, and, when ``LEDGERFLOW_KEY_ROOTS`` is set, a configured root. The
    line to print; ClientError naming what is wrong (nothing is written)."""
    data = _read_json(file, ENDORSEMENT_FORMAT)
    root, signature, body = data.get("root"), data.get("signature"), data.get("entry")
    if not isinstance(body, dict) or not isinstance(root, str) or not isinstance(signature, str):
        raise ClientError(f"{file}: an endorsement needs entry, root and signature")
    endorsed = _entry_record(body, file)
    try:
        root = parse_public_key(root)
    except ValueError as e:
        raise ClientError(f"{file}: root: {e}") from None
    if not verify(root, endorsement_message(endorsed.entry()), signature):
        raise ClientError(f"{file}: the signature is not the root's over this entry (altered or truncated)")
    roots = settings.root_keys()
    if roots and root not in roots:
        raise ClientError(f"{file}: root {root[:16]}… is not one of LEDGERFLOW_KEY_ROOTS")
    rec = recorder(settings)  # one connection: the registry's entry is read, compared, then endorsed
    try:
        found = rec.key_registry().get(endorsed.key_id)
        if found is None:
            raise ClientError(f"no key {endorsed.key_id!r} in the registry")
        registered = found.entry()
        differs = [name for name, value in endorsed.entry().items() if registered[name] != value]
        if differs:
            raise ClientError(
                f"the endorsement is for another entry than key {found.key_id}'s"
                f" ({', '.join(differs)} differ): endorse the entry `ledgerflow keys entry` writes"
            )
        if not reason.strip():
            raise ClientError("--reason is required: it is the registry's audit trail")
        rec.endorse_key(found.key_id, root, signature, actor=actor, reason=reason)
    except LedgerError as e:
        raise ClientError(str(e)) from None
    finally:
        rec.dispose()
    note = "" if roots else " (LEDGERFLOW_KEY_ROOTS is not set here: nothing checks endorsements yet)"
    return f"key {found.key_id} of {found.approver} endorsed by root {root[:16]}…{note}"


def describe(record: KeyRecord) -> str:
    """What an entry lets its key do, in one line, for the custodian to check before signing."""
    valid = f"{_day(record.not_before) or 'now'} → {_day(record.expires_at) or 'no expiry'}"
    return (
        f"key {record.key_id} of {record.approver} ({record.public_key}): kinds "
        f"{', '.join(record.kinds) or 'all'}; scopes {', '.join(record.scopes)}; valid {valid}"
    )


def _read_json(path: Path, kind: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ClientError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError:
        raise ClientError(f"{path} is not JSON") from None
    if not isinstance(data, dict) or data.get(kind) != 1:
        raise ClientError(f"{path} is not a {kind.removeprefix('ledgerflow_').replace('_', ' ')} file")
    return data


def _entry_record(body: dict[str, Any], path: Path) -> KeyRecord:
    """The registry entry in a file, checked as ``keys add`` checks its options; ClientError naming it."""
    strings = ("key_id", "approver", "public_key")
    if not all(isinstance(body.get(n), str) for n in strings) or not all(
        isinstance(body.get(n), list) and all(isinstance(v, str) for v in body[n])
        for n in ("kinds", "scopes")
    ):
        raise ClientError(f"{path}: an entry needs key_id, approver, public_key, kinds and scopes")
    for name in ("not_before", "expires_at"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ClientError(f"{path}: {name} must be an ISO 8601 time or null")
    try:
        return record_from(
            key_file=None,
            key_id=body["key_id"],
            approver=body["approver"],
            public_key=body["public_key"],
            kinds=body["kinds"],
            scopes=body["scopes"],
            not_before=body.get("not_before"),
            expires=body.get("expires_at"),
        )
    except ClientError as e:
        raise ClientError(f"{path}: {e}") from None


def _write_new(path: Path, data: dict[str, Any]) -> None:
    if path.exists():
        raise ClientError(f"{path} exists: it is never overwritten")
    write_private(path, json.dumps(data, indent=2) + "\n")
