"""The callback signature schemes (``ledgerflow.webhooks.signatures``) against vectors computed here with
hmac and base64 directly, and the Standard Webhooks specification's published example; and the route fields
that turn callbacks on (``vendors.routes.CallbackSpec``)."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from ledgerflow.webhooks.signatures import sign_standard, verify_hmac, verify_standard
from vendors.routes import RouteError, parse_table

# The Standard Webhooks reference libraries' test vector (their README and every library's tests).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def by_hand(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def test_sign_standard_reproduces_the_specifications_published_vector() -> None:
    assert by_hand(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE
    assert sign_standard(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == {
        "webhook-id": SPEC_ID,
        "webhook-timestamp": str(SPEC_TIMESTAMP),
        "webhook-signature": SPEC_SIGNATURE,
    }


def test_verify_standard_accepts_the_vector_with_or_without_the_prefix_and_among_rotated_entries() -> None:
    headers = {
        "Webhook-Id": SPEC_ID,  # header names in any case
        "webhook-timestamp": str(SPEC_TIMESTAMP),
        "webhook-signature": f"v1,bm9wZQ== v1a,ignored {SPEC_SIGNATURE}",  # a rotated-out key's first
    }
    for secret in (SPEC_SECRET, SPEC_SECRET.removeprefix("whsec_")):
        verdict = verify_standard(secret, headers, SPEC_BODY, now=SPEC_TIMESTAMP + 10, tolerance=300)
        assert (verdict.kind, verdict.reason) == ("accepted", "signature verified (standard)")


def test_verify_standard_refuses_a_changed_body_a_missing_header_and_an_old_signed_delivery() -> None:
    headers = sign_standard(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY)
    now = SPEC_TIMESTAMP

    changed = verify_standard(SPEC_SECRET, headers, b'{"test": 1}', now=now, tolerance=300)
    assert (changed.kind, changed.reason) == ("forged", "the signature matches none of 1 v1 entries")
    unsigned = {k: v for k, v in headers.items() if k != "webhook-signature"}
    missing = verify_standard(SPEC_SECRET, unsigned, SPEC_BODY, now=now, tolerance=300)
    assert (missing.kind, missing.reason) == ("malformed", "missing header webhook-signature")
    bad_time = {**headers, "webhook-timestamp": "yesterday"}
    assert verify_standard(SPEC_SECRET, bad_time, SPEC_BODY, now=now, tolerance=300).kind == "malformed"
    old = verify_standard(SPEC_SECRET, headers, SPEC_BODY, now=now + 301, tolerance=300)
    assert (old.kind, old.reason) == ("stale", "webhook-timestamp is 301 s old (tolerance 300 s)")
    ahead = verify_standard(SPEC_SECRET, headers, SPEC_BODY, now=now - 400, tolerance=300)
    assert ahead.kind == "stale" and "in the future" in ahead.reason


def test_an_unsigned_delivery_is_forged_whatever_its_timestamp_says() -> None:
    """The signature is judged before the clock: a forger learns nothing of the receiver's tolerance."""
    headers = {**sign_standard(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY), "webhook-timestamp": "1"}
    verdict = verify_standard(SPEC_SECRET, headers, SPEC_BODY, now=SPEC_TIMESTAMP, tolerance=300)
    assert verdict.kind == "forged"
    assert SPEC_SIGNATURE[3:] not in verdict.reason


def test_verify_standard_raises_for_a_secret_that_is_not_base64() -> None:
    headers = sign_standard(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY)
    with pytest.raises(ValueError, match="not a Standard Webhooks secret") as caught:
        verify_standard("whsec_not base64!", headers, SPEC_BODY, now=SPEC_TIMESTAMP, tolerance=300)
    assert "not base64!" not in str(caught.value)


def test_verify_hmac_accepts_the_hex_digest_with_or_without_its_prefix_and_refuses_another() -> None:
    secret, body = "acme-hook-secret", b'{"id": "t-1", "status": "done"}'
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    assert verify_hmac(secret, digest, body).kind == "accepted"
    assert verify_hmac(secret, f"sha256={digest.upper()}", body).kind == "accepted"
    assert verify_hmac(secret, digest, body + b" ").kind == "forged"
    assert verify_hmac("another-secret", digest, body).kind == "forged"
    assert verify_hmac(secret, None, body).kind == "malformed"
    assert verify_hmac(secret, "sha256=abc", body).kind == "malformed"


# --- route fields -----------------------------------------------------------------------------------------

HOOK = "https://hooks.example.com/callbacks/video.motion?operation_key={operation_key}"


def route(**fields: object) -> dict[str, object]:
    return {
        "routes": {
            "video.motion": {"adapter": "predictions", "base_url": "https://api.example.com", **fields}
        }
    }


def test_a_route_with_a_callback_reads_its_defaults() -> None:
    table = parse_table(
        route(webhook_url=HOOK, callback={"secret_env": "MOTION_HOOK_SECRET", "window": "2m"})
    )
    callback = table.routes["video.motion"].callback
    assert callback is not None
    assert (callback.secret_env, callback.scheme, callback.header) == (
        "MOTION_HOOK_SECRET",
        "standard",
        "X-Signature",
    )
    assert (callback.window, callback.tolerance) == (120.0, 300.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"callback": {"secret_env": "S"}},
            "routes: route 'video.motion': callback needs webhook_url (where the vendor calls, with"
            " {operation_key} in it)",
        ),
        (
            {"webhook_url": "https://hooks.example.com/cb", "callback": {"secret_env": "S"}},
            "routes: route 'video.motion': webhook_url must hold {operation_key} once, and no other"
            " {placeholder}",
        ),
        (
            {"webhook_url": HOOK, "callback": {"secret_env": "S", "scheme": "ed25519"}},
            "routes: route 'video.motion': callback.scheme Input should be 'standard' or 'hmac-sha256'",
        ),
        (
            {"webhook_url": HOOK, "callback": {"secret_env": "S", "window": 0}},
            "routes: route 'video.motion': callback.window must be a positive duration",
        ),
        (
            {"webhook_url": HOOK, "callback": {"secret_env": "not a name"}},
            "routes: route 'video.motion': callback.secret_env String should match pattern"
            " '^[A-Za-z_][A-Za-z0-9_]{0,127}$'",
        ),
        (
            {"webhook_url": HOOK, "callback": {"secret_env": "S", "secret": "x"}},
            "routes: route 'video.motion': callback.secret is not a known field",
        ),
    ],
)
def test_a_callback_route_that_cannot_work_is_refused_in_one_line(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(RouteError) as caught:
        parse_table(route(**fields))
    assert str(caught.value) == message
