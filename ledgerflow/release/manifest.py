"""The release manifest: its canonical form, its signature, and the check anyone can run (docs/releases.md).

A manifest is one JSON document::

    {"ledgerflow_release": 1,
     "claim": {…, "output": {"sha256", "size", "format", "name"},
               "assertions": [{"label": "c2pa.hash.data", "sha256": "<hash of that assertion>"}, …],
               "signer": {"key_id", "holder", "public_key", "alg": "Ed25519", …}},
     "assertions": {"c2pa.hash.data": {…}, "c2pa.actions": {…}, "c2pa.ingredient": {…},
                    "c2pa.ingredient__1": {…}, "ledgerflow.cost": {…}, …},
     "signature": "<128 hex: Ed25519 over SIGNED_PREFIX + canonical(claim)>"}

As in C2PA, the claim lists every assertion by label and hash (C2PA's hashed URIs) and only the claim is
signed: the signature binds the claim, the claim binds each assertion, and the ``c2pa.hash.data`` assertion
binds the output file's bytes. ``canonical`` is JSON with sorted keys, no spaces, UTF-8: the same document
always hashes the same, whoever re-serialises it.

Pure apart from reading the two files in :func:`verify_files`; imports only ``cryptography`` (through
``runtime.signing``), so ``ledgerflow verify`` runs where nothing of the ledger does.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Final

from runtime.signing import ApproverKey, parse_public_key
from runtime.signing import verify as verify_signature

FORMAT: Final = 1
SIGNED_PREFIX: Final = "ledgerflow release v1\n"
HASH_DATA: Final = "c2pa.hash.data"
ACTIONS: Final = "c2pa.actions"
INGREDIENT: Final = "c2pa.ingredient"
DECISIONS: Final = "ledgerflow.decisions"
COST: Final = "ledgerflow.cost"


class ManifestError(ValueError):
    """A manifest that does not verify; the message is the one line naming what failed."""


def canonical(value: Any) -> bytes:
    """``value`` as canonical JSON bytes: sorted keys, no whitespace, UTF-8 (non-ASCII kept as is)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(value: Any) -> str:
    """The sha256 (hex) of ``value``'s canonical JSON."""
    return hashlib.sha256(canonical(value)).hexdigest()


def hash_b64(sha256_hex: str) -> str:
    """A hex sha256 as C2PA writes a hash in JSON: the digest's bytes, base64."""
    try:
        return base64.b64encode(bytes.fromhex(sha256_hex)).decode()
    except ValueError:
        return ""


def text(manifest: dict[str, Any]) -> str:
    """The one way a manifest is written: sorted keys, two-space indents, UTF-8, a final newline. ``verify``
    holds a manifest file to it, so no byte of the file can change unnoticed, not even outside a value."""
    return json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def sha256_file(path: Path) -> str:
    """The sha256 (hex) of a file's bytes, streamed."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def labelled(assertions: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Assertions by label, a repeated label numbered as C2PA numbers them (``c2pa.ingredient__1`` …)."""
    out: dict[str, dict[str, Any]] = {}
    seen: dict[str, int] = {}
    for label, data in assertions:
        n = seen.get(label, 0)
        seen[label] = n + 1
        out[label if n == 0 else f"{label}__{n}"] = data
    return out


def sign(claim: dict[str, Any], assertions: dict[str, dict[str, Any]], key: ApproverKey) -> dict[str, Any]:
    """The signed manifest: ``claim`` gains the hash of every assertion and the signer, then is signed."""
    bound = {
        **claim,
        "assertions": [{"label": label, "sha256": digest(data)} for label, data in assertions.items()],
        "signer": {**claim.get("signer", {}), "alg": "Ed25519", "public_key": key.public_key},
    }
    signature = key.sign(SIGNED_PREFIX + canonical(bound).decode())
    return {"ledgerflow_release": FORMAT, "claim": bound, "assertions": assertions, "signature": signature}


