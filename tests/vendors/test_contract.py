"""The vendor adapter contract: one suite of scenarios, written once, run against every adapter configuration.

``AdapterContract`` holds the scenarios; each ``Test…`` subclass is one adapter configuration (adapter, mode,
price, what the simulator bills) and lists the scenarios that cannot happen to it in ``NOT_APPLICABLE``, with
the reason: those cells are not collected at all, and ``CONTRACT.md`` (checked against these classes by
``test_the_contract_matrix_is_what_is_collected``) shows the whole matrix. Every scenario runs the real
``stage.run`` activity against the real adapter, the simulator over HTTP and Postgres (``contract_kit``), and
ends in the same three invariants (``Contract.check``).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar, Final

import httpx
import pytest
from contract_kit import PROJECT, SCENARIOS, Contract, End, expected_end, open_task, render_matrix

from activities.stages import StageActivities
from artifacts.local import LocalStore
from ledger.errors import AlreadyResolved
from ledger.recorder import Recorder
from rules.events import MarkerKind
from rules.plan import validate_plan
from vendors.registry import Adapters
from vendors.routes import AdapterKind, Price, RouteSpec, RouteTable, VendorMode, with_simulator_cdn
from vendors.simulator import Draw, ExecutorProfile
from vendors.simulator.config import DEFAULT_CHAT
from vendors.simulator.predictions import PRICE_PER_SECOND
from vendors.simulator.queue import APP as QUEUE_APP
from vendors.simulator.queue import PRICE_PER_SECOND as QUEUE_PRICE_PER_SECOND

SIM_KEY = "sk-test-4f1c9e"
MODULE = "tests/vendors/test_contract.py"
SIDE = 64  # pixels: small images keep every render and probe fast
IMAGE_REQUEST: dict[str, Any] = {
    "prompt": "a lighthouse at dusk",
    "format": "png",
    "width": SIDE,
    "height": SIDE,
}
# The contract's route defaults: "no send can land any more" comes within a second or two.
ROUTE: dict[str, Any] = {"timeouts": {"request": 1.0}, "max_accept_seconds": 0.5}
LESSON = """# Sums

```python
total = sum(range(4))
assert total == 6
print(total)
```
"""


@dataclass
class Env:
    """What every cell shares: the ledger, the simulator, a scratch directory, and what to close after."""

    recorder: Recorder
    sim: Any  # tests/vendors/conftest.py's SimAdmin: reset and reconfigured per test
    simulator_url: str
    tmp_path: Path
    stack: AsyncExitStack


@pytest.fixture
async def env(recorder: Recorder, sim: Any, simulator_url: str, tmp_path: Path) -> AsyncIterator[Env]:
    """The cell's environment; the HTTP clients and adapters it opens are closed when the test ends."""
    async with AsyncExitStack() as stack:
        yield Env(recorder, sim, simulator_url, tmp_path, stack)


