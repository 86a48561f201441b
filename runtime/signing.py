"""Ed25519 for approvers: key files, signing and verification (``cryptography``).

An approver's **key file** is theirs alone (the CLI reads it to sign; the reviewer page imports it into the
browser once, as a non-extractable WebCrypto key). It is JSON::

    {"ledgerflow_key": 1, "key_id": "director-2026", "approver": "director",
     "private_key": "<base64 PKCS#8 DER>", "public_key": "<64 hex: the raw public key>"}

Workers never see it: they verify against the public key in the registry (``rules.approvers``).

The **demo keys** (approvers ``director``, ``producer``, ``editor``) are derived from public seeds, so anyone
can sign with them: they are registered only in dev mode (``LEDGERFLOW_ENV=dev``: the embedded stack and the
tests), and a worker outside dev mode refuses a decision signed with one and refuses to start while one is
registered (``runtime.settings``).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_der_private_key,
)

from rules.approvers import KEY_ID
from runtime.files import write_private

FORMAT: Final = 1
DEMO_APPROVERS: Final = ("director", "producer", "editor")


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ApproverKey:
    """An approver's private key, with its id."""

    key_id: str
    approver: str
    private: Ed25519PrivateKey

    @property
    def public_key(self) -> str:
        return public_hex(self.private.public_key())

    def sign(self, message: str) -> str:
        """The Ed25519 signature of ``message`` (UTF-8), as 128 lowercase hex digits."""
        return self.private.sign(message.encode()).hex()

    def as_file(self) -> dict[str, Any]:
        der = self.private.private_bytes(Encoding.DER, PrivateFormat.PKCS8, NoEncryption())
        return {
            "ledgerflow_key": FORMAT,
            "key_id": self.key_id,
            "approver": self.approver,
            "private_key": base64.b64encode(der).decode(),
            "public_key": self.public_key,
        }

    def write(self, path: Path) -> None:
        """Write the key file, readable by its owner only, atomically (never half written)."""
        write_private(path, json.dumps(self.as_file(), indent=2) + "\n")


def public_hex(key: Ed25519PublicKey) -> str:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def generate(approver: str, key_id: str) -> ApproverKey:
    return ApproverKey(key_id=key_id, approver=approver, private=Ed25519PrivateKey.generate())


def demo_key(approver: str) -> ApproverKey:
    """The dev-mode key of a demo approver: derived from a public seed, so never secret."""
    seed = hashlib.sha256(f"ledgerflow demo approver {approver}".encode()).digest()
    return ApproverKey(
        key_id=f"demo-{approver}", approver=approver, private=Ed25519PrivateKey.from_private_bytes(seed)
    )


def demo_public_keys() -> frozenset[str]:
    return frozenset(demo_key(a).public_key for a in DEMO_APPROVERS)


def load_key_file(path: Path) -> ApproverKey:
    """An approver's key file; KeyFileError naming the file and the problem."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise KeyFileError(f"cannot read key file {path}: {e.strerror or e}") from None
    except ValueError:
        raise KeyFileError(f"key file {path} is not JSON") from None
    if not isinstance(data, dict) or data.get("ledgerflow_key") != FORMAT:
        raise KeyFileError(f"{path} is not a ledgerflow key file (ledgerflow_key: {FORMAT} missing)")
    kid, approver = data.get("key_id"), data.get("approver")
    if not isinstance(kid, str) or not KEY_ID.fullmatch(kid):
        raise KeyFileError(f"key file {path}: key_id is missing or malformed")
    if not isinstance(approver, str) or not KEY_ID.fullmatch(approver):
        raise KeyFileError(f"key file {path}: approver is missing or malformed")
    try:
        private = load_der_private_key(base64.b64decode(str(data.get("private_key")), validate=True), None)
    except (ValueError, TypeError):
        raise KeyFileError(f"key file {path}: private_key is not a base64 PKCS#8 key") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError(f"key file {path}: private_key is not an Ed25519 key")
    return ApproverKey(key_id=kid, approver=approver, private=private)


def verify(public_key: str, message: str, signature: str) -> bool:
    """Whether ``signature`` (hex) is ``public_key``'s (hex, raw) Ed25519 signature of ``message``."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key))
        key.verify(bytes.fromhex(signature), message.encode())
    except (InvalidSignature, ValueError):
        return False
    return True


def parse_public_key(text: str) -> str:
    """A public key given by a person (64 hex digits, or a key file's ``public_key``) -> 64 lowercase hex;
    ValueError says why not."""
    value = text.strip().lower()
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(value))
    except ValueError:
        raise ValueError(f"{text[:80]!r} is not an Ed25519 public key (64 hex digits)") from None
    return value
