"""The task workflow's policies: timeouts, retry policies, sizes, and the patch markers of its versions.

Patch markers are persisted compatibility data: each names a change of the workflow's commands, and every
history recorded before it replays the old way (``workflow.patched``). The bodies that only such old
histories still take are in one fenced section at the end of ``workflows/task.py``; each says which
histories need it. A marker can be retired with ``workflow.deprecate_patch`` once no history recorded before
it can still be replayed or resumed (none open, none kept for audit), and its old body deleted then.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import Priority, RetryPolicy

from activities.contracts import EXECUTOR_NON_RETRYABLE, LEDGER_NON_RETRYABLE, ErrorType

LEDGER_TIMEOUT = timedelta(seconds=30)
LEDGER_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    maximum_interval=timedelta(seconds=5),
    non_retryable_error_types=LEDGER_NON_RETRYABLE,
)
# An operation is retried under its own OperationKey until it resolves (unlimited attempts): every attempt
# reconciles before sending anything, so a retry can never pay twice, and giving up on an operation whose job
# may be paid for would lose the charge. Only what no retry can fix ends it; a stuck job is the watchdog's.
STAGE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    # Short enough that a frozen worker's open polls (which the server still hands retries to until they
    # expire) cost a task seconds, not minutes.
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=0,
    # A fenced-off run, or a bug no retry can fix (activities.contracts).
    non_retryable_error_types=EXECUTOR_NON_RETRYABLE,
)
# Runs recorded before operations were closed from the vendor (operation.close, operation.sweep) replay the
# way they ran: the new commands are taken only where this marker is (or will be) in the history.
OPERATION_CLOSE = "operation-close-v1"
ADOPT_BEFORE_WAIT = "adopt-before-wait-v1"
# A dispatch's INTENT is written by its executor (runs recorded before wrote it with a local activity first).
INTENT_IN_EXECUTOR = "intent-in-executor-v1"
# People's decisions: ruled on in batches with the time each reached Temporal (runs recorded before: one at a
# time); a deadline already past when the loop comes to wait is marked at once, not dropped; and decisions
# waiting in the inbox are ruled on before a timeout is marked (the one that arrived in time wins).
FAIR_DECISIONS = "fair-decisions-v1"
# The task tells its story in the Temporal UI: search attributes upserted on state transitions and stage
# completions (not per node: each upsert is a history event), the goal in the memo.
UI_STORY = "ui-story-v1"
# A run whose history grows long continues as new: it stops dispatching, lets what is in flight finish, and
# hands over to a new run that re-opens the task from the ledger (takes the next epoch, adopts whatever is
# still open, which after the drain is nothing but a crashed worker's leftovers).
CONTINUE_AS_NEW = "continue-as-new-v1"
# A failed or aborted task undoes its compensable outputs (rules.table R12) before its end state is final.
COMPENSATION = "compensation-v1"
# An undo the budget cannot carry asks a person (rules.table.undo_refused): the compensating phase rules on
# people's decisions as they arrive (runs recorded before recorded them only once the task's end was final).
UNDO_BUDGET = "undo-budget-v1"
DECISION_BATCH = 100
# Ledger events per local activity result when a run reads a long ledger (opening, refolding): an event is at
# most ~20 kB (a Decision's raw output), so a page stays under Temporal's 2 MB payload limit.
LEDGER_PAGE = 200
SUGGESTION_MIN_GROWTH = 2_000  # events a run adds before Temporal's size-based suggestion is taken
LEDGER_PAGES = (
    "ledger-pages-v1"  # the refold reads in pages (the opening needs no marker: see OpenTaskResult)
)
# Closing an operation (its task ended, or its executor gave up) is retried until it resolves: it only reads,
# cancels and records, and it may have to wait until a maybe-sent request is provably absent.
CLOSE_TIMEOUT = timedelta(minutes=10)
CLOSE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=0,
    non_retryable_error_types=[ErrorType.STALE_EPOCH],
)
# The fallback planner is asked a few times at most: an outage (retries exhausted on LlmUnavailable) or a
# refused request (LlmRejected, not retried) suspends the task for a person instead of failing the workflow.
LLM_TIMEOUT = timedelta(minutes=2)
LLM_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
    non_retryable_error_types=[ErrorType.LLM_REJECTED],
)

# People are told of their requests (activities.people.notify): a notification is retried with backoff for up
# to an hour, and never fails the task; a task that ends waits this long at most for the last ones to go out.
NOTIFY = "notify-v1"
NOTIFY_TIMEOUT = timedelta(seconds=30)
NOTIFY_WITHIN = timedelta(hours=1)
NOTIFY_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), backoff_coefficient=2.0, maximum_interval=timedelta(seconds=60)
)
NOTICES_DRAIN = timedelta(seconds=60)
DUE_SOON = 0.8  # a request is "due soon" once this share of its time to the deadline has passed

# Every version check above answered once, at the run's start: a run recorded with this marker takes all of
# them (workflows.task._has). Checked lazily, a marker is looked for in the workflow task where the code first
# asks, and a person's Update (or signal) that a replay delivers one workflow task apart from the original run
# would move that ask, and the replay would take the old body (seen: a status query's replay of a task decided
# by an Update called the retired people.record).
STEADY_PATCHES = "steady-patches-v1"
# Rule table 9: an output lost from the store is made again only once a person approves the cost. Asked once
# at the run's start, right after STEADY_PATCHES (a run recorded before it decides with table 8 throughout).
REMAKE_ASKS = "remake-asks-v1"
# The Temporal UI's search attributes are upserted when the task's state, verdict or wait for a person
# changes, and for its spend at most once per UI_SPEND_EVERY (each upsert is a history event; the current
# details, free, carry the per-stage progress). Runs recorded before upserted at every stage completion too.
# Asked at the run's start, right after REMAKE_ASKS.
UI_STATES = "ui-states-v1"
UI_SPEND_EVERY = timedelta(seconds=60)
# A run recorded with this marker takes STEADY_PATCHES, REMAKE_ASKS and UI_STATES at once. Each version check
# costs a run two history events (the marker, and the TemporalChangeVersion search attribute the SDK upserts
# with it): a new run asks this one first and records one marker instead of three; a run recorded before finds
# none of it and asks the three as it did. A later version is asked after it, and folded into a V3 likewise.
STEADY_PATCHES_V2 = "steady-patches-v2"
# STEADY_PATCHES_V2, and the search attributes told once per workflow task: ``_tell`` keeps the latest and
# the run upserts it when the workflow task has nothing else to do (two changes in one workflow task, such
# as Queued → Running or the verdict then the end, are one event, not two); a run started with its memo and
# search attributes (``workflows.contracts.starting_story``) upserts neither until they change.
STEADY_PATCHES_V3 = "steady-patches-v3"


def slot_priority(priority: str, done: float) -> int:
    """The Temporal task-queue priority key of a task's activities (1 goes first; Temporal's default is 3):
    when every task's runnable nodes compete for the workers' slots, a hero task's go first, then those of
    tasks at least half done, then the rest — so tasks finish roughly in the order they got going, rather
    than a thousand all at the same slow pace. ``done``: the share of the task's nodes finished."""
    if priority == "hero":
        return 1
    base = 4 if priority == "background" else 2
    return base if done >= 0.5 else base + 1


def admission_recheck(ahead: int) -> timedelta:
    """How long a task waiting for admission (ledger.admission) waits before it asks again, if no ending task
    wakes it first: longer the more tasks stand before it, so a thousand waiting tasks ask a few times a
    second in all, not a thousand. The wake-up is the fast path; this is for one that was lost (its sender's
    workflow terminated) and for places freed by a task that came to wait on a person."""
    return timedelta(seconds=min(ADMISSION_RECHECK_MAX_S, ADMISSION_RECHECK_MIN_S + 2 * ahead))


ADMISSION_RECHECK_MIN_S = 30
ADMISSION_RECHECK_MAX_S = 900


def start_priority(priority: str) -> Priority:
    """A task's workflow started with its place in the queues: its workflow tasks queue by it too (a
    thousand tasks' decisions compete for the workers as their activities do), and it is where its activities
    start before any node is done."""
    return Priority(priority_key=slot_priority(priority, 0.0))
