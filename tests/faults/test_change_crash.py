"""Issue 26: a worker killed between a person's change and its effect; the next worker finishes the change.

A signed edit of a dead-lettered node is recorded (``TaskChange``) and the worker is frozen right there
(``change_recorded``), before the dead letter it settles is resolved, then SIGKILLed. The next worker replays
the accepted Update, rules on the same change again (recorded already: a duplicate, nothing new) and writes
the resolution once: the node runs again with the edited request, the sender is told "accepted", and the
vendor billed each attempt once.
"""

from __future__ import annotations

import asyncio

from faultkit import FaultRig, assert_invariants

from ledgerflow.views import people
from rules.events import Intent, parse
from rules.projection import fold
from runtime.settings import Settings
from runtime.signing import demo_key

REFUSED = """
goal: a frame the vendor refuses until a person rewrites its prompt
budget_ceiling: 5
stages:
  - {id: frame, executor: image.keyframe, estimate: 1, retries: 0, input: {prompt: a storm at sea}}
"""


async def test_a_change_recorded_by_a_worker_that_died_takes_effect_once_on_the_next(rig: FaultRig, sim):
    await sim.configure(executors={"image.keyframe": {"reject_content": 1.0}})
    plan = rig.plan(REFUSED)
    tid = plan.task_id
    assert tid is not None
    edit = people.signed_change(
        demo_key("director"),
        tid,
        "edit",
        node="frame",
        edit={"prompt": "a calm evening at sea"},
        note="the filter trips on storm",
    )
    w1 = await rig.spawn(hold_at="change_recorded", hold_op=edit["change_id"])
    await rig.start(plan)

    def dead_lettered(events) -> bool:
        return bool(events) and any(
            r.open and k.startswith("dead_letter:") for k, r in fold(events).requests.items()
        )

    await rig.wait_ledger(tid, dead_lettered, timeout=30, what="the frame's dead letter")
    settings = Settings(temporal_address=rig.client.service_client.config.target_host)
    sent = asyncio.create_task(people.send_change(settings, tid, edit, timeout=90))
    await w1.held("change_recorded", edit["change_id"])
    seen = rig.events(tid)
    assert [e.type for e in seen][-1] == "TaskChange", "frozen right after the change was recorded"
    assert not any(e.type == "PartialResolution" for e in seen), "… and before its effect"
    await sim.configure()  # the vendor takes the edited request
    await rig.crash(w1)
    await rig.spawn()

    told = await sent
    assert (told.status, told.detail) == ("accepted", "edit by director"), told
    await assert_invariants(rig.recorder, sim, [tid], seen=seen, rig=rig)
    events = rig.events(tid)
    assert [e.type for e in events].count("TaskChange") == 1
    assert [e.type for e in events].count("PartialResolution") == 1, "the effect recorded once"
    prompts = [
        i.action.input["prompt"]
        for e in events
        if e.type == "Intent"
        and isinstance(i := parse(e), Intent)
        and i.action.kind == "Dispatch"
        and i.action.node == "frame"
    ]
    assert prompts == ["a storm at sea", "a calm evening at sea"]
