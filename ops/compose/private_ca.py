"""TLS inside docker-compose.yml: a private CA, the S3 store's certificate, and the bundle clients trust.

The S3 artifact store refuses plain http to any host but localhost (artifacts/s3.py), so the compose stack's
S3 server speaks TLS with a certificate from a CA made here, once. Run by the one-shot ``tls`` job:

    python private_ca.py --ca-dir CA --server-dir SERVER --trust-dir TRUST --host seaweedfs --host localhost

* ``CA/ca.key``, ``CA/ca.crt``: the CA; its key is mounted into this job only.
* ``SERVER/tls.crt``, ``SERVER/tls.key`` (and ``ca.crt``): the server's, for the S3 server only.
* ``TRUST/ca.crt`` and ``TRUST/bundle.pem``: the public CAs (certifi's) plus ours, for ``SSL_CERT_FILE``:
  obstore (the S3 client) and httpx both read it, so public vendors stay trusted too.

Idempotent: an existing CA is kept; the server certificate is reissued only when it is missing, expires
within 30 days, or does not name every ``--host``. To use certificates of your own, put them in place of the
files above (the job then keeps them while they are valid).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from pathlib import Path

import certifi
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 397
RENEW_BEFORE = dt.timedelta(days=30)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)  # never a half-written key or certificate for a server starting meanwhile


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def ensure_ca(ca_dir: Path, now: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key_path, cert_path = ca_dir / "ca.key", ca_dir / "ca.crt"
    if key_path.exists() and cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise SystemExit(f"{key_path} is not an EC key (this script signs with EC keys only)")
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("ledgerflow private CA"))
        .issuer_name(_name("ledgerflow private CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _pem(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _alt_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def server_cert_current(path: Path, ca: x509.Certificate, hosts: list[str], now: dt.datetime) -> bool:
    """Whether ``path`` holds a certificate by ``ca`` that names every host and is valid past the renewal
    window."""
    if not path.exists():
        return False
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):  # another CA's certificate
        return False
    names = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    return cert.not_valid_after_utc - now > RENEW_BEFORE and all(_alt_name(h) in names for h in hosts)


def ensure_server_cert(
    server_dir: Path,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    hosts: list[str],
    now: dt.datetime,
) -> bool:
    """Issue the server's certificate unless a current one is in place; whether one was issued."""
    cert_path = server_dir / "tls.crt"
    if server_cert_current(cert_path, ca, hosts, now) and (server_dir / "tls.key").exists():
        return False
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName([_alt_name(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    # The key first: a server that reloads on the certificate's change then finds the matching key.
    _write(server_dir / "tls.key", _pem(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ca-dir", type=Path, required=True)
    parser.add_argument("--server-dir", type=Path, required=True)
    parser.add_argument("--trust-dir", type=Path, required=True)
    parser.add_argument("--host", action="append", required=True, help="a name the server answers to")
    args = parser.parse_args(argv)
    now = dt.datetime.now(dt.UTC)
    ca, ca_key = ensure_ca(args.ca_dir, now)
    issued = ensure_server_cert(args.server_dir, ca, ca_key, args.host, now)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    _write(args.server_dir / "ca.crt", ca_pem, 0o644)
    _write(args.trust_dir / "ca.crt", ca_pem, 0o644)
    _write(args.trust_dir / "bundle.pem", Path(certifi.where()).read_bytes() + ca_pem, 0o644)
    hosts = ", ".join(args.host)
    print(f"{'issued' if issued else 'kept'} the certificate for {hosts}; CA {ca.subject.rfc4514_string()}")


if __name__ == "__main__":
    main()