class AdapterContract:
    """Every scenario, once; a subclass is one adapter configuration (see the module doc)."""

    LABEL: ClassVar[str]
    ADAPTER: ClassVar[AdapterKind]
    MODE: ClassVar[VendorMode]  # what the route states, and what reconciliation must work with
    FREE: ClassVar[bool] = False  # no vendor money involved (the local adapter)
    EXECUTOR: ClassVar[str]  # a prefix: each test's route is named for it alone (a pause stays in its test)
    PROFILE: ClassVar[str | None] = None  # the simulator profile its calls draw from (None: the executor)
    ESTIMATE: ClassVar[Decimal]
    PRICE: ClassVar[Price] = Price()
    VENDOR: ClassVar[dict[str, Any]] = {}  # the simulator profile of every call (latency, price)
    SIM: ClassVar[dict[str, Any]] = {}  # simulator-wide settings (what chat and images bill)
    ROUTE: ClassVar[dict[str, Any]] = {}  # route fields this configuration needs over the contract's
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {}  # scenario → why it cannot happen to this adapter

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.NOT_APPLICABLE) - set(SCENARIOS)
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown scenarios {sorted(unknown)}")
        for scenario, reason in cls.NOT_APPLICABLE.items():
            if not reason.strip():
                raise TypeError(f"{cls.__name__}: {scenario} needs a reason to be N/A")
            # Not a test here (pytest collects only callables): the cell is N/A, and CONTRACT.md says why.
            setattr(cls, f"test_{scenario}", None)

    # ── the configuration's hooks ─────────────────────────────────────────────────────────────────────
    def executor(self, suffix: str) -> str:
        return f"{self.EXECUTOR}-{suffix}"

    async def request(self, store: LocalStore) -> dict[str, Any]:
        """What the Dispatch asks the vendor for (a configuration may first put its inputs in the store)."""
        return dict(IMAGE_REQUEST)

    def check_output(self, artifact: Any, data: bytes) -> None:
        """What a plain success delivers: a PNG of the asked size, probed (not as the vendor claims)."""
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert artifact.media is not None
        assert (artifact.media.format, artifact.media.width, artifact.media.height) == ("png", SIDE, SIDE)

    def end(self, scenario: str) -> End:
        return expected_end(scenario, self.MODE, self.FREE)

    # ── the harness ───────────────────────────────────────────────────────────────────────────────────
    async def start(
        self,
        env: Env,
        *,
        route: dict[str, Any] | None = None,
        vendor: dict[str, Any] | None = None,
        first_call: Callable[[Draw], bool] | None = None,
        state_mode: bool = True,
    ) -> Contract:
        """A fresh task whose Dispatch INTENT is recorded, the simulator configured, the worker ready.

        Args:
            route: Route fields over the contract's defaults.
            vendor: Simulator profile switches over the configuration's.
            first_call: A fault that must hit the operation's first vendor call only (a seed is picked).
            state_mode: False: the route states no mode (what a route file that names none gets).
        """
        suffix = uuid.uuid4().hex[:12]
        executor = self.executor(suffix)
        raw_route = {"adapter": self.ADAPTER, "price": self.PRICE, **ROUTE, **self.ROUTE, **(route or {})}
        if state_mode:
            raw_route["mode"] = self.MODE
        spec = RouteSpec.model_validate(raw_route)
        # As a dev deployment's routes do (deployment_table): the simulator's CDN is allow-listed.
        table = with_simulator_cdn(RouteTable(routes={executor: spec}), env.simulator_url)
        store = LocalStore(env.tmp_path / "artifacts")
        client = httpx.AsyncClient()
        env.stack.push_async_callback(client.aclose)
        adapters = Adapters(
            table,
            vendor_url=env.simulator_url,
            credential=lambda name: SIM_KEY,
            client=client,
            store_for=lambda uri: store,
        )
        env.stack.push_async_callback(adapters.aclose)
        activities = StageActivities(env.recorder, adapters, store, 0.02, pause_retry_s=0.5)
        request = await self.request(store)
        # The plan as a person writes it: an input file comes through ``inputs:``, never as a reference in
        # the free ``input`` (plan validation refuses that); the operation below sends ``request`` itself.
        written = {k: v for k, v in request.items() if k != "inputs"}
        plan = validate_plan(
            {
                "goal": f"the adapter contract: {self.LABEL}",
                "project": PROJECT,
                "budget_ceiling": "100",
                "stages": [
                    {"id": "shot", "executor": executor, "estimate": str(self.ESTIMATE), "input": written}
                ],
            },
            table.names(),
            task_id=f"t-{suffix}",
        )
        inp = await open_task(env.recorder, plan, executor, request, self.ESTIMATE)
        kit = Contract(env.recorder, env.sim, store, adapters, activities, spec, inp)
        # What the adapter really works with is what this configuration declares, whatever the route says.
        assert kit.mode == self.MODE, f"{self.LABEL}: reconciliation works in {kit.mode}, not {self.MODE}"
        assert kit.adapter.capabilities.free == self.FREE
        profile = ExecutorProfile.model_validate({**self.VENDOR, **(vendor or {})})
        seed = kit.seed_where(profile, first_call) if first_call is not None else 0
        await env.sim.configure(
            seed=seed,
            mode=self.MODE.value,
            executors={self.PROFILE or executor: profile.model_dump(mode="json")},
            **self.SIM,
        )
        return kit

    # ── the scenarios ─────────────────────────────────────────────────────────────────────────────────
    async def test_submit(self, env: Env) -> None:
        """A plain call: one attempt, one charge, the Outcome's artifact stored and verified, at the cost."""
        kit = await self.start(env)
        resolved = await kit.drive()
        event = await kit.check_end(resolved, self.end("submit"))
        assert kit.errors == [] and kit.attempt == 1, "a plain success takes one attempt"
        data = b"".join(kit.store.open_read(event.artifact.uri))
        self.check_output(event.artifact, data)
        await kit.check(resolved)

    async def test_lost_response(self, env: Env) -> None:
        """A billed call whose answer is lost is found again (or counted unknown), never paid twice."""
        kit = await self.start(env, vendor={"drop_response": 1.0})
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the first attempt never got its answer"
        await kit.check_end(resolved, self.end("lost_response"))
        assert len(await kit.charges()) == 1, "the lost call was billed: the vendor did the work"
        await kit.check(resolved)

    async def test_unstated_mode(self, env: Env) -> None:
        """A route that states no mode never makes an adapter without idempotency resubmit a lost call."""
        kit = await self.start(env, vendor={"drop_response": 1.0}, state_mode=False)
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable"
        await kit.check_end(resolved, self.end("unstated_mode"))
        assert len(await kit.charges()) == 1, "the route's default mode must not buy a second call"
        await kit.check(resolved)

    async def test_retry(self, env: Env) -> None:
        """A 500 before acceptance: resubmitted under the key, voided once provably absent, or unknown."""
        kit = await self.start(env, vendor={"server_error": 0.5}, first_call=lambda d: d.server_error)
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the first call drew the 500"
        end = self.end("retry")
        await kit.check_end(resolved, end)
        assert len(await kit.charges()) == (1 if end == End.OUTCOME else 0)
        if end == End.VOID:
            # Not found by key is proof of absence only once no send can land: the void waited for that.
            sent = [
                e
                for e in await kit.events()
                if e.type == "SystemMarker" and e.payload.get("kind") == MarkerKind.SUBMITTING
            ]
            landing = (resolved.recorded_at - sent[0].recorded_at).total_seconds()
            assert landing >= kit.route.timeouts.request + kit.route.max_accept_seconds
            assert "NotYetProvable" in kit.errors
        await kit.check(resolved)

    async def test_takeover(self, env: Env) -> None:
        """A new run (new epoch) finds the job the dead run paid for; the old run is fenced off."""
        kit = await self.start(env)
        await kit.crash("vendor_accepted")
        paid = await kit.charges()
        assert len(paid) == (0 if self.FREE else 1), "the vendor accepted (and billed) before the crash"
        stale = await kit.takeover()
        fenced = await kit.zombie(stale)
        assert (fenced.type, fenced.non_retryable) == ("StaleEpoch", True), (
            "a zombie of the old run is fenced"
        )
        assert await kit.charges() == paid, "the fenced-off run called the vendor"
        resolved = await kit.drive()
        await kit.check_end(resolved, self.end("takeover"))
        await kit.check(resolved)

    async def test_key_expiry(self, env: Env) -> None:
        """Past the key's retention the job is looked up, not resubmitted into a duplicate."""
        kit = await self.start(env, route={"key_retention": 0.3}, vendor={"key_retention_seconds": 0.6})
        await kit.crash("vendor_accepted")
        [paid] = await kit.charges()
        # Past the route's retention and the vendor's: a resubmission now would be billed again.
        await asyncio.sleep(0.8)
        resolved = await kit.drive()
        event = await kit.check_end(resolved, self.end("key_expiry"))
        assert event.job_id == paid["job_id"], "the job found by lookup is the one paid for"
        await kit.check(resolved)

    async def test_purge(self, env: Env) -> None:
        """A finished job whose output was purged is a technical Failure at what the job cost."""
        kit = await self.start(env, vendor={"purge_after_seconds": 0})
        await kit.crash("vendor_completed")
        resolved = await kit.drive()
        event = await kit.check_end(resolved, self.end("purge"))
        assert "is gone" in event.error
        await kit.check(resolved)

    async def test_late_creation(self, env: Env) -> None:
        """A job created after the client gave up is adopted (one charge) or counted as unknown."""
        kit = await self.start(
            env,
            route={"timeouts": {"request": 0.5}, "max_accept_seconds": 3.0},
            vendor={"late_accept": 1.0, "late_accept_seconds": 1.5},
        )
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the client gave up on the submit"
        await kit.until_charged(1, within=5.0)  # the late job exists and is billed (whatever we decided)
        await kit.check_end(resolved, self.end("late_creation"))
        await kit.check(resolved)

    async def test_late_after_void(self, env: Env) -> None:
        """A job created past the promised acceptance window: the void stands, the sweep books its charge."""
        kit = await self.start(
            env,
            route={"timeouts": {"request": 0.4}, "max_accept_seconds": 0.3},
            vendor={"late_accept": 1.0, "late_accept_seconds": 2.5},
        )
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the client gave up on the submit"
        end = self.end("late_after_void")
        await kit.until_charged(1, within=6.0)  # the vendor created and billed it after all
        assert await kit.sweep() == (1 if end == End.SWEPT else 0), (
            "the sweep looks up voided operations only"
        )
        await kit.check_end(resolved, end)
        await kit.check(resolved)

    async def test_rate_limit(self, env: Env) -> None:
        """A 429 is retried no sooner than Retry-After, then succeeds: one charge, no void, no unknown."""
        kit = await self.start(env, vendor={"rate_limit": 0.5}, first_call=lambda d: d.rate_limited)
        resolved = await kit.drive()
        assert kit.errors == ["VendorRateLimited"], "one refusal, then the call"
        [(kind, delay)] = kit.delays
        assert kind == "VendorRateLimited" and delay >= 1.0, f"retried after {delay}s, the vendor said 1s"
        await kit.check_end(resolved, self.end("rate_limit"))
        await kit.check(resolved)


