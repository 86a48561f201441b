"""Vendor callback signatures: pure functions, no I/O, no clock (``now`` is passed in).

Two schemes, named by a route's ``callback.scheme`` (``vendors.routes.CallbackSpec``):

* ``standard`` — Standard Webhooks (https://www.standardwebhooks.com; Replicate's). Headers ``webhook-id``,
  ``webhook-timestamp`` (Unix seconds) and ``webhook-signature`` (space-separated ``v1,<base64>`` entries:
  several while a secret rotates). Each ``v1`` is the base64 HMAC-SHA256 of ``{id}.{timestamp}.{body}`` under
  the key that is the secret, base64-decoded after an optional ``whsec_`` prefix.
* ``hmac-sha256`` — the hex HMAC-SHA256 of the raw body under the secret's UTF-8 bytes, in one header,
  optionally prefixed ``sha256=`` (GitHub's and many others').

Every comparison is constant-time (``hmac.compare_digest``). A ``Verdict``'s reason is for the ledger's record
and the receiver's log: it never holds the secret or the expected signature.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from runtime.standard_webhooks import sign, signature, standard_key

MAX_ID: Final = 200
_HEX_DIGEST: Final = re.compile(r"[0-9a-fA-F]{64}")
_TIMESTAMP: Final = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True)
class Verdict:
    """What a signature check found: ``kind`` as ``vendor_callbacks.verdict`` records it, and why."""

    kind: Literal["accepted", "forged", "stale", "malformed"]
    reason: str

    @property
    def accepted(self) -> bool:
        return self.kind == "accepted"


def _standard_signature(key: bytes, msg_id: str, timestamp: str, body: bytes) -> bytes:
    return signature(key, msg_id, timestamp, body)


def verify_standard(
    secret: str, headers: Mapping[str, str], body: bytes, now: float, tolerance: float
) -> Verdict:
    """Check a Standard Webhooks delivery: ``malformed`` (a header missing or unreadable), ``forged`` (no
    ``v1`` entry matches), ``stale`` (signed, but its timestamp is more than ``tolerance`` seconds from
    ``now``, either way) or ``accepted``. ValueError if ``secret`` is not base64 (a configuration error)."""
    key = standard_key(secret)
    lower = {k.lower(): v for k, v in headers.items()}
    msg_id = lower.get("webhook-id", "").strip()
    timestamp = lower.get("webhook-timestamp", "").strip()
    signatures = lower.get("webhook-signature", "").strip()
    missing = [
        name
        for name, value in (
            ("webhook-id", msg_id),
            ("webhook-timestamp", timestamp),
            ("webhook-signature", signatures),
        )
        if not value
    ]
    if missing:
        return Verdict("malformed", f"missing header {', '.join(missing)}")
    if len(msg_id) > MAX_ID or not msg_id.isprintable():
        return Verdict("malformed", "webhook-id is not a printable id of at most 200 characters")
    if not _TIMESTAMP.fullmatch(timestamp):
        return Verdict("malformed", "webhook-timestamp is not a number of seconds")
    entries = [e.partition(",") for e in signatures.split(" ") if e]
    candidates = [sig for version, _, sig in entries if version == "v1"]
    if not candidates:
        return Verdict("malformed", "webhook-signature holds no v1 entry")
    expected = _standard_signature(key, msg_id, timestamp, body)
    matched = False
    for candidate in candidates:  # every entry, no early exit: the time taken says nothing about which
        matched |= hmac.compare_digest(expected, candidate.encode("utf-8", "surrogateescape"))
    # The signature before the clock: the timestamp is part of what is signed, so until the signature holds
    # it is the sender's word. Judged first, an unsigned request is always "forged" whatever its timestamp,
    # and its sender learns nothing of our clock or tolerance; "stale" is said only of a delivery the vendor
    # really signed (an old retry, or a captured one replayed).
    if not matched:
        return Verdict("forged", f"the signature matches none of {len(candidates)} v1 entries")
    skew = now - int(timestamp)
    if abs(skew) > tolerance:
        side = "old" if skew > 0 else "in the future"
        return Verdict("stale", f"webhook-timestamp is {abs(skew):.0f} s {side} (tolerance {tolerance:g} s)")
    return Verdict("accepted", "signature verified (standard)")


def verify_hmac(secret: str, header_value: str | None, body: bytes) -> Verdict:
    """Check a body's hex HMAC-SHA256 (``header_value``, optionally ``sha256=``-prefixed): ``malformed``
    (none, or not 64 hex digits), ``forged`` (another digest) or ``accepted``."""
    if not header_value or not header_value.strip():
        return Verdict("malformed", "missing signature header")
    given = header_value.strip()
    given = given[len("sha256=") :] if given.lower().startswith("sha256=") else given
    if not _HEX_DIGEST.fullmatch(given):
        return Verdict("malformed", "the signature is not 64 hex digits")
    expected = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode(), given.lower().encode()):
        return Verdict("forged", "the signature does not match the body")
    return Verdict("accepted", "signature verified (hmac-sha256)")


def sign_standard(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers a vendor would send with ``body``: for tests and fake vendors (the
    receiver only verifies)."""
    return sign(secret, msg_id, timestamp, body)