@dataclass(frozen=True)
class Verified:
    """What a verified manifest says, for the one line ``ledgerflow verify`` prints."""

    task: str
    output_sha256: str
    key_id: str
    public_key: str
    pinned: bool  # the public key was given by the verifier, not only read from the manifest
    file_checked: bool
    decisions: int
    c2pa_copy: bool = False  # the file is the copy with the C2PA manifest embedded (claim.embedded_c2pa)

    def line(self) -> str:
        who = f"key {self.key_id} ({self.public_key[:16]}…)"
        if not self.pinned:
            who += ", the key the manifest names: pass --public-key to pin the publisher's"
        what = "the file and the manifest" if self.file_checked else "the manifest"
        if self.c2pa_copy:
            what = "the file (the copy with its C2PA manifest embedded) and the manifest"
        return (
            f"verified: {what} of task {self.task}, output sha256 {self.output_sha256}, signed by {who};"
            f" {self.decisions} signed decisions re-checked"
        )


def _need(mapping: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    value = mapping.get(name)
    if not isinstance(value, kind):
        raise ManifestError(f"manifest: {where}{name} is missing or not a {kind.__name__}")
    return value


def verify_manifest(
    manifest: Any, *, public_key: str | None = None, file_sha256: str | None = None
) -> Verified:
    """Check a parsed manifest: its signature (by ``public_key`` if given, else by the key the claim names),
    every assertion against the claim's hash of it, the output hash the claim and ``c2pa.hash.data`` state,
    every signed decision it carries against its approver's public key, the costs against their total, and,
    with ``file_sha256``, the file against the output. ManifestError naming the first thing that fails."""
    if not isinstance(manifest, dict) or manifest.get("ledgerflow_release") != FORMAT:
        raise ManifestError(f"manifest: not a ledgerflow release manifest (ledgerflow_release: {FORMAT})")
    claim = _need(manifest, "claim", dict, "")
    assertions = _need(manifest, "assertions", dict, "")
    signature = _need(manifest, "signature", str, "")
    signer = _need(claim, "signer", dict, "claim.")
    named = _need(signer, "public_key", str, "claim.signer.")
    key_id = str(signer.get("key_id") or "?")
    if public_key is not None:
        pinned = parse_public_key(public_key)
        if pinned != named.lower():
            raise ManifestError(
                f"signature: the manifest is signed by key {key_id} ({named[:16]}…), not the given public key"
                f" ({pinned[:16]}…)"
            )
    if not verify_signature(named, SIGNED_PREFIX + canonical(claim).decode(), signature):
        raise ManifestError(
            f"signature: key {key_id}'s signature does not match the claim (the claim or the signature was"
            " changed)"
        )
    listed = _need(claim, "assertions", list, "claim.")
    hashes: dict[str, str] = {}
    for entry in listed:
        if not isinstance(entry, dict) or not isinstance(entry.get("label"), str):
            raise ManifestError("manifest: claim.assertions holds an entry without a label")
        hashes[entry["label"]] = str(entry.get("sha256"))
    for label, data in assertions.items():
        if label not in hashes:
            raise ManifestError(f"assertion {label}: not listed in the signed claim (added after signing)")
        if digest(data) != hashes[label]:
            raise ManifestError(
                f"assertion {label}: its content hashes to {digest(data)[:16]}…, the signed claim says"
                f" {hashes[label][:16]}… (changed after signing)"
            )
    for label in hashes:
        if label not in assertions:
            raise ManifestError(f"assertion {label}: listed in the signed claim but missing")
    output = _need(claim, "output", dict, "claim.")
    sha = _need(output, "sha256", str, "claim.output.")
    bound = _need(assertions, HASH_DATA, dict, "assertions.")
    if bound.get("alg") != "sha256" or bound.get("sha256") != sha or bound.get("hash") != hash_b64(sha):
        raise ManifestError(f"assertion {HASH_DATA}: its hash is not the claim's output sha256 {sha[:16]}…")
    decisions = _check_decisions(assertions.get(DECISIONS))
    _check_costs(assertions.get(COST))
    embedded = claim.get("embedded_c2pa") if isinstance(claim.get("embedded_c2pa"), dict) else {}
    c2pa_copy = file_sha256 is not None and file_sha256 == embedded.get("sha256")
    if file_sha256 is not None and file_sha256 != sha and not c2pa_copy:
        raise ManifestError(
            f"file: its bytes hash to {file_sha256}, the manifest's output is {sha} (not the released file,"
            " or changed)"
        )
    return Verified(
        task=str(claim.get("task") or "?"),
        output_sha256=sha,
        key_id=key_id,
        public_key=named,
        pinned=public_key is not None,
        file_checked=file_sha256 is not None,
        decisions=decisions,
        c2pa_copy=c2pa_copy,
    )


def _check_decisions(data: Any) -> int:
    """Each signed decision or change in the manifest verified against its approver's public key; how many."""
    if data is None:
        return 0
    if not isinstance(data, dict):
        raise ManifestError(f"assertion {DECISIONS}: not an object")
    checked = 0
    for group in ("decisions", "changes"):
        for item in data.get(group) or ():
            if not isinstance(item, dict) or not item.get("signature"):
                continue  # a decision recorded before signatures were kept, or a policy's: nothing to check
            public = item.get("public_key")
            what = f"{group[:-1]} {item.get('request_id') or item.get('change_id') or '?'}"
            if not isinstance(public, str) or not verify_signature(
                public, str(item.get("signed") or ""), str(item["signature"])
            ):
                raise ManifestError(
                    f"assertion {DECISIONS}: {what} by {item.get('approver')} (key {item.get('key_id')}):"
                    " its signature does not verify with the public key given"
                )
            checked += 1
    return checked


def _check_costs(data: Any) -> None:
    """The stages' costs add up to the stated total."""
    if data is None:
        return
    try:
        stages = data["stages"]
        total = sum((Decimal(str(s["total"])) for s in stages.values()), Decimal(0))
        stated = Decimal(str(data["total"]))
    except (KeyError, TypeError, AttributeError, InvalidOperation):
        raise ManifestError(f"assertion {COST}: stages or total missing or not amounts") from None
    if total != stated:
        raise ManifestError(f"assertion {COST}: the stages add up to {total}, the total says {stated}")


def read_public_key(*, public_key: str | None, key_file: Path | None) -> str | None:
    """The verifier's public key: ``--public-key`` (64 hex), or the ``public_key`` of a key file (a
    ledgerflow key file, or any JSON object with ``public_key``); None if neither. ManifestError if bad."""
    if public_key is not None and key_file is not None:
        raise ManifestError("give --public-key or --key-file, not both")
    if key_file is not None:
        try:
            data = json.loads(key_file.read_text())
        except OSError as e:
            raise ManifestError(f"key file {key_file}: cannot read it ({e.strerror or e})") from None
        except ValueError:
            raise ManifestError(f"key file {key_file}: not JSON") from None
        public_key = data.get("public_key") if isinstance(data, dict) else None
        if not isinstance(public_key, str):
            raise ManifestError(f"key file {key_file}: it holds no public_key")
    if public_key is None:
        return None
    try:
        return parse_public_key(public_key)
    except ValueError as e:
        raise ManifestError(f"public key: {e}") from None


def verify_files(manifest_path: Path, file: Path | None, *, public_key: str | None) -> Verified:
    """``ledgerflow verify``: read the manifest (and hash the file), then :func:`verify_manifest`."""
    try:
        text_bytes = manifest_path.read_bytes()
    except OSError as e:
        raise ManifestError(f"manifest {manifest_path}: cannot read it ({e.strerror or e})") from None
    try:
        manifest = json.loads(text_bytes)
    except ValueError as e:
        raise ManifestError(f"manifest {manifest_path}: not JSON ({e})") from None
    file_sha: str | None = None
    if file is not None:
        try:
            file_sha = sha256_file(file)
        except OSError as e:
            raise ManifestError(f"file {file}: cannot read it ({e.strerror or e})") from None
    verified = verify_manifest(manifest, public_key=public_key, file_sha256=file_sha)
    if text(manifest).encode() != text_bytes:
        raise ManifestError(
            f"manifest {manifest_path}: its bytes are not the form it was written in (a byte outside any"
            " value was changed)"
        )
    return verified