SYNCHRONOUS: Final = "synchronous: the output comes in the answer and no job outlives the call"


# The jobs adapter in each mode: the same vendor (billed below the estimate), only the route's mode differs.
JOBS_VENDOR: Final[dict[str, Any]] = {"latency_seconds": 0.1, "cost": "0.30"}
JOBS_WITHOUT_DEDUP: Final[dict[str, str]] = {
    "key_expiry": "the vendor does not deduplicate: there is no key retention to outlive",
    "unstated_mode": "only the route says what a jobs vendor deduplicates (no mode: idempotent)",
}


class TestJobsIdempotent(AdapterContract):
    LABEL = "jobs · idempotent"
    ADAPTER = AdapterKind.JOBS
    MODE = VendorMode.IDEMPOTENT
    EXECUTOR = "image.jobs"
    ESTIMATE = Decimal("0.50")
    VENDOR = JOBS_VENDOR
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {
        "unstated_mode": "a route that states no mode is idempotent: this very column",
    }


class TestJobsLookupOnly(AdapterContract):
    LABEL = "jobs · lookup_only"
    ADAPTER = AdapterKind.JOBS
    MODE = VendorMode.LOOKUP_ONLY
    EXECUTOR = "image.jobs"
    ESTIMATE = Decimal("0.50")
    VENDOR = JOBS_VENDOR
    NOT_APPLICABLE = JOBS_WITHOUT_DEDUP


