"""The built-in adapters' contract: the shipped kit (``ledgerflow.testing``) run as a user of it would.

Each ``Test…`` class is one adapter configuration (adapter, mode, price, what the simulator bills) on
``SimulatorContract`` (the kit's ``AdapterContract`` with ledgerflow's simulator as the vendor's fake), and
lists the scenarios that cannot happen to it in ``NOT_APPLICABLE``, with the reason: those are not collected,
and ``CONTRACT.md`` (checked against these classes by ``test_the_contract_matrix_is_what_is_collected``) shows
the whole matrix. Every scenario runs the real ``stage.run`` activity against the real adapter, the simulator
over HTTP and Postgres, and ends in the kit's three invariants (``Contract.check``).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar, Final

import pytest
import yaml

from activities.callbacks import CallbackWaker
from artifacts.local import LocalStore
from ledger.errors import AlreadyResolved
from ledger.recorder import Recorder
from ledgerflow.testing import SCENARIOS, AdapterContract, ContractEnv, render_matrix, serving
from ledgerflow.testing.simulator import SimulatorAdmin, SimulatorContract, SimulatorVendor
from ledgerflow.webhooks import create_app
from runtime.settings import Settings
from vendors.routes import AdapterKind, Price, VendorMode
from vendors.simulator.config import DEFAULT_CHAT
from vendors.simulator.predictions import PRICE_PER_SECOND
from vendors.simulator.queue import APP as QUEUE_APP
from vendors.simulator.queue import PRICE_PER_SECOND as QUEUE_PRICE_PER_SECOND

MODULE = "tests/vendors/test_contract.py"
LESSON = """# Sums

