"""A fake of Lumen Render's wire protocol, written with ledgerflow's kit (``ledgerflow.testing.fake``).

The helper keeps the jobs and the billing and plays the habits each contract scenario asks for; this file
only says what Lumen's routes answer.
"""

from __future__ import annotations

import struct
import zlib
from decimal import Decimal
from typing import Any

from ledgerflow.testing.fake import Call, FakeJob, FakeVendorApp

PRICE = Decimal("0.30")


def png(width: int, height: int) -> bytes:
    """A real PNG (grey, 8-bit): the kit probes what it stores, never trusting a vendor's word."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def lumen_fake() -> FakeVendorApp:
    fake = FakeVendorApp(price=PRICE, latency_seconds=0.1, deduplicates=True)

    def render(job: FakeJob) -> dict[str, Any]:
        state = "cancelled" if job.cancelled else ("ready" if job.done else "rendering")
        return {
            "id": job.id,
            "state": state,
            "client_token": job.key,
            "price_usd": str(job.cost),
            "asset_url": fake.file_url(job) if state == "ready" else None,
        }

    @fake.submit("POST", "/v1/renders", key=lambda call: call.json.get("client_token"))
    async def create(call: Call) -> Any:
        width, height = (int(n) for n in call.json["size"].split("x"))
        return render(call.create_job(output=png(width, height), media_type="image/png"))

    @fake.route("GET", "/v1/renders/{job_id}")
    async def read(call: Call) -> Any:
        return render(fake.job(call.path_params["job_id"]))

    @fake.route("GET", "/v1/renders")
    async def find(call: Call) -> Any:
        return {"data": [render(job) for job in fake.jobs_for(call.query["client_token"])]}

    @fake.route("POST", "/v1/renders/{job_id}/cancel")
    async def cancel(call: Call) -> Any:
        job = fake.job(call.path_params["job_id"])
        job.cancelled = not job.done
        return render(job)

    return fake
