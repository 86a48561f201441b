"""``people.record``: a person's signalled decision, authenticated, authorised, validated and recorded.

A local activity (sync), called by the workflow for every ``decide`` signal before it acts on anything. The
approver keys are read here, from the worker's settings, and nowhere else: the workflow passes the raw
payload in and gets ledger events back, so no key is ever in a workflow argument, result or error.

A user error never raises (the workflow must keep running): a malformed, unsigned, forged, unauthorised or
late decision is recorded as a ``REJECTED_INPUT`` marker, idempotently, and the task carries on. Only the
ledger being unreachable raises, and the workflow's retry policy retries that.
"""

from __future__ import annotations

import hashlib

from temporalio import activity

from activities.models import RecordDecisionInput
from ledger.recorder import Recorder
from rules.envelope import StoredEvent
from rules.events import to_new
from rules.keys import resolution_key
from rules.people import Ruling, conflict, evaluate, resolutions
from rules.projection import fold
from runtime.settings import ConfigError, Settings


class PeopleActivities:
    def __init__(self, recorder: Recorder, settings: Settings) -> None:
        self.recorder = recorder
        self.settings = settings

    @activity.defn(name="people.record")
    def record(self, inp: RecordDecisionInput) -> list[StoredEvent]:
        """Rule on one raw decision, record the ruling, and return the task's events after ``inp.after``."""
        task_id = inp.task_id
        events = self.recorder.read_events(task_id)
        if events:
            try:
                keys = self.settings.approver_key_map()
            except ConfigError:
                keys = {}  # no decision can be authenticated; each is refused and audited, the task goes on
            try:
                ruling = evaluate(task_id, inp.decision, fold(events), keys, resolutions(events, task_id))
            except (RecursionError, TypeError, ValueError) as e:
                # A payload no check foresaw (e.g. nested too deep to canonicalise): refuse it rather than
                # fail the activity, which would stall the workflow on retries.
                digest = hashlib.sha256(repr(type(inp.decision)).encode() + str(e).encode()).hexdigest()
                ruling = Ruling(
                    task_id, f"sha256:{digest}", rejection=f"unreadable decision ({type(e).__name__})"
                )
            self._write(ruling, inp)
        return self.recorder.read_events(task_id, after_seq=inp.after)

    def _write(self, ruling: Ruling, inp: RecordDecisionInput) -> None:
        task_id = inp.task_id
        if ruling.decision is not None:
            assert ruling.request_id is not None
            raised = None if ruling.raise_ceiling is None else (f"task:{task_id}", ruling.raise_ceiling)
            event = to_new(ruling.decision, dedup_key=resolution_key(task_id, ruling.request_id))
            stored, inserted = self.recorder.append_idempotent(task_id, event, raise_ceiling=raised)
            if inserted:
                return
            # Someone resolved the request between our read and our write (a timeout, another person):
            # the first resolution stands; this one is refused and its sender told by whom.
            ruling = conflict(task_id, inp.decision, stored)
        if ruling.rejection is not None:
            self.recorder.append_idempotent(task_id, to_new(ruling.marker(), dedup_key=ruling.marker_key()))
