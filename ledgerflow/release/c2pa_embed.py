"""A C2PA manifest embedded in the released MP4 (optional: ``c2pa-python``), for platforms and C2PA tools.

The embedded manifest is signed with the release key itself (Ed25519) under an X.509 certificate for that key:
``--c2pa-cert CHAIN.pem`` (the leaf must certify the release key's public key; a CA a verifier trusts issued
it), or, in dev mode only, ``--c2pa-dev-cert``: a throwaway CA made on the spot, written beside the release
as ``TASK.c2pa-ca.pem`` for a verifier to trust. It holds ``c2pa.actions`` and an ``org.ledgerflow.release``
assertion binding it to the JSON manifest (the task, the released bytes' sha256, every ingredient's sha256);
C2PA's own hard binding (``c2pa.hash.bmff``) covers the file. Embedding changes the file's bytes, so the
embedded copy is a second file (``TASK.c2pa.mp4``) whose sha256 the signed JSON claim records.
"""

from __future__ import annotations

import datetime
import importlib
import json
from pathlib import Path
from typing import Any, Final

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ledgerflow.errors import ClientError
from runtime.signing import ApproverKey, public_hex

LEDGERFLOW_ASSERTION: Final = "org.ledgerflow.release"


def _c2pa() -> Any:
    try:
        return importlib.import_module("c2pa")
    except ImportError:
        raise ClientError(
            "embedding a C2PA manifest needs c2pa-python (pip install 'c2pa-python>=0.38.1')"
        ) from None


def _name(common: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ledgerflow"),
        ]
    )


def _usage(*, sign: bool, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def dev_chain(key: ApproverKey, *, days: int = 30) -> tuple[bytes, bytes]:
    """A throwaway CA and a certificate it issues for the release key: (leaf + CA chain PEM, CA PEM). For
    dev and tests only: the CA's private key is discarded, and nobody trusts the CA but who is told to."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = Ed25519PrivateKey.generate()
    ca_name = _name("ledgerflow test release CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_usage(sign=False, ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, None)
    )
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name(f"ledgerflow release key {key.key_id}"))
        .issuer_name(ca_name)
        .public_key(key.private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(sign=True, ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.private.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, None)
    )
    pem = serialization.Encoding.PEM
    return leaf.public_bytes(pem) + ca.public_bytes(pem), ca.public_bytes(pem)


def check_chain(chain_pem: bytes, key: ApproverKey) -> None:
    """ClientError unless the chain's first certificate certifies the release key."""
    try:
        leaf = x509.load_pem_x509_certificates(chain_pem)[0]
    except (ValueError, IndexError):
        raise ClientError("--c2pa-cert: not a PEM certificate chain") from None
    public = leaf.public_key()
    if not isinstance(public, Ed25519PublicKey) or public_hex(public) != key.public_key:
        raise ClientError(f"--c2pa-cert: its first certificate is not for release key {key.key_id}")


def embed(
    source: Path, dest: Path, key: ApproverKey, chain_pem: bytes, *, title: str, binding: dict[str, Any]
) -> None:
    """Write ``source`` to ``dest`` with a C2PA manifest signed by ``key`` under ``chain_pem``."""
    c2pa = _c2pa()
    private = key.private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    signer = c2pa.Signer.from_info(c2pa.C2paSignerInfo(b"ed25519", chain_pem, private, None))
    definition = {
        "claim_generator_info": [{"name": "ledgerflow", "version": str(binding.get("generator", ""))}],
        "title": title,
        "format": "video/mp4",
        "assertions": [
            {
                "label": "c2pa.actions",
                "data": {
                    "actions": [
                        {
                            "action": "c2pa.created",
                            "digitalSourceType": (
                                "http://cv.iptc.org/newscodes/digitalsourcetype/compositeWithTrainedAlgorithmicMedia"
                            ),
                            "softwareAgent": {"name": "ledgerflow"},
                        }
                    ]
                },
            },
            {"label": LEDGERFLOW_ASSERTION, "data": binding},
        ],
    }
    builder = c2pa.Builder.from_json(json.dumps(definition))
    try:
        with source.open("rb") as src, dest.open("w+b") as out:
            builder.sign(signer, "video/mp4", src, out)
    except c2pa.C2paError as e:
        dest.unlink(missing_ok=True)
        raise ClientError(f"C2PA signing failed: {e}") from None


def read(path: Path, anchors_pem: bytes | None = None) -> dict[str, Any]:
    """The C2PA store embedded in ``path`` as c2pa's JSON (its ``validation_state`` is ``Trusted`` when a
    certificate in ``anchors_pem`` issued the signer's)."""
    c2pa = _c2pa()
    settings = {"trust": {"trust_anchors": anchors_pem.decode()}} if anchors_pem else {}
    context = c2pa.Context(c2pa.Settings.from_dict(settings))
    with path.open("rb") as f:
        reader = c2pa.Reader("video/mp4", f, context=context)
        return dict(json.loads(reader.json()))
