"""Which objects retention may delete (ledgerflow.retention.plan_expiry), pure: an object goes only when every
task that names it may lose it — the content-addressed store shares one object between tasks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ledgerflow.retention import Held, period, plan_expiry

NOW = datetime(2026, 12, 2, tzinfo=UTC)
OLD = NOW - timedelta(days=40)


def held(
    task: str, *shas: str, ended: datetime | None = OLD, released: bool = False, project: str = "p"
) -> Held:
    return Held(task, project, ended, released, {s: ("frame", f"file:///store/{s}") for s in shas})


def test_an_object_goes_only_when_every_task_naming_it_may_lose_it() -> None:
    found = plan_expiry(
        [
            held("t1", "a", "shared"),
            held("t2", "shared", ended=None),  # still open: keeps what it names
            held("t3", "b", released=True),  # released: keeps everything
            held("t4", "c", ended=NOW - timedelta(days=5)),  # within the period
            held("t5", "d", project="forever"),  # a project with no period
        ],
        {"p": 30},
        NOW,
    )
    assert found.due == {"a": "file:///store/a"}
    assert found.named_by == {"a": [("t1", "frame")]}
    assert found.kept == {
        "shared": "task t2 is open",
        "b": "task t3 was released",
        "c": "task t4 ended less than 30 days ago",
        "d": "project forever keeps artifacts for ever",
    }


def test_the_star_period_covers_every_other_project_and_none_keeps_for_ever() -> None:
    assert period({"*": 7, "drafts": 1}, "drafts") == timedelta(days=1)
    assert period({"*": 7}, "any") == timedelta(days=7)
    assert period({}, "any") is None
    found = plan_expiry([held("t1", "a"), held("t2", "a")], {"*": 30}, NOW)
    assert found.named_by == {"a": [("t1", "frame"), ("t2", "frame")]}, "recorded in both ledgers"


def test_a_task_whose_record_does_not_fold_keeps_every_object_it_mentions() -> None:
    unreadable = Held("t9", "?", None, False, {"a": ("?", "")}, readable=False)
    found = plan_expiry([held("t1", "a"), unreadable], {"*": 0}, NOW)
    assert found.due == {} and found.kept == {"a": "task t9's record does not fold: it keeps all it mentions"}
