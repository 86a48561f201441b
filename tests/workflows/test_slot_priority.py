"""Fair slots (issue 28): a task's activities queue for the workers' slots by Temporal's task-queue
priority — a hero task's first, then those of tasks at least half done, then the rest
(workflows.policies.slot_priority)."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType

from workflows.policies import slot_priority, start_priority

PLAN = """
goal: four stages in a chain
budget_ceiling: 20
priority: {priority}
review: {{reviewers: [compliance.rules]}}
stages:
  - {{id: a, executor: llm.text, estimate: 0.1}}
  - {{id: b, executor: llm.text, estimate: 0.1, depends_on: [a]}}
  - {{id: c, executor: llm.text, estimate: 0.1, depends_on: [b]}}
  - {{id: d, executor: llm.text, estimate: 0.1, depends_on: [c]}}
"""


def test_hero_first_then_the_tasks_further_along_then_the_rest() -> None:
    order = [
        slot_priority("hero", 0.0),
        slot_priority("standard", 0.5),
        slot_priority("standard", 0.1),
        slot_priority("background", 0.9),
        slot_priority("background", 0.0),
    ]
    assert order == sorted(order) and len(set(order)) == 5, order
    assert slot_priority("hero", 0.9) == 1 and all(1 <= k <= 5 for k in order)
    # A workflow starts where its first activities will queue: its workflow tasks queue by it too.
    assert [start_priority(p).priority_key for p in ("hero", "standard", "background")] == [1, 3, 5]


async def priorities(lf, priority: str) -> list[tuple[str, int]]:
    plan = lf.plan(PLAN.format(priority=priority))
    handle = await lf.start(plan)
    assert (await handle.result()).state == "Completed"
    history = await handle.fetch_history()
    return [
        (
            e.user_metadata.summary.data.decode().strip('"').split(" ")[0],
            e.activity_task_scheduled_event_attributes.priority.priority_key,
        )
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name != "operation.sweep"
    ]


async def test_activities_carry_their_tasks_place_in_the_queue(lf, sim) -> None:
    standard = await priorities(lf, "standard")
    # Six nodes (four stages, compose, review): a and b and c start under half done, the rest after.
    assert standard == [("a", 3), ("b", 3), ("c", 3), ("d", 2), ("compose", 2), ("review", 2)], standard
    hero = await priorities(lf, "hero")
    assert {key for _, key in hero} == {1} and len(hero) == 6, hero
