"""The approver key registry, the pure part: what a registered key allows.

Approvers sign decisions with Ed25519 private keys that only they hold; workers hold only public keys, in a
registry stored in the ledger's database (``ledger.schema.approver_keys``: an append-only log of ``add`` and
``revoke`` entries, written only by ``ledgerflow keys``). :func:`registry` folds that log; :func:`refusal`
says whether one key may sign one decision, and why not. Verifying the signature itself is
``runtime.signing`` (a C library, kept out of the workflow's sandbox, which imports this module through
``rules.people``).

A key's scopes say which tasks it may decide for and which budgets it may raise: ``*`` (everything),
``project:P``, ``episode:P/E`` or ``task:T``. A scope covers itself and everything below it (a project its
episodes and their tasks).

An entry may be **endorsed** by a root key (an ``endorse`` row: the root's public key and its signature over
:func:`endorsement_message`, what the entry lets its key do). A deployment that configures root keys
(``LEDGERFLOW_KEY_ROOTS``) trusts only endorsed entries, so the database's operator credential alone cannot
make an approver (``rules.people.unendorsed``); the roots' private halves stay offline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Final

from rules.scopes import SCOPE_TEXT

KEY_ID: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SCOPE: Final = re.compile(rf"\*|{SCOPE_TEXT.pattern}")  # a budget scope, or everything
ANY: Final = "*"
ENDORSEMENT_V1: Final = "ledgerflow key endorsement v1"


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One registered public key and what it may sign."""

    key_id: str
    approver: str
    public_key: str  # raw Ed25519 public key, 64 lowercase hex digits
    kinds: tuple[str, ...] = ()  # request kinds it may decide; empty: every kind
    scopes: tuple[str, ...] = (ANY,)
    not_before: datetime | None = None
    expires_at: datetime | None = None
    added_at: datetime | None = None
    revoked_at: datetime | None = None
    revoked_reason: str = ""
    # (root public key, its signature over endorsement_message(self)), as recorded; checked by the reader.
    endorsements: tuple[tuple[str, str], ...] = ()

    def entry(self) -> dict[str, Any]:
        """What the registry entry lets its key do: what a root key endorses (``endorsement_message``)."""
        return {
            "key_id": self.key_id,
            "approver": self.approver,
            "public_key": self.public_key,
            "kinds": list(self.kinds),
            "scopes": list(self.scopes),
            "not_before": _utc(self.not_before),
            "expires_at": _utc(self.expires_at),
        }

    def as_json(self) -> dict[str, Any]:
        def t(v: datetime | None) -> str | None:
            return None if v is None else v.isoformat()

        return {
            "key_id": self.key_id,
            "approver": self.approver,
            "public_key": self.public_key,
            "kinds": list(self.kinds),
            "scopes": list(self.scopes),
            "not_before": t(self.not_before),
            "expires_at": t(self.expires_at),
            "added_at": t(self.added_at),
            "revoked_at": t(self.revoked_at),
            "revoked_reason": self.revoked_reason,
            "endorsed_by": [root for root, _ in self.endorsements],
        }


def _utc(v: datetime | None) -> str | None:
    return None if v is None else v.astimezone(UTC).isoformat()


def endorsement_message(entry: Mapping[str, Any]) -> str:
    """What a root key signs to endorse a registry entry (``KeyRecord.entry()``): a fixed first line, then
    the entry as canonical JSON (sorted keys, no spaces)."""
    return ENDORSEMENT_V1 + "\n" + json.dumps(dict(entry), sort_keys=True, separators=(",", ":"))


def registry(log: Iterable[Mapping[str, Any]]) -> dict[str, KeyRecord]:
    """Fold the registry's log (rows of ``approver_keys`` in ``seq`` order) into key id -> record."""
    keys: dict[str, KeyRecord] = {}
    for row in log:
        kid = row["key_id"]
        if row["action"] == "add":
            keys[kid] = KeyRecord(
                key_id=kid,
                approver=row["approver"],
                public_key=row["public_key"],
                kinds=tuple(row.get("kinds") or ()),
                scopes=tuple(row.get("scopes") or (ANY,)),
                not_before=row.get("not_before"),
                expires_at=row.get("expires_at"),
                added_at=row.get("recorded_at"),
            )
        elif row["action"] == "revoke" and kid in keys and keys[kid].revoked_at is None:
            keys[kid] = replace(
                keys[kid], revoked_at=row.get("recorded_at"), revoked_reason=row.get("reason") or ""
            )
        elif row["action"] == "endorse" and kid in keys and row.get("endorsed_by") and row.get("endorsement"):
            endorsement = (str(row["endorsed_by"]), str(row["endorsement"]))
            keys[kid] = replace(keys[kid], endorsements=(*keys[kid].endorsements, endorsement))
    return keys


def covers_any(key_scopes: Sequence[str], scope: str, chain: Sequence[str]) -> bool:
    """Whether any of a key's scopes covers ``scope``, one of the task's budget scopes ``chain`` (outermost
    first): a key scope covers its own place in the chain and every scope after it."""
    if ANY in key_scopes:
        return True
    if scope not in chain:
        return False
    below = chain[: chain.index(scope) + 1]
    return any(s in below for s in key_scopes)


def refusal(
    key: KeyRecord,
    *,
    approver: str,
    kind: str,
    chain: Sequence[str],
    scope: str,
    at: datetime,
) -> str | None:
    """Why ``key`` may not sign a decision by ``approver`` on a request of ``kind`` that acts on budget scope
    ``scope`` (the task's own scope unless the decision raises another), received at ``at``; None if it may.
    ``chain`` is the task's budget scopes, outermost first."""
    kid = key.key_id
    if key.approver != approver:
        return f"key {kid} belongs to {key.approver}, not {approver}"
    if key.revoked_at is not None and key.revoked_at <= at:
        why = f": {key.revoked_reason}" if key.revoked_reason else ""
        return f"key {kid} was revoked at {key.revoked_at.isoformat()}{why}"
    if key.not_before is not None and at < key.not_before:
        return f"key {kid} is not valid before {key.not_before.isoformat()}"
    if key.expires_at is not None and at >= key.expires_at:
        return f"key {kid} expired at {key.expires_at.isoformat()}"
    if key.kinds and kind not in key.kinds:
        return f"key {kid} may not decide {kind} requests (allowed: {', '.join(key.kinds)})"
    if not covers_any(key.scopes, scope, chain):
        return f"key {kid} does not cover {scope} (scopes: {', '.join(key.scopes)})"
    return None