class TestJobsNone(AdapterContract):
    LABEL = "jobs · none"
    ADAPTER = AdapterKind.JOBS
    MODE = VendorMode.NONE
    EXECUTOR = "image.jobs"
    ESTIMATE = Decimal("0.50")
    VENDOR = JOBS_VENDOR
    NOT_APPLICABLE = JOBS_WITHOUT_DEDUP


class TestPredictions(AdapterContract):
    LABEL = "predictions · lookup_only"
    ADAPTER = AdapterKind.PREDICTIONS
    MODE = VendorMode.LOOKUP_ONLY
    EXECUTOR = "video.predictions"  # the prediction's version
    ESTIMATE = Decimal("0.10")
    PRICE = Price(per_second=PRICE_PER_SECOND)  # the body reports no cost: priced from predict_time
    VENDOR: ClassVar[dict[str, Any]] = {"latency_seconds": 0.2}  # billed 0.2 s x 0.30 = 0.06
    # Replicate keeps no key of ours: the webhook URL is the one place the OperationKey reaches it (the
    # simulator bills and draws each prediction under it; the adapter finds a lost one by what it asked).
    ROUTE: ClassVar[dict[str, Any]] = {
        "webhook_url": "https://hooks.ledgerflow.test/r?operation_key={operation_key}"
    }
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {
        "key_expiry": "no idempotency key is sent: nothing to expire (a prediction is found by its input)",
    }


