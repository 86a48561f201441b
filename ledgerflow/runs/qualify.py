"""``ledgerflow routes qualify ROUTE``: run a fallback's regression set against it and record the result.

A regression set is a checked-in YAML file (the route's ``regression:``, relative to the route file)::

    executor: video.motion        # whose requests these are (the primary's field names)
    min_score: 0.7                # the judge's mean score over the cases must reach it
    cases:
      - id: wide-shot
        input: {prompt: "…", format: mp4, width: 320, height: 180, duration_s: 2}
        estimate: 0.40
        output: {formats: [mp4], duration: [1.5, 2.5], min_width: 320}   # the phase-1 node check

Each case is sent to the route as a production dispatch would be — through its adapter, in its field names
(the route's ``convert``), under an idempotency key of its own (``qualify-ROUTE-STAMP:CASE``) — its output
downloaded, probed when it is media and held to the case's ``output`` bounds (the node check), then judged
by the model (scores 0..1, their mean). The route qualifies when every case passed its check and the mean
score reaches ``min_score``; the result is recorded in the ledger's route history with every case's score,
problems and cost (``route_changes``: ``qualified`` / ``disqualified``), and a pass is good for the route's
``qualification_max_age``. A fallback never serves before it qualified (rules.routing).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from activities.llm import ChatClient
from media import MediaInvalid, probe
from rules.checks import output_problems
from rules.events import Media
from rules.plan import OutputSpec
from rules.routing import convert
from runtime.settings import Settings
from vendors.adapter import JobStatus, VendorJob, job_amount
from vendors.errors import VendorError
from vendors.registry import Adapters
from vendors.routes import RouteTable, deployment_table

JUDGE_SYSTEM = (
    "You judge one generated output against the request that asked for it. Answer with one JSON object "
    '{"scores": {"<criterion>": <0..1>, ...}, "reasons": ["..."]}: how well the output meets the request.'
)
MEDIA_FORMATS = frozenset({"mp4", "png", "wav", "jpg", "jpeg", "webm", "mov"})


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    input: dict[str, Any]
    estimate: Decimal = Field(default=Decimal("0.10"), ge=0)
    output: OutputSpec | None = None


class RegressionSet(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    executor: str
    min_score: float = Field(default=0.7, ge=0, le=1)
    cases: tuple[Case, ...] = Field(min_length=1, max_length=100)


class QualifyError(Exception):
    """A regression run could not be made (one line: the route, the set, what is wrong); nothing recorded."""


@dataclass
class CaseResult:
    id: str
    problems: list[str] = field(default_factory=list)
    score: float | None = None
    cost: Decimal = Decimal(0)
    job_id: str | None = None

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "passed": self.passed,
            "score": self.score,
            "problems": self.problems,
            "cost": str(self.cost),
            "job_id": self.job_id,
        }


@dataclass
class Qualification:
    route: str
    set_path: str
    min_score: float
    cases: list[CaseResult]

    @property
    def score(self) -> float:
        scored = [c.score for c in self.cases if c.score is not None]
        return statistics.fmean(scored) if scored else 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases) and self.score >= self.min_score

    @property
    def cost(self) -> Decimal:
        return sum((c.cost for c in self.cases), Decimal(0))

    def reason(self) -> str:
        ok = sum(c.passed for c in self.cases)
        return (
            f"{ok} of {len(self.cases)} cases passed their checks, mean score {self.score:.2f}"
            f" (needs {self.min_score:.2f}), cost {self.cost}"
        )


def load_set(table: RouteTable, route: str, routes_file: Path | None) -> tuple[Path, RegressionSet]:
    spec = table.route(route)
    if spec.regression is None:
        raise QualifyError(f"route {route!r} has no regression set (regression: FILE in the route file)")
    base = routes_file.parent if routes_file is not None else Path.cwd()
    path = (base / spec.regression).resolve()
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise QualifyError(f"regression set {path}: {e.strerror or e}") from None
    except yaml.YAMLError:
        raise QualifyError(f"regression set {path}: not valid YAML") from None
    try:
        return path, RegressionSet.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "document"
        raise QualifyError(f"regression set {path}: {where} {first['msg']}") from None


async def qualify(settings: Settings, route: str, *, actor: str, timeout_s: float = 300.0) -> Qualification:
    """Run ``route``'s regression set and record the result (see the module's docstring)."""
    table = deployment_table(settings)
    if route not in table.routes:
        raise QualifyError(f"route {route!r} is not in the route table")
    path, regression = load_set(table, route, settings.routes_file)
    spec = table.route(route)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    results: list[CaseResult] = []
    async with httpx.AsyncClient(timeout=30.0) as http:
        adapters = Adapters(
            table,
            vendor_url=settings.vendor_url_or_none(),
            credential=settings.credential,
            client=http,
            store_for=lambda uri: None,  # type: ignore[arg-type,return-value]  # cases take no stored inputs
        )
        chat = ChatClient.from_settings(http, settings)
        try:
            adapter = adapters.get(route)
            for case in regression.cases:
                key = f"qualify-{route}-{stamp}:{case.id}"
                results.append(await _run_case(adapter, chat, route, key, case, spec.convert, timeout_s))
        finally:
            await adapters.aclose()
    outcome = Qualification(route, str(path), regression.min_score, results)
    detail = {
        "set": str(path),
        "set_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "min_score": regression.min_score,
        "score": round(outcome.score, 4),
        "cost": str(outcome.cost),
        "cases": [c.as_json() for c in results],
    }
    from ledgerflow import client as lf

    rec = lf.recorder(settings)
    try:
        await asyncio.to_thread(
            rec.record_qualification, route, outcome.passed, outcome.reason(), detail, actor
        )
    finally:
        rec.dispose()
    return outcome


async def _run_case(
    adapter: Any,
    chat: ChatClient,
    route: str,
    key: str,
    case: Case,
    conversion: dict[str, str],
    timeout_s: float,
) -> CaseResult:
    result = CaseResult(case.id)
    request = convert(case.input, conversion)
    try:
        job: VendorJob = await adapter.submit(
            operation_key=key, executor=route, request=request, estimate=case.estimate, files={}
        )
        result.job_id = job.id
        waited = 0.0
        while job.status == JobStatus.RUNNING and waited < timeout_s:
            await asyncio.sleep(0.2)
            waited += 0.2
            job = await adapter.get(job.id)
        result.cost = job_amount(adapter.route, job).amount or Decimal(0)
        if job.status != JobStatus.SUCCEEDED:
            result.problems.append(f"the job ended {job.status.value}")
            return result
        media = await _media(adapter, job, case)
    except VendorError as e:
        result.problems.append(f"the route failed: {e}")
        return result
    result.problems += output_problems(case.output, media)
    question = json.dumps(
        {"request": case.input, "output": media.model_dump(mode="json") if media else None}, sort_keys=True
    )
    try:
        reply = await chat.complete(JUDGE_SYSTEM, question)
        scores = json.loads(reply.content).get("scores") or {}
        values = [float(v) for v in scores.values() if isinstance(v, int | float)]
        result.score = statistics.fmean(values) if values else 0.0
        result.cost += reply.cost
    except Exception as e:  # the judge could not answer: the case has no score (it cannot pass)
        result.problems.append(f"the judge could not score it: {type(e).__name__}")
    return result


async def _media(adapter: Any, job: VendorJob, case: Case) -> Media | None:
    """The output's media as it really is (downloaded and probed), or as claimed for a non-media output."""
    claimed = job.result.media if job.result is not None else None
    fmt = str(case.input.get("format") or "").lower()
    if fmt not in MEDIA_FORMATS:
        return Media.model_validate(claimed.model_dump()) if claimed is not None else None
    with tempfile.TemporaryDirectory(prefix="lf-qualify-") as tmp:
        out = Path(tmp) / f"out.{fmt}"
        with out.open("wb") as f:
            await adapter.download(job, f.write)
        try:
            found = await asyncio.to_thread(probe, out)
        except MediaInvalid as e:
            raise VendorError(f"the output is not valid {fmt}: {e}") from None
    from activities.outputs import probed

    return probed(found)
