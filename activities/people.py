"""People's signalled decisions: authenticated, authorised, validated and recorded (``people.record_batch``),
and when each one reached Temporal (``people.arrivals``).

Local activities, called by the workflow for its inbox of ``decide`` signals before it acts on anything. The
approver key registry (public keys only: ``rules.approvers``) is read here, from the ledger's database, and
the signatures are verified here (``runtime.signing``): the workflow passes the raw payloads in and gets
ledger events back. No worker holds an approver's private key.

A user error never raises (the workflow must keep running): a malformed, unsigned, forged, unauthorised or
late decision is recorded as a ``REJECTED_INPUT`` marker, idempotently, and the task carries on. Beyond the
first few refusals on one request, the rest of a batch is counted in one ``REJECTED_BURST`` marker with every
distinct reason (``rules.people.bounded``), so a flood of signals cannot grow the ledger without bound. Only
the ledger being unreachable raises, and the workflow's retry policy retries that.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from datetime import UTC, datetime

import httpx
from temporalio import activity
from temporalio.client import Client

from activities.contracts import (
    Activity,
    ArrivalsInput,
    NotifyInput,
    Received,
    RecordChangesInput,
    RecordDecisionsInput,
)
from ledger.recorder import Recorder
from rules.approvers import KeyRecord
from rules.changes import evaluate_change, recovery
from rules.envelope import StoredEvent
from rules.events import to_new
from rules.keys import change_key, rejected_key, resolution_key
from rules.people import (
    Keys,
    Ruling,
    bounded,
    conflict,
    decision_ref,
    evaluate,
    prior_rejections,
    refused_refs,
    resolutions,
)
from rules.pricing import RoutePrice
from rules.projection import Projection, apply, fold
from runtime import faults
from runtime.settings import ConfigError, Settings
from runtime.signing import demo_public_keys, verify
from runtime.standard_webhooks import sign
from vendors.routes import deployment_table

DEMO_REFUSED = "a demo key: refused outside dev mode (LEDGERFLOW_ENV=dev)"


class PeopleActivities:
    def __init__(self, recorder: Recorder, settings: Settings, client: Client | None = None) -> None:
        self.recorder = recorder
        self.settings = settings
        self.client = client

    def keys(self) -> Keys:
        """The registry's keys as of now, and the issued-at window; outside dev mode a demo key is treated as
        revoked (with why)."""
        registry = self.recorder.key_registry()
        if not self.settings.dev:
            demo = demo_public_keys()
            registry = {kid: _refused_demo(k) if k.public_key in demo else k for kid, k in registry.items()}
        return Keys(
            registry=registry,
            verify=verify,
            window=self.settings.decision_window,
            roots=self.settings.root_keys(),
        )

    @activity.defn(name=Activity.PEOPLE_RECORD_BATCH)
    def record_batch(self, inp: RecordDecisionsInput) -> list[StoredEvent]:
        """Rule on each decision of the batch in order, record the rulings, and return the task's events after
        ``inp.after``."""
        task_id = inp.task_id
        events = self.recorder.read_events(task_id)
        if events:
            keys = self.keys()
            p = fold(events)
            refused: list[Ruling] = []
            for received in inp.decisions:
                ruling = self._rule(task_id, received, p, keys, events)
                if ruling.decision is not None:
                    ruling = self._accept(ruling, received)
                    if ruling.decision is not None:  # recorded: later decisions of the batch see it
                        new = self.recorder.read_events(task_id, after_seq=p.watermark)
                        for e in new:
                            apply(p, e)
                        events += new
                        continue
                if ruling.rejection is not None:
                    refused.append(ruling)
            # A decision refused before (a repeated signal, or a batch retried after a worker lost it and
            # made up again from other signals) is audited already: each refusal is counted once.
            counted = refused_refs(events)
            refused = [r for r in refused if r.ref not in counted]
            single, bursts = bounded(task_id, refused, prior_rejections(events))
            for ruling in single:
                self.recorder.append_idempotent(
                    task_id, to_new(ruling.marker(), dedup_key=ruling.marker_key())
                )
            for burst in bursts:
                self.recorder.append_idempotent(task_id, burst)
        return self.recorder.read_events(task_id, after_seq=inp.after)

    def _rule(
        self, task_id: str, received: Received, p: Projection, keys: Keys, events: list[StoredEvent]
    ) -> Ruling:
        try:
            return evaluate(
                task_id, received.decision, p, keys, received.received_at, resolutions(events, task_id)
            )
        except (RecursionError, TypeError, ValueError) as e:
            # A payload no check foresaw (e.g. nested too deep to canonicalise): refuse it rather than fail
            # the activity, which would stall the workflow on retries.
            digest = hashlib.sha256(repr(type(received.decision)).encode() + str(e).encode()).hexdigest()
            return Ruling(task_id, f"sha256:{digest}", rejection=f"unreadable decision ({type(e).__name__})")

    def _accept(self, ruling: Ruling, received: Received) -> Ruling:
        """Record an accepted decision under its request's resolution key; the ruling that stands (a refusal
        if someone resolved the request first)."""
        task_id = ruling.task_id
        assert ruling.decision is not None and ruling.request_id is not None
        event = to_new(ruling.decision, dedup_key=resolution_key(task_id, ruling.request_id))
        stored, inserted = self.recorder.append_idempotent(
            task_id,
            event,
            raise_ceiling=ruling.raise_ceiling,
            human_capacity=self.settings.human_capacity or None,  # the load, for the work it unblocks
        )
        if inserted:
            return ruling
        # Someone resolved the request between our read and our write (a timeout, another person): the first
        # resolution stands; this one is refused and its sender told by whom.
        return conflict(task_id, received.decision, stored)

    def route_prices(self) -> dict[str, RoutePrice]:
        """The deployment's routes and their declared prices, as of now (a re-route names one and is re-quoted
        at its price; the bound is recorded with the change, so the audit never needs today's route file)."""
        try:
            table = deployment_table(self.settings)
        except ConfigError as e:  # an unusable route file refuses re-routes; it must not stall the task
            activity.logger.warning("route file unusable, re-routes refused: %s", e)
            return {}
        return {name: table.prices(name)[0] for name in table.routes}

    @activity.defn(name=Activity.PEOPLE_RECORD_CHANGES)
    def record_changes(self, inp: RecordChangesInput) -> list[StoredEvent]:
        """Rule on each signed change of the batch in order (``rules.changes``), record each ruling — the
        ``TaskChange``, or a refusal marker naming why — and return the task's events after ``inp.after``."""
        task_id = inp.task_id
        events = self.recorder.read_events(task_id)
        if events:
            keys = self.keys()
            p = fold(events)
            routes = self.route_prices()
            for received in inp.changes:
                ruling = evaluate_change(task_id, received.decision, p, keys, received.received_at, routes)
                if ruling.event is not None:
                    key = change_key(task_id, ruling.ref)
                    self.recorder.append_idempotent(task_id, to_new(ruling.event, dedup_key=key))
                    faults.mark("change_recorded", op=ruling.ref)
                elif ruling.rejection is not None:
                    marker = to_new(ruling.marker(), dedup_key=rejected_key(task_id, ruling.ref))
                    self.recorder.append_idempotent(task_id, marker)
                for e in self.recorder.read_events(task_id, after_seq=p.watermark):
                    apply(p, e)  # the next change of the batch is ruled on what this one left
                # The request the change settles (an edited node's dead letter, a restored node's approval,
                # the waived rework's escalation) is resolved — idempotent: a batch retried after the change
                # was recorded but before this (a worker killed at "change_recorded") still records it once.
                if (found := recovery(p, received.decision)) is not None:
                    rid, resolved = found
                    key = resolution_key(task_id, rid)
                    self.recorder.append_idempotent(task_id, to_new(resolved, dedup_key=key))
                    for e in self.recorder.read_events(task_id, after_seq=p.watermark):
                        apply(p, e)
        return self.recorder.read_events(task_id, after_seq=inp.after)

    @activity.defn(name=Activity.PEOPLE_NOTIFY)
    async def notify(self, inp: NotifyInput) -> None:
        """Tell the project's people of a request: POST a JSON notification to its webhook, signed with the
        Standard Webhooks scheme; a failed delivery raises, and Temporal retries it with backoff under the
        same ``webhook-id`` (the receiver can drop a repeat). Nothing configured: nothing sent."""
        url = self.settings.notify_url(inp.project)
        if url is None:
            return
        secret = self.settings.credential(self.settings.notify_secret_env)
        page = self.settings.review_url
        body = {
            "type": f"request.{inp.event}",
            "task_id": inp.task_id,
            "project": inp.project,
            "request_id": inp.request_id,
            "kind": inp.kind,
            "node": inp.node,
            "reason": inp.reason,
            "deadline": inp.deadline.isoformat() if inp.deadline else None,
            "resolution": inp.resolution,
            "page_url": f"{page.rstrip('/')}/requests/{inp.task_id}/{inp.request_id}" if page else None,
        }
        raw = json.dumps(body, sort_keys=True).encode()
        msg_id = (
            "msg_" + hashlib.sha256(f"{inp.task_id}\n{inp.request_id}\n{inp.event}".encode()).hexdigest()[:32]
        )
        headers = {"content-type": "application/json", **sign(secret, msg_id, int(time.time()), raw)}
        async with httpx.AsyncClient(timeout=10.0) as client:
            try:
                answer = await client.post(url, content=raw, headers=headers)
            except httpx.HTTPError as e:
                why = f"notification to {inp.project}'s webhook not delivered: {type(e).__name__}"
                raise RuntimeError(why) from None
        if not answer.is_success:
            raise RuntimeError(f"notification to {inp.project}'s webhook answered {answer.status_code}")

    @activity.defn(name=Activity.PEOPLE_ARRIVALS)
    async def arrivals(self, inp: ArrivalsInput) -> dict[str, datetime]:
        """When each of the named decisions reached Temporal: the event time of its ``decide`` signal in the
        run's history (the server's clock). Asked only for decisions handled after their request's deadline
        (a worker down or busy at the time), so the one that arrived in time still wins over the timeout."""
        client = self.client or activity.client()
        wanted = set(inp.refs)
        found: dict[str, datetime] = {}
        handle = client.get_workflow_handle(inp.workflow_id, run_id=inp.run_id)
        async for event in handle.fetch_history_events():
            if not event.HasField("workflow_execution_signaled_event_attributes"):
                continue
            attrs = event.workflow_execution_signaled_event_attributes
            if attrs.signal_name != "decide" or not attrs.input.payloads:
                continue
            try:
                values = await client.data_converter.decode(list(attrs.input.payloads))
            except Exception:  # a payload nothing can decode names no decision we look for
                continue
            ref = decision_ref(values[0]) if values else None
            if ref in wanted and ref not in found:
                found[ref] = event.event_time.ToDatetime(tzinfo=UTC)
                if len(found) == len(wanted):
                    break
        return found


def _refused_demo(key: KeyRecord) -> KeyRecord:
    return replace(key, revoked_at=datetime.min.replace(tzinfo=UTC), revoked_reason=DEMO_REFUSED)
