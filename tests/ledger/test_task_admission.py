"""Admission at the task level, in the ledger (ledger.admission): the bound, the order of the waiting, what a
task waiting on a person frees, no bound at 0, and no two workers admitting past the bound. Real Postgres."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import text

from ledger.recorder import Recorder

STANDARD, HERO = 3, 1


def queue() -> str:
    return f"q-{uuid.uuid4().hex[:10]}"


def test_past_the_bound_a_task_waits_and_an_ending_task_admits_the_next(recorder: Recorder) -> None:
    q = queue()
    a, b, c = (recorder.admit(t, q, STANDARD, 2, enter=True) for t in (f"{q}-a", f"{q}-b", f"{q}-c"))
    assert (a.admitted, a.held, b.admitted, b.held) == (True, True, True, True)
    assert (c.admitted, c.held, c.ahead) == (False, True, 0)
    assert recorder.admit(f"{q}-c", q, STANDARD, 2, enter=False).admitted is False  # asking again: still full
    assert recorder.release_admission(f"{q}-a", q, 2) == (f"{q}-c",)
    assert recorder.admit(f"{q}-c", q, STANDARD, 2, enter=False).admitted is True


def test_a_hero_task_goes_before_standard_tasks_that_asked_earlier(recorder: Recorder) -> None:
    q = queue()
    recorder.admit(f"{q}-run", q, STANDARD, 1, enter=True)
    first = recorder.admit(f"{q}-s1", q, STANDARD, 1, enter=True)
    second = recorder.admit(f"{q}-s2", q, STANDARD, 1, enter=True)
    hero = recorder.admit(f"{q}-h", q, HERO, 1, enter=True)
    assert (first.ahead, second.ahead, hero.ahead) == (0, 1, 0)
    assert recorder.admit(f"{q}-s2", q, STANDARD, 1, enter=False).ahead == 2  # the hero stands before it now
    assert recorder.release_admission(f"{q}-run", q, 1) == (f"{q}-h",)
    assert recorder.release_admission(f"{q}-h", q, 1) == (f"{q}-s1",)
    assert recorder.release_admission(f"{q}-s1", q, 1) == (f"{q}-s2",)


def ask_person(recorder: Recorder, task_id: str, request: str, kind: str) -> None:
    """What the INTENT asking a person writes (ledger.approvals)."""
    with recorder._engine.begin() as conn:
        conn.execute(
            text("INSERT INTO human_queue (task_id, request_id, kind, scope) VALUES (:t, :r, :k, 'p')"),
            {"t": task_id, "r": request, "k": kind},
        )


def test_a_task_stopped_for_a_person_frees_its_place_and_one_awaiting_an_approval_does_not(
    recorder: Recorder,
) -> None:
    """An escalation stops the whole task (rules.table R5); an approval stops only its node's dependents,
    and the task's other branches keep running: it still counts."""
    q = queue()
    recorder.admit(f"{q}-a", q, STANDARD, 1, enter=True)
    assert recorder.admit(f"{q}-b", q, STANDARD, 1, enter=True).admitted is False
    try:
        ask_person(recorder, f"{q}-a", "approval:shot", "approval")
        assert recorder.admit(f"{q}-b", q, STANDARD, 1, enter=False).admitted is False
        ask_person(recorder, f"{q}-a", "escalation:1", "escalation")
        assert recorder.admit(f"{q}-b", q, STANDARD, 1, enter=False).admitted is True
    finally:
        with recorder._engine.begin() as conn:
            conn.execute(text("DELETE FROM human_queue WHERE task_id = :t"), {"t": f"{q}-a"})


def test_a_release_run_again_returns_the_same_tasks_to_wake(recorder: Recorder) -> None:
    """A worker that died after the release committed runs it again (a local activity): the wake-ups it
    owes are returned again, not lost."""
    q = queue()
    for t in ("a", "b", "c"):
        recorder.admit(f"{q}-{t}", q, STANDARD, 1, enter=True)
    assert recorder.release_admission(f"{q}-a", q, 1) == (f"{q}-b",)
    assert recorder.release_admission(f"{q}-a", q, 1) == (f"{q}-b",)


def test_a_task_already_running_is_never_made_to_wait(recorder: Recorder) -> None:
    """A task that opened with work already done (started before admission was on) does not enter."""
    q = queue()
    recorder.admit(f"{q}-a", q, STANDARD, 1, enter=True)
    late = recorder.admit(f"{q}-old", q, STANDARD, 1, enter=False)
    assert (late.admitted, late.held) == (True, False)


def test_with_no_bound_nothing_enters_and_whatever_waits_is_admitted(recorder: Recorder) -> None:
    q = queue()
    recorder.admit(f"{q}-a", q, STANDARD, 1, enter=True)
    assert recorder.admit(f"{q}-b", q, STANDARD, 1, enter=True).admitted is False
    free = recorder.admit(f"{q}-new", q, STANDARD, 0, enter=True)
    assert (free.admitted, free.held, free.woken) == (True, False, (f"{q}-b",))


def test_two_workers_never_admit_past_the_bound(recorder: Recorder) -> None:
    q = queue()
    tasks = [f"{q}-{n:02d}" for n in range(24)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        places = list(pool.map(lambda t: recorder.admit(t, q, STANDARD, 5, enter=True), tasks))
    assert sum(p.admitted for p in places) == 5
    admitted = {t for t, p in zip(tasks, places, strict=True) if p.admitted}
    # Every waiting task has its own place in line: 0, 1, … 18.
    assert sorted(p.ahead for p in places if not p.admitted) == list(range(19))
    woken = [w for t in sorted(admitted) for w in recorder.release_admission(t, q, 5)]
    assert len(woken) == len(set(woken)) == 5