class TestOpenAIImages(AdapterContract):
    LABEL = "openai · images · none"
    ADAPTER = AdapterKind.OPENAI
    MODE = VendorMode.NONE
    EXECUTOR = "image.openai"
    PROFILE = "images"
    ESTIMATE = Decimal("0.05")
    PRICE = Price(per_call=Decimal("0.04"))
    SIM: ClassVar[dict[str, Any]] = {"image_price": "0.04"}
    # dall-e-2: its smallest size (256x256) is the nearest a 64x64 request gets (GPT image models: 1024).
    ROUTE: ClassVar[dict[str, Any]] = {"model": "dall-e-2"}
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {
        "key_expiry": "no idempotency key: the request id only labels the bill",
        "purge": f"{SYNCHRONOUS}, so nothing is left to purge",
        "late_creation": f"{SYNCHRONOUS}: a call that times out is the lost_response cell",
        "late_after_void": f"{SYNCHRONOUS}: nothing is voided after a maybe-sent call (it is unknown)",
    }

    def check_output(self, artifact: Any, data: bytes) -> None:
        """A PNG of the size the model takes nearest the asked one (dall-e-2: 256x256 for 64x64), probed."""
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert artifact.media is not None
        assert (artifact.media.format, artifact.media.width, artifact.media.height) == ("png", 256, 256)


class TestOpenAIChat(AdapterContract):
    LABEL = "openai · chat · none"
    ADAPTER = AdapterKind.OPENAI
    MODE = VendorMode.NONE
    EXECUTOR = "llm.openai"
    PROFILE = "chat"
    ESTIMATE = Decimal("0.01")
    PRICE = Price(per_1k_input_tokens=Decimal("0.002"), per_1k_output_tokens=Decimal("0.002"))
    SIM: ClassVar[dict[str, Any]] = {"chat_price_per_1k_tokens": "0.002"}
    NOT_APPLICABLE = TestOpenAIImages.NOT_APPLICABLE

    async def request(self, store: LocalStore) -> dict[str, Any]:
        return {"prompt": "write the narration of shot 1"}

    def check_output(self, artifact: Any, data: bytes) -> None:
        assert data.decode() == DEFAULT_CHAT, "the model's answer, stored as it came"


class TestLocal(AdapterContract):
    LABEL = "local · code.validate (free)"
    ADAPTER = AdapterKind.LOCAL
    MODE = VendorMode.IDEMPOTENT  # free: redoing the work is harmless, so it is simply done again
    FREE = True
    EXECUTOR = "code.validate"
    ESTIMATE = Decimal("0.01")
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {
        "lost_response": "no network between the worker and the work: no answer can be lost",
        "unstated_mode": "free: the mode is moot, redoing the work costs nothing",
        "retry": "no vendor: nothing can refuse the call",
        "key_expiry": "no vendor key",
        "purge": "the output is made in the worker and handed over at once: nothing to purge",
        "late_creation": "synchronous, in-process: nothing is created after the call returns",
        "late_after_void": "synchronous, in-process: nothing is created after the call returns",
        "rate_limit": "no vendor: nothing rate-limits the worker",
    }

    def executor(self, suffix: str) -> str:
        return "code.validate"  # the local adapter's body is chosen by the executor's name

    async def request(self, store: LocalStore) -> dict[str, Any]:
        lesson = store.put_bytes(LESSON.encode(), operation_key="contract-input")
        return {"inputs": {"draft": {"uri": lesson.uri, "sha256": lesson.sha256, "node": "draft"}}}

    def check_output(self, artifact: Any, data: bytes) -> None:
        report = json.loads(data)
        assert report == {"examples": 1, "ok": True, "failures": []}, (
            "the lesson's one example ran and passed"
        )
        assert artifact.media is not None and artifact.media.rights is not None  # our own work, our rights


