"""Standard Webhooks signing (https://www.standardwebhooks.com): the HMAC both ends share.

``ledgerflow.webhooks`` verifies vendors' callbacks with it; the worker signs the notifications it sends
people (``activities.people.notify``) with it. A secret is ``whsec_`` + base64 of the key; a signature is
``v1,`` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import Final

SECRET_PREFIX: Final = "whsec_"


def standard_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret (``whsec_`` + base64). ValueError (naming no part of the
    secret) if it is not base64."""
    try:
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the secret is not a Standard Webhooks secret (whsec_ + base64)") from None


def signature(key: bytes, msg_id: str, timestamp: str, body: bytes) -> bytes:
    """The base64 HMAC-SHA256 of ``{msg_id}.{timestamp}.{body}`` under ``key``."""
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return base64.b64encode(digest)


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers of ``body`` (webhook-id, webhook-timestamp, webhook-signature)."""
    signed = signature(standard_key(secret), msg_id, str(timestamp), body).decode()
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp), "webhook-signature": f"v1,{signed}"}
