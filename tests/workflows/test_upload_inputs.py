"""Issue 29 §1: inputs uploaded first, for a vendor that fetches nothing from outside (``inputs: upload``).

Real Temporal, Postgres, worker and simulator. A motion shot made from its keyframe at a Replicate-style route
whose inputs are uploaded to the vendor's Files API (``POST /v1/files``) first: the prediction names the
vendor's own file URL — never the store's — which holds the keyframe's very bytes.
"""

from __future__ import annotations

import hashlib
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

from peoplekit import wait_open

from artifacts.local import path_of
from ledgerflow.views import people
from media import probe
from rules.events import Failure, FailureKind, Outcome, parse
from runtime.signing import demo_key
from vendors.routes import AdapterKind, Price, RouteSpec, RouteTable, UploadSpec, VendorMode, default_table
from vendors.simulator.predictions import PRICE_PER_SECOND

PLAN = """
goal: a shot made from its keyframe, the keyframe uploaded to the vendor first
budget_ceiling: 10
stages:
  - {{id: frame, executor: image.keyframe, estimate: 1, input: {{format: png, width: 320, height: 180}}}}
  - id: shot
    executor: {route}
    estimate: 1
    depends_on: [frame]
    inputs: {{keyframe: frame}}
    input: {{format: mp4, duration_s: 1, width: 160, height: 96}}
"""


async def test_a_route_that_takes_uploads_gets_the_vendors_own_file_url_and_the_bytes_arrive(
    lf_with: Any, sim: Any
) -> None:
    route = f"video.{uuid.uuid4().hex[:8]}"
    spec = RouteSpec(
        adapter=AdapterKind.PREDICTIONS,
        mode=VendorMode.LOOKUP_ONLY,
        price=Price(per_second=PRICE_PER_SECOND),
        webhook_url="https://hooks.ledgerflow.test/r?operation_key={operation_key}",
        rights={"license": "vendor-commercial", "holder": "tests"},
        inputs="upload",
        upload=UploadSpec(path="/v1/files", field="content", url_field="urls.get"),
    )
    table = default_table()
    table = RouteTable(routes={**table.routes, route: spec})
    await sim.configure(executors={route: {"latency_seconds": 0.2}})
    async with lf_with(routes=table) as lf:
        plan = lf.plan(PLAN.format(route=route))
        result = await lf.run(plan)
    assert result.state == "Completed", result.summary
    events = lf.recorder.read_events(plan.task_id)
    outcomes = {o.node: o for e in events if e.type == "Outcome" and isinstance(o := parse(e), Outcome)}
    prediction = (await sim.http.get(f"/v1/predictions/{outcomes['shot'].job_id}")).json()
    sent = prediction["input"]["keyframe"]
    assert sent.startswith(lf.settings.vendor_url) and "/v1/files/" in sent, f"the vendor's own URL: {sent}"
    assert not sent.startswith("file://"), "the store's URL never reached the vendor"
    uploaded = (await sim.http.get(sent)).content
    assert hashlib.sha256(uploaded).hexdigest() == outcomes["frame"].artifact.sha256, "the keyframe's bytes"
    shot = probe(Path(path_of(outcomes["shot"].artifact.uri)))
    assert (shot.codec, shot.width, shot.height) == ("h264", 160, 96)
    billed = await sim.total(plan.task_id)
    assert billed > Decimal(0)


async def test_an_input_the_vendor_will_not_take_fails_the_node_on_content_with_nothing_paid(
    lf_with: Any, sim: Any
) -> None:
    """An input above the route's upload limit is not sent: the node fails on content (resending changes
    nothing), nothing was charged, and a person is asked — never a retry loop."""
    route = f"video.{uuid.uuid4().hex[:8]}"
    spec = RouteSpec(
        adapter=AdapterKind.PREDICTIONS,
        mode=VendorMode.LOOKUP_ONLY,
        price=Price(per_second=PRICE_PER_SECOND),
        webhook_url="https://hooks.ledgerflow.test/r?operation_key={operation_key}",
        inputs="upload",
        upload=UploadSpec(path="/v1/files", max_bytes=10),
    )
    table = default_table()
    async with lf_with(routes=RouteTable(routes={**table.routes, route: spec})) as lf:
        plan = lf.plan(PLAN.format(route=route))
        handle = await lf.start(plan)
        rid = await wait_open(lf, plan.task_id, "dead_letter:shot")  # it asks a person: no retry loop
        told = await people.decide(lf.settings, demo_key("director"), plan.task_id, rid, "abort")
        assert told.status == "accepted" and (await handle.result()).state == "Failed"
    events = lf.recorder.read_events(plan.task_id)
    [failure] = [f for e in events if e.type == "Failure" and isinstance(f := parse(e), Failure)]
    assert failure.kind == FailureKind.CONTENT and "more than upload.max_bytes" in failure.error, failure
    assert failure.actual_cost == 0 and await sim.charges(f"{plan.task_id}:shot") == []