CONFIGS: list[type[AdapterContract]] = [
    TestJobsIdempotent,
    TestJobsLookupOnly,
    TestJobsNone,
    TestPredictions,
    TestOpenAIImages,
    TestOpenAIChat,
    TestLocal,
]


def test_the_contract_matrix_is_what_is_collected() -> None:
    """CONTRACT.md lists every configuration and scenario exactly as the classes above collect them."""
    assert set(CONFIGS) == set(AdapterContract.__subclasses__()), "every configuration is in the matrix"
    for config in CONFIGS:
        for scenario in SCENARIOS:
            collected = callable(getattr(config, f"test_{scenario}"))
            assert collected == (scenario not in config.NOT_APPLICABLE), (config.__name__, scenario)
    text = render_matrix(CONFIGS, MODULE)
    path = Path(__file__).with_name("CONTRACT.md")
    if os.environ.get("LEDGERFLOW_WRITE_CONTRACT"):
        path.write_text(text)
    assert path.read_text() == text, (
        f"CONTRACT.md is stale: LEDGERFLOW_WRITE_CONTRACT=1 pytest {MODULE} -k matrix"
    )


# ── races between attempts of one operation (not a matrix row: the lifecycle's own guarantee) ─────────────
async def test_two_attempts_at_once_send_once(env: Env) -> None:
    """Two attempts of one operation run at once (one's heartbeat was lost, Temporal started another): both
    find it never sent, both reach the write-ahead marker; only the one that writes it sends, the other
    reconciles and adopts that job: one call, one charge, one result, on a vendor that cannot deduplicate."""
    kit = await TestJobsLookupOnly().start(env, vendor={"latency_seconds": 0.3})
    first, second = await asyncio.gather(kit.drive(), kit.drive())  # either failing fails the test
    assert first.seq == second.seq, "both attempts return the one result"
    assert len(await kit.charges()) == 1
    await kit.check(first)


async def test_an_operation_closed_meanwhile_is_never_sent_after(env: Env) -> None:
    """The task ended and ``operation.close`` resolved the operation while an attempt was still on its way to
    the vendor: the attempt's write-ahead marker is refused (the operation has its result), so it never sends;
    it returns the recorded result."""
    kit = await TestJobsLookupOnly().start(env)
    state = await kit.operation().open()  # the attempt has read the ledger: nothing sent yet …
    await kit.operation().void("the task ended")  # … then the task's end closes the operation …
    with pytest.raises(AlreadyResolved):
        await kit.operation().sending(state, 1.0)  # … and the attempt's fenced marker is refused
    resolved = await kit.drive()
    assert (resolved.type, resolved.payload["kind"]) == ("SystemMarker", "void")
    assert await kit.charges() == []
    await kit.check(resolved)


# ── the queue adapter (vendors/queue.py, fal.ai's Queue API) ──────────────────────────────────────────────
class TestQueue(AdapterContract):
    LABEL = "queue · none"
    ADAPTER = AdapterKind.QUEUE
    # No idempotency key, no client id, no listing: whatever the route states, reconciliation works in none.
    MODE = VendorMode.NONE
    EXECUTOR = "image.queue"
    PROFILE = QUEUE_APP  # the simulator's queue serves one app: every call draws from its profile
    ESTIMATE = Decimal("0.10")
    PRICE = Price(per_second=QUEUE_PRICE_PER_SECOND)  # where a result states no cost: metrics.inference_time
    VENDOR: ClassVar[dict[str, Any]] = {"latency_seconds": 0.2}  # billed 0.2 s x 0.30 = 0.06, stated as cost
    # The queue keeps no key of ours: the webhook URL (fal_webhook) is the one place the OperationKey reaches
    # it (the simulator bills and draws each request under it; the API never returns it).
    ROUTE: ClassVar[dict[str, Any]] = {
        "webhook_url": "https://hooks.ledgerflow.test/q?operation_key={operation_key}"
    }
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {
        "key_expiry": "no idempotency key or client request id is sent: nothing to expire",
    }


CONFIGS.append(TestQueue)