```python
total = sum(range(4))
assert total == 6
print(total)
```
"""


SYNCHRONOUS: Final = "synchronous: the output comes in the answer and no job outlives the call"


# The jobs adapter in each mode: the same vendor (billed below the estimate), only the route's mode differs.
JOBS_VENDOR: Final[dict[str, Any]] = {"latency_seconds": 0.1, "cost": "0.30"}
JOBS_WITHOUT_DEDUP: Final[dict[str, str]] = {
    "key_expiry": "the vendor does not deduplicate: there is no key retention to outlive",
    "unstated_mode": "only the route says what a jobs vendor deduplicates (no mode: idempotent)",
}


class TestJobsIdempotent(SimulatorContract):
    LABEL = "jobs · idempotent"
    ADAPTER = AdapterKind.JOBS
    MODE = VendorMode.IDEMPOTENT
    EXECUTOR = "image.jobs"
    ESTIMATE = Decimal("0.50")
    VENDOR = JOBS_VENDOR
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {
        "unstated_mode": "a route that states no mode is idempotent: this very column",
    }


class TestJobsLookupOnly(SimulatorContract):
    LABEL = "jobs · lookup_only"
    ADAPTER = AdapterKind.JOBS
    MODE = VendorMode.LOOKUP_ONLY
    EXECUTOR = "image.jobs"
    ESTIMATE = Decimal("0.50")
    VENDOR = JOBS_VENDOR
    NOT_APPLICABLE = JOBS_WITHOUT_DEDUP


class TestJobsNone(SimulatorContract):
    LABEL = "jobs · none"
    ADAPTER = AdapterKind.JOBS
    MODE = VendorMode.NONE
    EXECUTOR = "image.jobs"
    ESTIMATE = Decimal("0.50")
    VENDOR = JOBS_VENDOR
    NOT_APPLICABLE = JOBS_WITHOUT_DEDUP


class TestPredictions(SimulatorContract):
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
    OVERCHARGE_BY = "time"  # billed by predict_time at the hardware's price: a dearer job runs longer
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {
        "key_expiry": "no idempotency key is sent: nothing to expire (a prediction is found by its input)",
    }


class TestOpenAIImages(SimulatorContract):
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
        "overcharge": "the answer states no cost (we price its tokens or images by the route's price): "
        "a higher bill shows only on the invoice, which `ledgerflow billing reconcile` compares",
    }

    def check_output(self, artifact: Any, data: bytes) -> None:
        """A PNG of the size the model takes nearest the asked one (dall-e-2: 256x256 for 64x64), probed."""
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert artifact.media is not None
        assert (artifact.media.format, artifact.media.width, artifact.media.height) == ("png", 256, 256)


class TestOpenAIChat(SimulatorContract):
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


class TestLocal(SimulatorContract):
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
        "charge_then_5xx": "no vendor: no gateway stands between the worker and the work",
        "overcharge": "free: nothing is billed",
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
    assert set(CONFIGS) == set(SimulatorContract.__subclasses__()), "every configuration is in the matrix"
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
@pytest.fixture
def contract_vendor(ledgerflow_simulator: SimulatorAdmin) -> SimulatorVendor:
    """The vendor of the races below: the jobs vendor, looked up by key, answering after 0.3 s."""
    slow = {**JOBS_VENDOR, "latency_seconds": 0.3}
    return SimulatorVendor(ledgerflow_simulator, VendorMode.LOOKUP_ONLY, slow, {})


async def test_two_attempts_at_once_send_once(contract_env: ContractEnv) -> None:
    """Two attempts of one operation run at once (one's heartbeat was lost, Temporal started another): both
    find it never sent, both reach the write-ahead marker; only the one that writes it sends, the other
    reconciles and adopts that job: one call, one charge, one result, on a vendor that cannot deduplicate."""
    kit = await TestJobsLookupOnly().start(contract_env)
    first, second = await asyncio.gather(kit.drive(), kit.drive())  # either failing fails the test
    assert first.seq == second.seq, "both attempts return the one result"
    assert len(await kit.charges()) == 1
    await kit.check(first)


async def test_an_operation_closed_meanwhile_is_never_sent_after(contract_env: ContractEnv) -> None:
    """The task ended and ``operation.close`` resolved the operation while an attempt was still on its way to
    the vendor: the attempt's write-ahead marker is refused (the operation has its result), so it never sends;
    it returns the recorded result."""
    kit = await TestJobsLookupOnly().start(contract_env)
    state = await kit.operation().open()  # the attempt has read the ledger: nothing sent yet …
    await kit.operation().void("the task ended")  # … then the task's end closes the operation …
    with pytest.raises(AlreadyResolved):
        await kit.operation().sending(state, 1.0)  # … and the attempt's fenced marker is refused
    resolved = await kit.drive()
    assert (resolved.type, resolved.payload["kind"]) == ("SystemMarker", "void")
    assert await kit.charges() == []
    await kit.check(resolved)


# ── the queue adapter (vendors/queue.py, fal.ai's Queue API) ──────────────────────────────────────────────
class TestQueue(SimulatorContract):
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


# ── a vendor that calls back (issue 29 §3): Replicate's webhooks, received and verified ──────────────────
CALLBACK_ROUTE: Final = "video.callback"  # one name for the class: the receiver's route file names it
CALLBACK_SECRET: Final = "whsec_" + "Y29udHJhY3Qta2l0LWNhbGxiYWNrLXNlY3JldC0wMQ=="
CALLBACK_ENV: Final = "LF_CONTRACT_CALLBACK_SECRET"


class TestPredictionsCallback(SimulatorContract):
    """The predictions adapter on a route whose vendor calls back: the simulator POSTs each prediction's end,
    signed, to the real receiver (``ledgerflow.webhooks``), which records it and wakes the attempt through
    Postgres (``activities.callbacks``); a lost callback costs the route's window, then a poll. The money
    guarantees are the same as polling's."""

    LABEL = "predictions · callbacks"
    ADAPTER = AdapterKind.PREDICTIONS
    MODE = VendorMode.LOOKUP_ONLY
    EXECUTOR = CALLBACK_ROUTE
    ESTIMATE = Decimal("0.10")
    PRICE = Price(per_second=PRICE_PER_SECOND)
    VENDOR: ClassVar[dict[str, Any]] = {"latency_seconds": 0.2}
    OVERCHARGE_BY = "time"
    ROUTE: ClassVar[dict[str, Any]] = {
        "webhook_url": f"https://hooks.ledgerflow.test/callbacks/{CALLBACK_ROUTE}?operation_key={{operation_key}}",
        "callback": {"secret_env": CALLBACK_ENV, "window": 1.0},
        # One route name for every scenario of the class: its shared breaker must not carry one scenario's
        # errors into the next.
        "breaker": {"min_calls": 1000},
    }
    NOT_APPLICABLE = TestPredictions.NOT_APPLICABLE

    def executor(self, suffix: str) -> str:
        return CALLBACK_ROUTE

    @pytest.fixture
    def contract_vendor(
        self, ledgerflow_simulator: SimulatorAdmin, recorder: Recorder, tmp_path: Path
    ) -> Iterator[SimulatorVendor]:
        routes = tmp_path / "receiver-routes.yaml"
        spec = {"adapter": str(self.ADAPTER), "price": self.PRICE.model_dump(mode="json"), **self.ROUTE}
        routes.write_text(yaml.safe_dump({"routes": {CALLBACK_ROUTE: spec}}))
        os.environ[CALLBACK_ENV] = CALLBACK_SECRET  # the receiver reads its secret from its environment
        settings = Settings(database_url=recorder.url, routes_file=routes, env="dev")
        with serving.served(create_app(settings), lifespan="on") as receiver:
            webhooks = {"secret": CALLBACK_SECRET, "rewrite_host": receiver}
            yield SimulatorVendor(
                ledgerflow_simulator, self.MODE, self.VENDOR, {"webhooks": webhooks}, None, self.OVERCHARGE_BY
            )

    async def waker(self, env: ContractEnv) -> CallbackWaker | None:
        waker = CallbackWaker(env.recorder.url)
        await waker.start()
        env.stack.push_async_callback(waker.close)
        self._waker = waker
        return waker

    async def test_submit(self, contract_env: ContractEnv) -> None:
        """A plain call, completed by its callback: the attempt was woken (not left to poll its window)."""
        await super().test_submit(contract_env)
        assert self._waker.woken >= 1, "the vendor's callback woke the attempt"


CONFIGS.append(TestPredictionsCallback)
