"""TaskWorkflow: the decision loop (docs/design.md#the-loop). Deterministic code only.

    open_task → loop: fold new ledger events → rules.decide → fenced INTENT → act

The ledger, not this workflow's memory, is the business state: every iteration decides on
``fold(ledger events with seq <= watermark)`` and records that watermark in its INTENT. Dispatch starts an
executor activity and does not await it, so a fan-out is many iterations, one INTENT each, running in
parallel. Waits are durable (Temporal timers and conditions): a waiting task holds no worker slot.

A Dispatch's INTENT is written by its executor activity as the activity's first step (one fenced append, the
reservation with it), not by a local activity before it: one activity per node instead of two round trips.
The loop folds the INTENT as decided (``apply_provisional``) so the next decision of a fan-out sees it, and
records in every INTENT which such INTENTs were pending (``Intent.pending``): each decision stays
recomputable from the record (``rules.recompute``). Every other action (gates, rollbacks, escalations,
requests to people, completion) is written by the workflow, with its effect, before anything acts on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from temporalio import workflow
from temporalio.common import Priority, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

with workflow.unsafe.imports_passed_through():
    # Pure modules (no I/O, clock or randomness), shared with the audit tool: safe to pass through, and
    # passing them through keeps pydantic's model classes identical inside and outside the sandbox. pydantic
    # itself too, so a run's sandbox does not import it again (no CPU change measurable in make bench).
    from pydantic import BaseModel

    from activities.boundary import error_text, error_type, refused_scope
    from activities.contracts import (
        Activity,
        AdmitInput,
        AdmitResult,
        AppendInput,
        ArrivalsInput,
        CloseInput,
        ErrorType,
        GateInput,
        LlmDecideInput,
        MarkInput,
        NotifyInput,
        OpenTaskInput,
        OpenTaskResult,
        ReadInput,
        Received,
        RecordChangesInput,
        RecordDecisionInput,
        RecordDecisionsInput,
        StageInput,
        SweepInput,
        executor_activity,
    )
    from rules.actions import Action, Compensate, Dispatch, StaticGate, Wait
    from rules.changes import change_answer, change_ref, precheck_change
    from rules.envelope import NewEvent, StoredEvent
    from rules.events import (
        Failure,
        FailureKind,
        Intent,
        MarkerKind,
        SystemMarker,
        effect_of,
        to_new,
    )
    from rules.keys import (
        backups_key,
        closing_key,
        effect_key,
        intent_key,
        refused_intent_key,
        resolution_key,
        result_key,
    )
    from rules.llm import (
        ALLOWED_LLM_ACTIONS,
        MODEL_UNAVAILABLE,
        PROPOSAL_REFUSED,
        ask_person,
        check_llm_action,
    )
    from rules.people import answer_after, decision_ref, describe_view, final_deadline, precheck
    from rules.projection import Projection, apply, apply_provisional, fold, refold, summary
    from rules.table import (
        RULES_VERSION,
        budget_refused,
        decide,
        next_deadline,
        past_deadline,
        undo_refused,
    )
    from rules.table_versions import Decide, table
    from workflows.contracts import (
        ADMITTED,
        CHANGE,
        DECIDE,
        DECISION_REFUSED,
        EPISODE,
        PROJECT,
        SPENT,
        STATE,
        VERDICT,
        WAITING,
        DecisionRuling,
        TaskInput,
        TaskResult,
        workflow_id,
    )
    from workflows.policies import (
        ADOPT_BEFORE_WAIT,
        CLOSE_RETRY,
        CLOSE_TIMEOUT,
        COMPENSATION,
        CONTINUE_AS_NEW,
        DECISION_BATCH,
        DUE_SOON,
        FAIR_DECISIONS,
        INTENT_IN_EXECUTOR,
        LEDGER_PAGE,
        LEDGER_PAGES,
        LEDGER_RETRY,
        LEDGER_TIMEOUT,
        LLM_RETRY,
        LLM_TIMEOUT,
        NOTICES_DRAIN,
        NOTIFY,
        NOTIFY_RETRY,
        NOTIFY_TIMEOUT,
        NOTIFY_WITHIN,
        OPERATION_CLOSE,
        REMAKE_ASKS,
        STAGE_RETRY,
        STEADY_PATCHES,
        STEADY_PATCHES_V2,
        STEADY_PATCHES_V3,
        SUGGESTION_MIN_GROWTH,
        UI_SPEND_EVERY,
        UI_STATES,
        UI_STORY,
        UNDO_BUDGET,
        admission_recheck,
        slot_priority,
    )

# What the ledger's local activities return (all but open_task): the events after the caller's watermark.
_EVENTS: Any = list[StoredEvent]
# What an executor returns: the rows it wrote, INTENT to result (or, for an INTENT the workflow wrote, its
# result).
_EXECUTED: Any = StoredEvent | list[StoredEvent]


@workflow.defn(name="TaskWorkflow")
class TaskWorkflow:
    def __init__(self) -> None:
        self._p: Projection | None = None
        self._epoch = 0
        self._task_id = ""
        self._woken = False
        self._running: dict[str, asyncio.Task[None]] = {}
        self._activities: dict[str, workflow.ActivityHandle[Any]] = {}  # executor activities not yet resolved
        self._stopping = False  # the task ended: its executor activities are being cancelled
        self._ceiling_at = datetime.max.replace(tzinfo=UTC)
        self._heartbeat_timeout = timedelta(seconds=30)
        self._arrived: list[StoredEvent] = []  # result events executors returned, not yet folded
        self._fenced: str | None = None  # set when an executor learns another run holds the task
        self._started: set[str] = set()  # operation keys this run has started an executor for
        # Decisions signalled by people, not yet validated and recorded, and the workflow time they arrived.
        self._inbox: list[tuple[Any, datetime]] = []
        self._asked: set[str] = set()  # refs of decisions sent as Updates, whose senders wait for a ruling
        self._rulings: dict[str, DecisionRuling] = {}  # ref -> the ruling told to its Update
        # People's signed changes (the ``change`` Update), not yet ruled on, and the rulings told.
        self._changes: list[tuple[Any, datetime]] = []
        self._change_rulings: dict[str, DecisionRuling] = {}
        # People told of their requests (the worker names a webhook for the project: OpenTaskResult.notify).
        self._notify = False
        self._announced: dict[str, str] = {}  # request id -> the last event told (opened, resolved)
        self._notices: set[asyncio.Task[None]] = set()  # notifications on their way
        self._due: set[asyncio.Task[None]] = set()  # timers that will say "due soon"
        self._to_write: dict[str, NewEvent] = {}  # operation key -> the INTENT its executor is to write
        self._intents_in_executor = False  # this run's executors write their INTENTs (INTENT_IN_EXECUTOR)
        # INTENTs the ledger refused to write: (operation key, why, the scope that is short).
        self._refused: list[tuple[str, str, str | None]] = []
        self._told: tuple[object, ...] | None = None  # what the search attributes last said (UI_STORY)
        self._told_at: datetime | None = None  # when they last said it, and the spend they said (UI_STATES)
        self._told_spent: Decimal | None = None
        self._ui_states = False  # the run was recorded with UI_STATES (asked at its start)
        # The run was recorded with STEADY_PATCHES_V3: the search attributes are upserted once a workflow task
        # has nothing else to do (``_untold``: the latest not yet upserted; ``_tell_when_idle``).
        self._tell_idle = False
        self._untold: list[SearchAttributeUpdate[Any]] | None = None
        self._teller: asyncio.Task[None] | None = None
        self._locals = 0  # local activities awaited now
        self._current = False  # the run was recorded with STEADY_PATCHES (``_has``)
        # The rule table this run decides with, and its version (recorded in each INTENT): set at the start.
        self._table: tuple[Decide | None, int] = (decide, RULES_VERSION)
        self._input: TaskInput | None = None
        self._draining = False  # the history is long: dispatch nothing more, then continue as new
        self._opened_length = 0  # the history's length once the task was opened (its ledger read)
        # Admission at the task level (ledger.admission): the task waits for its place before its first
        # dispatch (``_queued``), holds one it gives back as the task ends (``_held``), stands behind
        # ``_ahead`` others, and an ending task's signal says "ask again now" (``_admit_now``).
        self._queued = False
        self._held = False
        self._ahead = 0
        self._admit_now = False

    @workflow.signal(name=DECIDE)
    def decide_signal(self, decision: Any) -> None:
        """A person's decision. Taken as raw JSON on purpose: a malformed or unsigned payload must still be
        seen, rejected and audited by ``people.record_batch`` (the workflow never trusts or drops it)."""
        self._inbox.append((decision, workflow.now()))
        self._woken = True

    @workflow.signal(name=ADMITTED)
    def admitted_signal(self) -> None:
        """An ending task freed a place and the ledger gave it to this one (ledger.admission): ask now."""
        self._admit_now = True
        self._woken = True

    @workflow.update(name=DECIDE)
    async def decide_update(self, decision: Any) -> DecisionRuling:
        """A person's decision, answered with its ruling: it joins the inbox the signal feeds (ruled on in
        the same batches, with the time it arrived), and its sender is told once its batch is recorded —
        accepted, already resolved, or refused and why — without reading the ledger."""
        ref = decision_ref(decision)
        self._asked.add(ref)
        self._inbox.append((decision, workflow.now()))
        self._woken = True
        await workflow.wait_condition(lambda: ref in self._rulings)
        return self._rulings[ref]

    @workflow.update(name=CHANGE)
    async def change_update(self, change: Any) -> DecisionRuling:
        """A person's signed change to the running task (``rules.changes``: pause, resume …), answered with
        its ruling once recorded; the rules apply it at the loop's next decision."""
        ref = change_ref(change)
        self._changes.append((change, workflow.now()))
        self._woken = True
        await workflow.wait_condition(lambda: ref in self._change_rulings)
        return self._change_rulings[ref]

    @change_update.validator
    def change_validator(self, change: Any) -> None:
        """Refuse, before it enters the history, a change that is malformed or cannot apply to the task now
        (its signature and the signer's authority are judged by ``people.record_changes``)."""
        why = precheck_change(self._p, change)
        if why is not None:
            raise ApplicationError(why, type=DECISION_REFUSED, non_retryable=True)

    @decide_update.validator
    def decide_validator(self, decision: Any) -> None:
        """Refuse, before it enters the history, a decision that is malformed or names no request the task
        still rules on (deterministic, no I/O: the signature and the approver's authority need the key
        registry, and are judged by ``people.record_batch``, which records refusals too)."""
        why = precheck(self._p, decision)
        if why is not None:
            raise ApplicationError(why, type=DECISION_REFUSED, non_retryable=True)

    def _decide(self, p: Projection, now: datetime) -> tuple[str, Action] | None:
        """The rule table this run decides with (today's, or table 8 for a run recorded before table 9)."""
        decided = self._table[0]
        assert decided is not None
        return decided(p, now)

    def _has(self, marker: str) -> bool:
        """Whether this run takes the code ``marker`` versions (workflows/policies.py): every run recorded
        with ``STEADY_PATCHES`` does; an older one as its history says (``workflow.patched``)."""
        return self._current or workflow.patched(marker)

    @workflow.query(name="status")
    def status(self) -> dict[str, Any]:
        if self._p is None:
            return {"task_id": self._task_id, "state": "Opening"}
        if self._queued:  # waiting for admission (ledger.admission): no work started yet
            return summary(self._p) | {"admission": {"waiting": True, "ahead": self._ahead}}
        return summary(self._p)

    @workflow.run
    async def run(self, inp: TaskInput) -> TaskResult:
        self._task_id = inp.task_id
        self._input = inp
        # Taken first, at a point every replay reaches the same way: a run recorded with this marker answers
        # every later version check at once (``_has``), so none depends on when a person's Update or signal
        # was delivered — which a replay may place one workflow task apart from the original run.
        if workflow.patched(STEADY_PATCHES_V3):  # every version below at once: one marker, not four
            self._current, remake, self._ui_states, self._tell_idle = True, True, True, True
        elif workflow.patched(STEADY_PATCHES_V2):
            self._current, remake, self._ui_states = True, True, True
        else:
            self._current = workflow.patched(STEADY_PATCHES)
            # Versions after STEADY_PATCHES are asked here too, eagerly, in a fixed order (policies.py).
            remake = workflow.patched(REMAKE_ASKS)
            self._ui_states = workflow.patched(UI_STATES)
        self._table = (decide, RULES_VERSION) if remake else (table(8), 8)
        opening = OpenTaskInput(
            task_id=inp.task_id,
            plan=inp.plan,
            holder=workflow.info().run_id,
            limit=LEDGER_PAGE,
            queue=workflow.info().task_queue,
            rank=slot_priority(inp.plan.priority, 0.0),  # its start priority key (policies.start_priority)
        )
        opened: OpenTaskResult = await self._local(Activity.OPEN_TASK, opening, OpenTaskResult)
        self._epoch = opened.epoch
        self._notify = opened.notify and workflow.patched(NOTIFY)
        # After the version check above, so that no wake-up this sends can move where a run asks it.
        await self._take_place(opened.admission)
        self._p = p = fold(opened.events)
        if not opened.complete:  # a long ledger (a continued run, a takeover): the rest in pages
            self._apply(p, await self._read_all(p.task_id, after=p.watermark))
        self._opened_length = workflow.info().get_current_history_length()
        self._ceiling_at = p.created_at + timedelta(seconds=p.plan.time_ceiling)
        self._heartbeat_timeout = timedelta(seconds=inp.heartbeat_timeout_seconds)
        alarm = asyncio.create_task(self._alarm(self._ceiling_at))
        memo = {"goal": p.plan.goal, "project": p.plan.project}
        if self._tell_idle:
            self._teller = asyncio.create_task(self._tell_when_idle())
            self._told_at_start(p)
            if any(workflow.memo_value(k, None) != v for k, v in memo.items()):
                workflow.upsert_memo(memo)  # a run started without it (``starting_story``)
        elif self._has(UI_STORY):
            workflow.upsert_memo(memo)
        while not p.terminal:
            if self._fenced is not None:
                raise ApplicationError(
                    f"run fenced off: {self._fenced}", type=ErrorType.STALE_EPOCH, non_retryable=True
                )
            self._adopt_open_operations(p)
            await self._take_decisions(p)
            await self._take_refusals(p)
            self._tell(p)
            if p.terminal:
                break
            if self._long_history() and self._has(CONTINUE_AS_NEW):
                self._draining = True
                quiet = not (self._running or p.provisional or self._inbox or self._changes or self._refused)
                # An Update told its ruling still has to return it (no Update is lost to the new run).
                if quiet and workflow.all_handlers_finished():
                    self._continue_as_new(p)
            now = workflow.now()
            decided = self._decide(p, now)
            if self._queued and (decided is None or isinstance(decided[1], Dispatch | StaticGate)):
                # Not admitted yet: wait for a place before any work starts (what else the rules decide —
                # a person's pause, the task's end at its time ceiling — goes on meanwhile).
                await self._await_admission(p)
                continue
            if decided is None:
                decided = await self._ask_llm(p, now)
            rule, action = decided
            if self._draining and isinstance(action, Dispatch | StaticGate):
                action = Wait(until=next_deadline(p, now))  # in flight first; new work goes to the next run
            if isinstance(action, Wait):
                await self._wait(p, action)
                continue
            recorded = await self._record(p, rule, action, decided_at=now)
            self._act(p, recorded)
        if not self._intents_in_executor:
            # Runs recorded before executors wrote their INTENTs cancelled the alarm's timer (an event, and a
            # command replay expects); a timer left pending simply ends with the workflow.
            alarm.cancel()
        await self._stop_in_flight(p)
        if p.uncompensated() and self._has(COMPENSATION):
            await self._compensate(p)
        voided = any(n.voided for n in p.nodes.values()) or any(v.voided for v in p.compensations.values())
        if voided and self._has(OPERATION_CLOSE):
            # A voided operation was proven absent at the vendor; a job created for its key even later still
            # cost money: look for it once more before the task's books close.
            sweep = SweepInput(task_id=p.task_id)
            await workflow.execute_activity(
                Activity.OPERATION_SWEEP,
                sweep,
                start_to_close_timeout=CLOSE_TIMEOUT,
                retry_policy=CLOSE_RETRY,
            )
            self._apply(p, await self._ledger(Activity.READ, ReadInput(task_id=p.task_id, after=p.watermark)))
        # Decisions signalled while the task was ending are recorded too (rejected: the request is closed), so
        # every one of them is in the audit trail.
        await self._take_decisions(p)
        self._tell(p)
        if self._held:
            # The task's place goes to the next waiting task: the ledger admits it, this run wakes it.
            left = AdmitInput(task_id=p.task_id, queue=workflow.info().task_queue)
            await self._take_place(await self._local(Activity.RELEASE, left, AdmitResult))
        # Every Update told its ruling returns it before the workflow ends (a decision arriving after the
        # task's end is refused by the validator: nothing to decide).
        await workflow.wait_condition(workflow.all_handlers_finished)
        for timer in list(self._due):
            timer.cancel()  # "due soon" of requests the task's end closed: not needed
        if self._notices:
            # The last notifications (a request resolved by the task's end) go out, within a bound.
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: not self._notices, timeout=NOTICES_DRAIN)
        self._flush_told()
        return TaskResult(task_id=p.task_id, state=p.state.value, summary=summary(p))

    async def _compensate(self, p: Projection) -> None:
        """The compensating phase of a failed or aborted task (rules.table R12), once nothing else is in
        flight: each compensable output is undone, newest first, by an operation with its own INTENT; the end
        state is final when none is left (undone, or given up after its retries). The workflow writes these
        INTENTs itself — the closing marker bars executors from writing any — reserving past the task's
        ceiling by at most the stage's overdraw cap; an undo a scope cannot carry asks a person and waits.
        """
        while True:
            if self._fenced is not None:
                raise ApplicationError(
                    f"run fenced off: {self._fenced}", type=ErrorType.STALE_EPOCH, non_retryable=True
                )
            self._adopt_open_operations(p)  # a run that took the task over: the undo a lost run began
            if self._inbox and self._has(UNDO_BUDGET):
                await self._take_decisions(p)  # the budget an undo waits for, and its resume
            self._tell(p)
            now = workflow.now()
            decided = self._decide(p, now)
            if decided is None:
                return
            rule, action = decided
            if isinstance(action, Compensate):
                self._act(p, await self._record(p, rule, action, decided_at=now))
                continue
            assert isinstance(action, Wait)
            timeout = max(timedelta(0), action.until - now) if action.until is not None else None
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._woken, timeout=timeout)
            self._woken = False
            if not self._fold_arrived(p):
                self._apply(
                    p, await self._ledger(Activity.READ, ReadInput(task_id=p.task_id, after=p.watermark))
                )

    async def _read_all(self, task_id: str, after: int) -> list[StoredEvent]:
        """Every event after ``after``, read in pages of regular activities: each page is its own history
        event (≤ 2 MB). Local activities would not do: their results all travel in the one workflow-task
        completion, which gRPC caps at 4 MB (a 2,002-node task's re-opening hit that)."""
        events: list[StoredEvent] = []
        while True:
            read = ReadInput(task_id=task_id, after=after, limit=LEDGER_PAGE)
            page: list[StoredEvent] = await workflow.execute_activity(
                Activity.READ,
                read,
                start_to_close_timeout=LEDGER_TIMEOUT,
                retry_policy=LEDGER_RETRY,
                result_type=_EVENTS,
                summary=f"ledger page after {after}",
            )
            events += page
            if len(page) < LEDGER_PAGE:
                return events
            after = page[-1].seq

    def _long_history(self) -> bool:
        """Whether this run's history is long. Temporal's suggestion also counts bytes, and a run that has
        just read a long ledger is already big in bytes: it is taken only once the run itself has grown by
        ``SUGGESTION_MIN_GROWTH`` events, so a new run never continues again at once (a loop)."""
        info = workflow.info()
        assert self._input is not None
        length = info.get_current_history_length()
        grown = length - self._opened_length
        return length >= self._input.max_history_events or (
            grown >= SUGGESTION_MIN_GROWTH and info.is_continue_as_new_suggested()
        )

    def _continue_as_new(self, p: Projection) -> None:
        """Hand the task to a new run of this workflow: nothing is in flight, no decision is waiting to be
        recorded, so the ledger holds everything the new run needs (it re-opens the task from it)."""
        assert self._input is not None
        workflow.logger.info("history is long: continuing as new at seq %s", p.watermark)
        nxt = self._input.model_copy(update={"continued": self._input.continued + 1})
        self._flush_told()
        workflow.continue_as_new(nxt)

    def _tell(self, p: Projection) -> None:
        """What the Temporal UI shows: progress as the current details (free: not in the history) and, when
        the state, the verdict or the wait for a person changed — or the spend, at most once per
        UI_SPEND_EVERY —, the search attributes (one history event each time; runs recorded before UI_STATES
        also at every stage completion)."""
        done = sum(1 for left in p.unfinished.values() if left == 0)
        waiting = any(r.open for r in p.requests.values())
        verdict = p.review.verdict.value if p.review else ""
        finished = len(p.nodes) - sum(p.unfinished.values())
        workflow.set_current_details(
            f"{p.state.value}: {finished}/{len(p.nodes)} nodes, {done}/{len(p.unfinished)} stages done,"
            f" spent {p.spent} of {p.ceiling}"
            + (", waiting for a person" if waiting else "")
            + (f", paused by {p.paused_by}" if p.paused_by is not None else "")
        )
        if self._notify:
            self._announce(p)
        if self._ui_states:
            told: tuple[object, ...] = (p.state, verdict, waiting)
            spend_due = p.spent != self._told_spent and (
                self._told_at is None or workflow.now() - self._told_at >= UI_SPEND_EVERY
            )
            if told == self._told and not spend_due:
                return
        else:
            told = (p.state, verdict, waiting, done)
            if told == self._told:
                return
        if not self._has(UI_STORY):
            return
        self._told, self._told_at, self._told_spent = told, workflow.now(), p.spent
        attributes: list[SearchAttributeUpdate[Any]] = [
            PROJECT.value_set(p.plan.project),
            EPISODE.value_set(p.plan.episode or ""),
            STATE.value_set(p.state.value),
            SPENT.value_set(float(p.spent)),
            VERDICT.value_set(verdict),
            WAITING.value_set(waiting),
        ]
        if self._tell_idle:
            self._untold = attributes  # upserted once this workflow task has nothing else to do
        else:
            workflow.upsert_search_attributes(attributes)

    def _told_at_start(self, p: Projection) -> None:
        """What the run's start event already tells (``starting_story``), as if ``_tell`` had said it: the
        first upsert is then the first change."""
        at_start = workflow.info().typed_search_attributes
        state, verdict, waiting = at_start.get(STATE), at_start.get(VERDICT), at_start.get(WAITING)
        spent = at_start.get(SPENT)
        if state is None or verdict is None or waiting is None or spent is None:
            return  # started without them (an older client, a takeover): the first tell upserts them all
        if at_start.get(PROJECT) != p.plan.project or at_start.get(EPISODE) != (p.plan.episode or ""):
            return
        self._told = (state, verdict, waiting)  # a TaskState is the string it says
        self._told_at, self._told_spent = workflow.now(), Decimal(str(spent))

    async def _tell_when_idle(self) -> None:
        """Upsert the latest search attributes ``_tell`` kept, once the workflow task's other work is done:
        a condition is looked at when every coroutine of the workflow waits — but not while one waits for a
        local activity, whose result the same workflow task brings (the task's end writes its last INTENT
        so, between a verdict and the end state)."""
        while True:
            await workflow.wait_condition(lambda: self._untold is not None and not self._locals)
            self._flush_told()

    def _flush_told(self) -> None:
        """Upsert what ``_tell`` kept and no upsert said yet (the run's end does it before it returns)."""
        if self._untold is not None:
            untold, self._untold = self._untold, None
            workflow.upsert_search_attributes(untold)

    # ── people told of their requests ───────────────────────────────────────────────────────────────
    def _announce(self, p: Projection) -> None:
        """Tell the project's webhook of each request that opened or was resolved since the last look, and
        arm a "due soon" for each one that opened with a deadline (activities.people.notify)."""
        for rid, view in p.requests.items():
            said = self._announced.get(rid)
            if view.open and said is None:
                self._announced[rid] = "opened"
                self._tell_people(p, rid, "opened")
                deadline = view.deadline
                if deadline is not None and deadline > workflow.now():
                    wait = (deadline - workflow.now()) * DUE_SOON
                    self._keep(asyncio.create_task(self._due_soon(rid, wait)), self._due)
            elif not view.open and said == "opened":
                self._announced[rid] = "resolved"
                self._tell_people(p, rid, "resolved", describe_view(view))

    def _tell_people(self, p: Projection, rid: str, event: str, resolution: str | None = None) -> None:
        req = p.requests[rid].request
        notice = NotifyInput(
            task_id=p.task_id,
            project=p.plan.project,
            event=event,
            request_id=rid,
            kind=req.kind.value,
            node=req.node,
            reason=req.reason[:1000],
            deadline=p.requests[rid].deadline,
            resolution=resolution,
        )
        self._keep(asyncio.create_task(self._notice(notice)), self._notices)

    @staticmethod
    def _keep(task: asyncio.Task[None], where: set[asyncio.Task[None]]) -> None:
        where.add(task)
        task.add_done_callback(where.discard)

    async def _notice(self, notice: NotifyInput) -> None:
        # A notification never fails the task: the request is in the queue and on the page anyway.
        with contextlib.suppress(ActivityError):
            await workflow.execute_activity(
                Activity.PEOPLE_NOTIFY,
                notice,
                start_to_close_timeout=NOTIFY_TIMEOUT,
                schedule_to_close_timeout=NOTIFY_WITHIN,
                retry_policy=NOTIFY_RETRY,
                summary=f"tell people: {notice.request_id} {notice.event}",
            )

    async def _due_soon(self, rid: str, wait: timedelta) -> None:
        await workflow.sleep(wait)
        p = self._p
        if p is not None and rid in p.requests and p.requests[rid].open and not p.terminal:
            self._tell_people(p, rid, "due_soon")

    async def _stop_in_flight(self, p: Projection) -> None:
        """A terminal task (R1/R2/R4) stops its in-flight work, and every operation gets its one result.

        Each executor activity is asked to cancel (its cancellation reaches it with its next heartbeat; a paid
        executor then cancels its vendor job and records what it cost). Every operation still open is then
        closed by ``operation.close``, from the record and the vendor: a known job is cancelled and counted at
        what it cost, a maybe-sent request is looked up (or counted at its estimate with a cost anomaly), an
        operation that never reached the vendor is voided. Nothing is written off at zero, and no reservation
        outlives the task. A result an executor wrote first stands: every write is the operation's one result.

        The activities are scheduled with the default cancellation type (try-cancel) on purpose: waiting for
        each cancellation to complete (WAIT_CANCELLATION_COMPLETED) added ~160 ms to every task's latency in
        ``make bench``, although only a task that ends with work in flight needs to wait.
        """
        self._stopping = True
        if p.provisional:
            await self._close_intents(p)
        if not self._running:
            if not p.in_flight() or not self._has(OPERATION_CLOSE):
                return
            await self._close_open(p)  # open in the ledger with no executor in this run (a dead worker's)
            return
        for handle in list(self._activities.values()):
            handle.cancel()
        await workflow.wait_condition(lambda: not self._running)
        if self._has(OPERATION_CLOSE):
            await self._close_open(p)
        else:
            await self._stop_in_flight_before_close(p)

    async def _close_intents(self, p: Projection) -> None:
        """Before a closing task cancels its executors: make sure no executor writes a dispatch's INTENT now.

        The ``closing`` marker is written under the task's lease lock, which an executor's INTENT write takes
        too and checks for it (``append_fenced(unless=…)``): every INTENT is either in the ledger now (the
        mark returns it, and its operation is closed like any other) or can never be written (its executor is
        refused and sends nothing). The ones never written leave the projection, and are recorded as refused:
        the decisions made while they were pending stay recomputable.
        """
        await self._mark(p, to_new(SystemMarker(kind=MarkerKind.CLOSING), dedup_key=closing_key(p.task_id)))
        if p.provisional:
            never = dict(p.provisional)
            await self._refold(p, drop=set(never))
            refused = [_refused_marker(key, intent) for key, intent in never.items()]
            append = AppendInput(task_id=p.task_id, epoch=self._epoch, events=refused, after=p.watermark)
            self._apply(p, await self._ledger(Activity.APPEND, append))

    async def _refold(self, p: Projection, drop: set[str]) -> None:
        """Rebuild the projection from the whole ledger without the provisional INTENTs in ``drop`` (never
        written). Rare (a refused reservation, a task closing mid-dispatch), so a full read is acceptable."""
        if self._has(LEDGER_PAGES):
            events = await self._read_all(p.task_id, after=0)
        else:
            events = await self._read_in_one(p.task_id)
        keep = {k: v for k, v in p.provisional.items() if k not in drop}
        fresh = refold(events, keep, p.intents)
        vars(p).clear()
        vars(p).update(vars(fresh))

    async def _take_refusals(self, p: Projection) -> None:
        """A dispatch whose INTENT the ledger refused (a budget scope above the task is short): nothing was
        written or reserved and nothing was sent. Record that INTENT as refused (so the decisions made while
        it was pending stay recomputable) with the escalation that asks a person (AddBudget + Resume
        continues)."""
        while self._refused:
            op_key, why, scope = self._refused.pop(0)
            key, intent, node = next(
                (k, i, i.action.node)
                for k, i in p.provisional.items()
                if isinstance(i.action, Dispatch) and i.action.operation_key == op_key
            )
            await self._refold(p, drop={key})
            escalation = budget_refused(p, node, why, scope)
            await self._record(p, intent.rule, escalation, extra=[_refused_marker(key, intent)])

    async def _close_open(self, p: Projection) -> None:
        """Close every operation of the task still open in the ledger (``operation.close``), then fold."""
        open_ops = [n for n in p.in_flight() if n.operation_key and n.dispatch is not None]
        if not open_ops:
            return
        await asyncio.gather(*(self._close(_close_input(p, n)) for n in open_ops))
        new = await self._ledger(Activity.READ, ReadInput(task_id=p.task_id, after=p.watermark))
        self._apply(p, new)

    async def _close(self, close: CloseInput) -> None:
        """Resolve one operation with ``operation.close`` (retried until it resolves; only a fenced-off run's
        attempt gives up), and hand its result to the loop like an executor's."""
        try:
            result = await workflow.execute_activity(
                Activity.OPERATION_CLOSE,
                close,
                start_to_close_timeout=CLOSE_TIMEOUT,
                retry_policy=CLOSE_RETRY,
                result_type=StoredEvent,
            )
        except ActivityError as e:
            if error_type(e) != ErrorType.STALE_EPOCH:
                raise
            self._fenced = error_text(e)
            return
        self._arrived.append(result)

    # ── recording ────────────────────────────────────────────────────────────────────────────────────
    async def _record(
        self,
        p: Projection,
        rule: str,
        action: Action,
        *,
        decided_at: datetime | None = None,
        extra: tuple[NewEvent, ...] | list[NewEvent] = (),
    ) -> Action:
        """Record the INTENT: a Dispatch's for its executor to write; any other (and its effect) now, in one
        fenced transaction (with ``extra`` events, if any).

        ``decided_at`` is the time the action was decided at (default: now), recorded with the watermark so
        an audit can recompute the decision. Returns the action actually recorded, which is the one to act on:
        a dispatch whose reservation the ledger refuses becomes an escalation, never acted on.
        """
        reservation = action.estimate if isinstance(action, Dispatch | Compensate) else Decimal(0)
        intent = Intent(
            action=action,
            rule=rule,
            watermark=p.watermark,
            decided_at=decided_at or workflow.now(),
            reservation=reservation,
            pending=tuple(p.provisional),
            rules=self._table[1],
        )
        key = intent_key(p.task_id, p.watermark, p.intents + 1)
        op_key = action.operation_key if isinstance(action, Dispatch | StaticGate | Compensate) else None
        if isinstance(action, Dispatch) and self._has(INTENT_IN_EXECUTOR):
            self._intents_in_executor = True
            self._to_write[action.operation_key] = to_new(intent, dedup_key=key, operation_key=op_key)
            apply_provisional(p, key, intent)
            return action
        events: list[NewEvent] = [to_new(intent, dedup_key=key, operation_key=op_key), *extra]
        if (effect := effect_of(action)) is not None:
            events.append(to_new(effect[1], dedup_key=effect_key(key, effect[0])))
        append = AppendInput(
            task_id=p.task_id,
            epoch=self._epoch,
            events=events,
            after=p.watermark,
            reserve=reservation,
            overdraw=isinstance(action, Compensate),
            overdraw_cap=action.overdraw if isinstance(action, Compensate) else Decimal(0),
        )
        try:
            new = await self._ledger(Activity.APPEND, append)
        except _BudgetRefused as refused:
            # A scope above the task (episode, project) is short: the INTENT was not written and nothing was
            # reserved. Stop and ask a person instead (AddBudget + Resume continues); an undo waits, pending.
            if isinstance(action, Compensate):
                return await self._record(p, rule, undo_refused(p, action, str(refused), refused.scope))
            assert isinstance(action, Dispatch)
            return await self._record(p, rule, budget_refused(p, action.node, str(refused), refused.scope))
        self._apply(p, new)
        # Act on what the ledger holds under this key: normally the action just decided; after a worker died
        # between writing an INTENT and reporting it, the one written then (see ledger.append).
        recorded = next((e for e in new if e.dedup_key == key), None)
        if recorded is not None and recorded.payload["action"] != events[0].payload["action"]:
            return Intent.model_validate(recorded.payload).action
        return action

    def _apply(self, p: Projection, events: list[StoredEvent]) -> None:
        for e in events:
            apply(p, e)

    async def _ledger(self, name: str, arg: BaseModel) -> list[StoredEvent]:
        """A ledger local activity that writes (or not), then returns the events after the watermark."""
        events: list[StoredEvent] = await self._local(name, arg, _EVENTS)
        return events

    async def _local(self, name: str, arg: BaseModel, result_type: Any) -> Any:
        self._locals += 1  # its result comes back within the same workflow task (``_tell_when_idle``)
        try:
            return await workflow.execute_local_activity(
                name,
                arg,
                start_to_close_timeout=LEDGER_TIMEOUT,
                retry_policy=LEDGER_RETRY,
                result_type=result_type,
            )
        except (ActivityError, ApplicationError) as e:
            # A local activity's failure arrives as the ApplicationError itself (no ActivityError wrapper).
            kind = error_type(e)
            if kind == ErrorType.BUDGET_REFUSED:
                raise _BudgetRefused(error_text(e), refused_scope(e)) from e
            if kind == ErrorType.STALE_EPOCH:
                # Another run took this task over: this run must stop acting at once.
                raise ApplicationError(
                    f"run fenced off: {error_text(e)}", type=ErrorType.STALE_EPOCH, non_retryable=True
                ) from e
            raise
        finally:
            self._locals -= 1

    async def _mark(self, p: Projection, event: NewEvent, *, release: Decimal = Decimal(0)) -> None:
        mark = MarkInput(task_id=p.task_id, event=event, after=p.watermark, release=release)
        new = await self._ledger(Activity.MARK, mark)
        self._apply(p, new)

    def _unadopted(self, p: Projection) -> list[Dispatch | StaticGate | Compensate]:
        """Every INTENT on record without a resolution and without an executor in this run (nodes first, then
        gates, then a terminal task's undos: the order their executors are started in)."""
        # Runs every iteration: filter before ordering (normally nothing is left to order).
        waiting = (
            n for ids in p.running.values() for n in ids if p.nodes[n].operation_key not in self._started
        )
        actions: list[Dispatch | StaticGate | Compensate] = []
        for n in p.in_order(waiting):
            assert n.dispatch is not None  # an operation in flight always has its recorded Dispatch
            actions.append(n.dispatch)
        actions += [g for g in p.gate_pending.values() if g.operation_key not in self._started]
        return actions + [
            u.action
            for u in p.compensations.values()
            if u.in_flight and u.action is not None and u.action.operation_key not in self._started
        ]

    def _adopt_open_operations(self, p: Projection) -> None:
        """Every INTENT on record without a resolution and without an executor in this run gets one, same key.

        That is the takeover of a new run (the old run's open operations), and also the recovery of this run
        after a worker died between writing an INTENT and scheduling its activity (the replayed workflow finds
        the INTENT in the ledger, not in its history). The executor reconciles before sending anything
        (reconcile.operations), so whatever got done at the vendor is found and nothing paid for is redone.
        """
        for action in self._unadopted(p):
            self._act(p, action)

    # ── acting ───────────────────────────────────────────────────────────────────────────────────────
    def _act(self, p: Projection, action: Action) -> None:
        if isinstance(action, Dispatch | Compensate):
            # A compensation is an operation like a dispatch: same executor, no node bounds, INTENT on record.
            only = self._dispatch_only(p, action) if isinstance(action, Dispatch) else {}
            inp = StageInput(
                task_id=p.task_id,
                node=action.node,
                operation_key=action.operation_key,
                attempt=action.attempt,
                epoch=self._epoch,
                executor=action.executor,
                estimate=action.estimate,
                plan_estimate=action.plan_estimate if isinstance(action, Dispatch) else None,
                input=action.input,  # on the wire once: inside the INTENT when there is one to write
                priority=p.plan.priority,
                undo=isinstance(action, Compensate),
                **only,
            )
            self._start(
                action.operation_key, action.node, executor_activity(action.executor), inp, self._slot(p)
            )
        elif isinstance(action, StaticGate):
            gate = GateInput(
                task_id=p.task_id,
                node=action.node,
                operation_key=action.operation_key,
                input_version=action.input_version,
                epoch=self._epoch,
            )
            self._start(action.operation_key, action.node, Activity.GATE_RUN, gate, self._slot(p))

    def _dispatch_only(self, p: Projection, action: Dispatch) -> dict[str, Any]:
        """What a dispatch's executor gets beyond a compensation's: the node's bounds, reuse, the INTENT to
        write, the task's deadline."""
        stage = p.graph.nodes[action.node].stage
        return {
            "stall_after": stage.stall_after,
            "output": stage.output,
            "input_hash": action.input_hash,
            "reuse": action.reuse,
            "reuse_project": p.plan.project if p.plan.reuse == "project" else None,
            "intent": self._to_write.pop(action.operation_key, None),
            "deadline": self._ceiling_at,
        }

    def _slot(self, p: Projection) -> Priority:
        """Where this task's activities queue for the workers' slots (policies.slot_priority)."""
        done = 1 - sum(p.unfinished.values()) / max(len(p.nodes), 1)
        return Priority(priority_key=slot_priority(p.plan.priority, done))

    def _start(
        self, op_key: str, node: str, activity: str, arg: StageInput | GateInput, priority: Priority
    ) -> None:
        self._started.add(op_key)
        self._running[op_key] = asyncio.create_task(self._execute(op_key, node, activity, arg, priority))

    async def _execute(
        self, op_key: str, node: str, activity: str, arg: StageInput | GateInput, priority: Priority
    ) -> None:
        """Run one executor activity; its ledger writes are the result, its return only wakes the loop."""
        try:
            # The Temporal UI names each activity by its node and attempt (``motion/S07 a2``).
            what = (
                f"a{arg.attempt}"
                if isinstance(arg, StageInput)
                else f"gate v{getattr(arg, 'input_version', '')}"
            )
            self._activities[op_key] = handle = workflow.start_activity(
                activity,
                arg,
                summary=f"{node} {what}",
                result_type=_EXECUTED,
                start_to_close_timeout=timedelta(hours=2),
                # Every executor heartbeats (stage.run while it polls, compose/review/gate all along): a lost
                # worker's attempt is retried within this timeout, and a cancellation reaches the executor.
                heartbeat_timeout=self._heartbeat_timeout,
                retry_policy=STAGE_RETRY,
                priority=priority,
            )
            result = await handle
            # The operation's rows, INTENT to result (an executor that wrote the INTENT), or just its result.
            rows = result if isinstance(result, list) else [result]
            self._arrived.extend(rows)
        except asyncio.CancelledError:
            if not self._stopping:
                raise  # not ours (the worker evicting this workflow from its cache)
            # Asked to cancel by _stop_in_flight, which waits for the executor's own result in the ledger.
        except ActivityError as e:
            kind = error_type(e)
            if kind == ErrorType.STALE_EPOCH:
                self._fenced = error_text(e)  # another run holds the task: write nothing, stop (see run)
                return
            if kind == ErrorType.BUDGET_REFUSED and isinstance(arg, StageInput) and arg.intent is not None:
                self._refused.append((op_key, error_text(e), refused_scope(e)))  # its INTENT was not written
                return
            if self._stopping and (isinstance(e.cause, CancelledError) or kind == ErrorType.ALREADY_RESOLVED):
                # Asked to cancel by _stop_in_flight, which closes whatever is still open; or refused to write
                # its INTENT because the task is closing (nothing was written or sent).
                return
            # The executor ended without a result (an error no retry can fix: a bug). The operation is closed
            # from the record and the vendor, so its reservation is settled and nothing paid for is lost.
            if not self._has(OPERATION_CLOSE):
                reserved = arg.estimate if isinstance(arg, StageInput) else Decimal(0)
                await self._gave_up(node, op_key, reserved, FailureKind.TECHNICAL, error_text(e))
            else:
                await self._close(CloseInput.for_executor(arg, error_text(e)[:500]))
        finally:
            self._activities.pop(op_key, None)
            self._running.pop(op_key, None)
            self._woken = True

    async def _take_decisions(self, p: Projection) -> None:
        """Validate and record each signalled decision (authenticated, authorised, first one wins) before
        acting on anything: a decision exists for the loop only once it is in the ledger."""
        if self._inbox and not self._has(FAIR_DECISIONS):
            await self._take_decisions_one_at_a_time(p)
        while self._inbox:
            batch, self._inbox = self._inbox[:DECISION_BATCH], self._inbox[DECISION_BATCH:]
            received = await self._arrivals(p, batch)
            record = RecordDecisionsInput(task_id=p.task_id, decisions=received, after=p.watermark)
            recorded = await self._ledger(Activity.PEOPLE_RECORD_BATCH, record)
            self._apply(p, recorded)
            self._rule_for_senders(p, recorded, [raw for raw, _ in batch])
        while self._changes:
            changes, self._changes = self._changes[:DECISION_BATCH], self._changes[DECISION_BATCH:]
            asked = [Received(decision=raw, received_at=at) for raw, at in changes]
            rec = RecordChangesInput(task_id=p.task_id, changes=asked, after=p.watermark)
            recorded = await self._ledger(Activity.PEOPLE_RECORD_CHANGES, rec)
            self._apply(p, recorded)
            for raw, _ in changes:
                told = change_answer(recorded, p, raw)
                self._change_rulings[told.decision_id] = DecisionRuling(
                    decision_id=told.decision_id, status=told.status, detail=told.detail
                )

    def _rule_for_senders(self, p: Projection, recorded: list[StoredEvent], batch: list[Any]) -> None:
        """Tell each decision's Update (if it came as one) its ruling, from what its batch recorded."""
        for raw in batch:
            ref = decision_ref(raw)
            if ref in self._asked and ref not in self._rulings:
                told = answer_after(p, recorded, raw)
                self._rulings[ref] = DecisionRuling(
                    decision_id=told.decision_id, status=told.status, detail=told.detail
                )

    async def _arrivals(self, p: Projection, batch: list[tuple[Any, datetime]]) -> list[Received]:
        """Each decision with the time it reached Temporal. The workflow time it was handled at is never
        earlier than that, so it is exact enough unless it is past the deadline of the request the decision
        names (a worker was down or busy): then the signal's own time in the history decides."""
        late: list[str] = []
        for raw, at in batch:
            rid = raw.get("request_id") if isinstance(raw, dict) else None
            view = p.requests.get(rid) if isinstance(rid, str) else None
            deadline = final_deadline(p, view) if view is not None and view.open else None
            if deadline is not None and at > deadline:
                late.append(decision_ref(raw))
        found: dict[str, datetime] = {}
        if late:
            info = workflow.info()
            ask = ArrivalsInput(workflow_id=info.workflow_id, run_id=info.run_id, refs=late)
            found = await self._local(Activity.PEOPLE_ARRIVALS, ask, dict[str, datetime])
        return [Received(decision=raw, received_at=found.get(decision_ref(raw), at)) for raw, at in batch]

    async def _alarm(self, at: datetime) -> None:
        await workflow.sleep(max(timedelta(0), at - workflow.now()))
        self._woken = True

    # ── admission (ledger.admission) ─────────────────────────────────────────────────────────────────
    async def _take_place(self, place: AdmitResult) -> None:
        """Keep what the ledger said of this task's place, and wake the tasks it admitted meanwhile."""
        self._queued, self._ahead = not place.admitted, place.ahead
        self._held = place.held
        woken = [t for t in place.woken if t != self._task_id]
        while woken:
            sent = await asyncio.gather(
                *(workflow.get_external_workflow_handle(workflow_id(t)).signal(ADMITTED) for t in woken),
                return_exceptions=True,
            )
            # A task whose workflow is gone (terminated while it waited) cannot take the place it was given:
            # give it back for it, so the next task gets it now rather than never.
            gone = [t for t, r in zip(woken, sent, strict=True) if isinstance(r, BaseException)]
            woken = []
            for t in gone:
                left = AdmitInput(task_id=t, queue=workflow.info().task_queue)
                freed: AdmitResult = await self._local(Activity.RELEASE, left, AdmitResult)
                woken += [w for w in freed.woken if w != self._task_id]
                if self._task_id in freed.woken:  # a waiting task asking again: the place is its own
                    self._queued, self._ahead = False, 0

    async def _await_admission(self, p: Projection) -> None:
        """Wait until an ending task wakes this one (or the recheck's timer, or anything else that wakes the
        loop), then ask the ledger again."""
        if not self._admit_now:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self._admit_now or self._woken, timeout=admission_recheck(self._ahead)
                )
        self._woken = self._admit_now = False
        ask = AdmitInput(task_id=p.task_id, queue=workflow.info().task_queue)
        await self._take_place(await self._local(Activity.ADMIT, ask, AdmitResult))

    # ── waiting ──────────────────────────────────────────────────────────────────────────────────────
    async def _wait(self, p: Projection, action: Wait) -> None:
        if self._unadopted(p) and self._has(ADOPT_BEFORE_WAIT):
            # An INTENT folded since the loop's last adoption (a person's decision was recorded together with
            # an INTENT a dead worker's run of this task had written) has no executor yet: waiting now would
            # wait for nothing. Start it, and wait for it.
            self._adopt_open_operations(p)
        timeout = None
        if action.until is not None and action.until < self._ceiling_at:
            # The time ceiling has its own alarm (started once); only nearer deadlines need a timer here, so
            # an ordinary wake does not start and cancel a timer each iteration.
            timeout = max(timedelta(0), action.until - workflow.now())
        # A deadline that passed while the loop was busy has no timer to wake it (the rules' next deadline is
        # a future one): mark it now rather than wait, maybe until the time ceiling.
        overdue = bool(past_deadline(p, workflow.now())) and self._has(FAIR_DECISIONS)
        if not overdue:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._woken, timeout=timeout)
        self._woken = False
        caught_up = self._fold_arrived(p)
        now = workflow.now()
        if self._inbox and past_deadline(p, now) and self._has(FAIR_DECISIONS):
            # Decisions first: one that reached Temporal before the deadline wins over the timeout, even if
            # no worker was up at the deadline (people.arrivals finds when it arrived).
            await self._take_decisions(p)
            caught_up = True  # the batch returned everything after the watermark
        for rid, node, kind in past_deadline(p, now):
            if not p.requests[rid].open:
                continue  # resolved by what the previous mark returned
            # The timer only marks the timeout; the rules apply the policy. The same resolution key as a human
            # decision, so exactly one resolution of a request can exist. With backup approvers named, the
            # first deadline offers the request to them instead (its deadline moves to theirs).
            marker = SystemMarker(kind=kind, request_id=rid, node=node)
            key = (
                resolution_key(p.task_id, rid) if kind == MarkerKind.TIMEOUT else backups_key(p.task_id, rid)
            )
            await self._mark(p, to_new(marker, dedup_key=key))
            caught_up = True  # the mark returned everything after the watermark
        if not caught_up:
            new = await self._ledger(Activity.READ, ReadInput(task_id=p.task_id, after=p.watermark))
            self._apply(p, new)

    def _fold_arrived(self, p: Projection) -> bool:
        """Fold the result events executors returned, if they continue the watermark without a gap.

        They are the ledger's own rows (seq, epoch, server time), so folding them is folding the ledger; a gap
        means someone else wrote in between (a Progress event, a person's decision) and a read is needed.
        Returns True when nothing is left unfolded, i.e. no read is needed.
        """
        if not self._arrived:
            return False  # woken by a timer or a signal: read what happened
        for e in sorted(self._arrived, key=lambda e: e.seq):
            if e.seq == p.watermark + 1:
                apply(p, e)
        self._arrived = [e for e in self._arrived if e.seq > p.watermark]
        return not self._arrived

    # ── the LLM, only where the rules are silent ─────────────────────────────────────────────────────
    async def _ask_llm(self, p: Projection, now: datetime) -> tuple[str, Action]:
        """The fallback planner's action, or a question to a person when its answer cannot be used.

        ``now`` is the decision's time. The activity records a Decision with the action its proposal becomes
        under ``check_llm_action`` on the fold at this watermark (plus the Decision's own inference spend) at
        ``now``; this loop recomputes it from the same inputs and acts on its own result.
        """
        ask = LlmDecideInput(
            task_id=p.task_id,
            watermark=p.watermark,
            summary=summary(p),
            allowed=ALLOWED_LLM_ACTIONS,
            decided_at=now,
            epoch=self._epoch,
        )
        try:
            proposed = await workflow.execute_activity(
                Activity.LLM_DECIDE, ask, start_to_close_timeout=LLM_TIMEOUT, retry_policy=LLM_RETRY
            )
        except ActivityError as e:
            # An outage (retries exhausted) or a refused request: no Decision was recorded, nothing was
            # decided. The task waits for a person rather than failing the workflow. The error text is the
            # chat client's own (status, error type): it never carries the API key.
            return "LLM", ask_person(p, f"{MODEL_UNAVAILABLE}{error_text(e)}")
        new = await self._ledger(Activity.READ, ReadInput(task_id=p.task_id, after=p.watermark))
        self._apply(p, new)  # the Decision event (and its inference cost) is now in the projection
        problem, action = check_llm_action(p, proposed, now)
        if action is not None:
            return "LLM", action
        return "LLM", ask_person(p, f"{PROPOSAL_REFUSED}{problem}")

    # ── compatibility: bodies only replays of older histories take ──────────────────────────────────
    # Each runs only where ``workflow.patched(MARKER)`` is False, i.e. for a history recorded before that
    # marker existed (workflows/policies.py says what each marker changed). None is reached by a new run.
    # Once no history from before a marker can be replayed or resumed, replace its ``patched`` with
    # ``workflow.deprecate_patch`` and delete the body here.

    async def _take_decisions_one_at_a_time(self, p: Projection) -> None:
        """How runs recorded before ``fair-decisions-v1`` took people's decisions: one ``people.record``
        each. No worker registers that activity any more; replay answers it from the history."""
        while self._inbox:
            raw, _ = self._inbox.pop(0)
            record = RecordDecisionInput(task_id=p.task_id, decision=raw, after=p.watermark)
            self._apply(p, await self._ledger(Activity.PEOPLE_RECORD, record))

    async def _read_in_one(self, task_id: str) -> list[StoredEvent]:
        """How runs recorded before ``ledger-pages-v1`` refolded: the whole ledger in one local activity."""
        return await self._ledger(Activity.READ, ReadInput(task_id=task_id, after=0))

    async def _stop_in_flight_before_close(self, p: Projection) -> None:
        """How runs recorded before ``operation-close-v1`` ended their operations: read the ledger for up to
        two heartbeat timeouts, then write what is still open off with a Failure."""
        in_flight = {n.operation_key: (n.id, n.reserved) for n in p.in_flight() if n.operation_key}
        deadline = workflow.now() + 2 * self._heartbeat_timeout
        while True:
            new = await self._ledger(Activity.READ, ReadInput(task_id=p.task_id, after=p.watermark))
            self._apply(p, new)
            open_ops = [op for op in in_flight if op in p.reservations]
            if not open_ops or workflow.now() >= deadline:
                break
            await workflow.sleep(min(1.0, self._heartbeat_timeout.total_seconds() / 2))
        for op in open_ops:
            node, reserved = in_flight[op]
            await self._gave_up(
                node, op, reserved, FailureKind.TECHNICAL, f"cancelled: the task ended before {op} resolved"
            )

    async def _gave_up(
        self, node: str, op_key: str, reserved: Decimal, kind: FailureKind, error: str
    ) -> None:
        """How runs recorded before ``operation-close-v1`` wrote off an operation whose executor gave up."""
        assert self._p is not None
        failure = Failure(node=node, operation_key=op_key, kind=kind, error=error)
        result = to_new(failure, dedup_key=result_key(op_key), operation_key=op_key)
        await self._mark(self._p, result, release=reserved)


class _BudgetRefused(Exception):
    """The ledger refused a reservation on a budget scope (raised inside this workflow only)."""

    def __init__(self, why: str, scope: str | None) -> None:
        super().__init__(why)
        self.scope = scope


def _refused_marker(key: str, intent: Intent) -> NewEvent:
    """The record of a dispatch's INTENT that was never written (refused by the ledger, or by the task's
    closing). Not under the operation's key: that operation never existed (no INTENT, nothing sent)."""
    node = intent.action.node if isinstance(intent.action, Dispatch) else None
    marker = SystemMarker(kind=MarkerKind.INTENT_REFUSED, node=node, detail=intent.model_dump_json())
    return to_new(marker, dedup_key=refused_intent_key(key))


def _close_input(p: Projection, n: Any) -> CloseInput:
    """What ``operation.close`` needs to resolve node ``n``'s open operation (its recorded Dispatch)."""
    d = n.dispatch
    stage = p.graph.nodes[n.id].stage
    return CloseInput(
        task_id=p.task_id,
        node=n.id,
        operation_key=n.operation_key,
        executor=d.executor,
        estimate=n.reserved,
        output=stage.output,
        input_hash=d.input_hash,
    )
