"""The plan: what a task must produce, as a DAG of stages, with its money, time and people limits.

A plan is validated synchronously at submission (``load_plan`` / ``validate_plan``) and every rejection is
one :class:`PlanError` whose message names the offending stage. The framework appends two stages to every
plan: ``compose`` (assembles the business outputs) and ``review`` (the two-phase review).
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    model_validator,
)

from rules import scopes
from rules.inputs import check_inputs, ref_paths
from rules.money import Amount

ID_PATTERN: Final = r"[A-Za-z0-9_.-]{1,64}"  # matched with fullmatch: "$" would accept a trailing newline
_ID_RE: Final = re.compile(ID_PATTERN)
_FORMAT_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,15}")
MAX_FAN_OUT: Final = 500
MAX_STAGES: Final = 200
# What one task can carry (docs/design.md#long-tasks-continue-as-new). Checked by the validator only, never by
# the model: a plan already recorded in a ledger (TaskCreated) still loads and folds whatever it holds.
# Nodes, fan-outs expanded, framework stages included: a run folds its whole ledger in one activation, and at
# 20,002 nodes that fold takes 1.1 s of CPU (3.0 s at 50,002: past the SDK's 2 s deadlock detector) and the
# ledger is 27 MB of events (Temporal's history holds 50 MB). `make bench-10k` runs 10,002 nodes.
MAX_NODES: Final = 20_000
# A stage's input (and its compensation's) is copied into every request of its nodes and travels in the
# workflow's input and the TaskCreated event: 32 levels is far more than any request needs and far below
# the ~200 at which pydantic's JSON parser (the worker's decoder) and serialiser give up; 256 KiB per input,
# and 1 MiB for all of them, keep the plan well inside Temporal's 2 MB payload limit.
MAX_INPUT_DEPTH: Final = 32
MAX_INPUT_BYTES: Final = 256 * 1024
MAX_PLAN_INPUT_BYTES: Final = 1024 * 1024
# What admission sets aside for inference not yet paid for (one LLM decision or review call), so a dispatch
# can never consume the money the review of its own output will need.
INFERENCE_RESERVE: Final = Decimal("0.05")
COMPOSE: Final = "compose"
REVIEW: Final = "review"
FRAMEWORK_STAGES: Final = (COMPOSE, REVIEW)
# What the review's compliance check refuses in a node's request input, unless the plan lists its own.
BANNED_TERMS: Final = ("[banned]", "unlicensed")
MAX_PIXELS: Final = 100_000  # per side: anything larger is a typo
MAX_MEDIA_SECONDS: Final = 366 * 86400.0


class PlanError(ValueError):
    """A plan was refused. The message is one line meant for the person who wrote the plan."""


_DURATION_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """A duration in seconds, from a number of seconds or a string such as ``"90s"``, ``"5m"``, ``"2h"``."""
    if isinstance(value, bool):
        raise ValueError("must be a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value)):
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"must be a duration like 30s, 5m or 2h, got {str(value)[:40]!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("must be a positive duration")
    if seconds > 366 * 86400:
        raise ValueError("must be at most a year")
    return seconds


def _check_id(value: Any) -> str:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        shown = str(value)[:40]
        raise ValueError(f"{shown!r} is not a valid id (1-64 characters of A-Z a-z 0-9 _ . -)")
    return value


def _check_format(value: Any) -> str:
    if not isinstance(value, str) or not _FORMAT_RE.fullmatch(value):
        raise ValueError(f"{str(value)[:40]!r} is not a format name (like mp4, png or wav)")
    return value.lower()


def _check_pixels(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PIXELS:
        raise ValueError(f"must be a whole number of pixels from 1 to {MAX_PIXELS}, got {str(value)[:40]!r}")
    return value


def _check_duration_bounds(value: Any) -> tuple[float, float]:
    """``[min, max]`` in seconds: two finite numbers, 0 <= min <= max, max > 0."""
    shape = f"must be [min, max] in seconds, got {str(value)[:40]!r}"
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(shape)
    if any(isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in value):
        raise ValueError(shape)
    low, high = float(value[0]), float(value[1])
    if low < 0:
        raise ValueError(f"minimum must not be negative, got {low:g}")
    if high <= 0 or high > MAX_MEDIA_SECONDS:
        raise ValueError(f"maximum must be above 0 and at most a year, got {high:g}")
    if low > high:
        raise ValueError(f"minimum {low:g} is above the maximum {high:g}")
    return low, high


def _check_term(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 100:
        raise ValueError(f"{str(value)[:40]!r} is not a term (1-100 characters)")
    return value.strip().lower()  # matched case-insensitively


Seconds = Annotated[float, BeforeValidator(parse_duration)]
Ident = Annotated[str, BeforeValidator(_check_id)]
FormatName = Annotated[str, BeforeValidator(_check_format)]
Pixels = Annotated[int, BeforeValidator(_check_pixels)]
DurationBounds = Annotated[tuple[float, float], BeforeValidator(_check_duration_bounds)]
Term = Annotated[str, BeforeValidator(_check_term)]


class TimeoutPolicy(StrEnum):
    """What the loop does when a person does not answer in time."""

    APPROVE = "approve"
    ABORT = "abort"
    ESCALATE = "escalate"


class Value(StrEnum):
    """How much a node matters: hero nodes get two more attempts per round
    (docs/design.md#node-value-and-priority)."""

    HERO = "hero"
    STANDARD = "standard"
    BACKGROUND = "background"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The values of rules.actions.RequestKind (which imports this module, so it cannot be imported here).
RequestKindName = Literal["approval", "dead_letter", "escalation", "invalid_decision"]


class ApprovalPolicy(_Strict):
    """How approval points and other human requests behave."""

    timeout: Seconds = 3600.0
    policy: TimeoutPolicy = TimeoutPolicy.ESCALATE
    # Who may decide (rules.people.allowed_approvers): per request kind if listed there, else ``approvers``;
    # both empty means any approver the workers hold a key for.
    approvers: tuple[Ident, ...] = ()
    approvers_by_kind: dict[RequestKindName, tuple[Ident, ...]] = Field(default_factory=dict)
    # Named backups (docs/design.md#named-backups): a request not answered by its deadline is offered to these
    # approvers for ``backup_timeout`` more seconds (default: ``timeout`` again) before the timeout policy
    # applies.
    backups: tuple[Ident, ...] = ()
    backup_timeout: Seconds | None = None

    @property
    def backup_seconds(self) -> float:
        return self.backup_timeout if self.backup_timeout is not None else self.timeout


class ReviewConfig(_Strict):
    """The framework's review stage: which reviewers judge the composition.

    Phase 1 (``compliance.rules``: rules.checks) always runs: compliance cannot be switched off. Phase 2, the
    model's judgement, runs when ``content.llm`` is listed; a plan without it is reviewed by rules alone.
    """

    reviewers: tuple[Ident, ...] = ("compliance.rules", "content.llm")
    estimate: Amount = Decimal("0.05")
    # Phase 1 (rules.checks): every business artifact must carry rights metadata (license and holder) …
    require_rights: bool = True
    # … and no node's request input may contain one of these terms (case-insensitive).
    banned_terms: tuple[Term, ...] = Field(default=BANNED_TERMS, max_length=200)


class OutputSpec(_Strict):
    """What a stage's artifact must be; the review's ``technical.media`` check holds it to this.

    Empty or None fields are not checked. The bounds hold the media metadata the vendor reports with the
    artifact, so an artifact of a stage with an ``output`` whose vendor reports none is sent back for rework.
    """

    formats: tuple[FormatName, ...] = Field(default=(), max_length=20)  # allowed formats (lower case)
    duration: DurationBounds | None = None  # [min, max] seconds, inclusive
    min_width: Pixels | None = None
    min_height: Pixels | None = None


class Compensation(_Strict):
    """What undoes a stage's output when the task is aborted or fails after the stage succeeded (publish →
    unpublish, upload → delete): one recorded operation per output the vendor made, each with its own INTENT,
    in the task's compensating phase before its end state is final (rules.table, R12).

    Its request is ``input`` plus ``compensates`` (the output's operation key, node, vendor job id and
    sha256). Money: its reservation may take the task's own scope past its ceiling by at most ``overdraw``
    (an undo should not wait on the task's own budget, but never without bound); every scope above the task
    (episode, project) is checked as for any reservation. An undo those cannot afford is not skipped: the task
    asks a person (add budget, then resume) with the undo pending (rules.table R12).
    """

    executor: str = Field(min_length=1, max_length=64)
    input: dict[str, Any] = Field(default_factory=dict)
    estimate: Amount = Decimal(0)
    overdraw: Amount = Decimal(0)
    retries: int = Field(default=2, ge=0, le=20)


class Stage(_Strict):
    """One business stage. With ``fan_out`` it expands into one node per item (e.g. one per shot)."""

    id: Ident
    executor: str = Field(min_length=1, max_length=64)
    estimate: Amount = Decimal(0)
    depends_on: tuple[Ident, ...] = ()
    retries: int = Field(default=2, ge=0, le=20)
    fan_out: StrictInt | tuple[Ident, ...] | None = None
    gate: bool = False
    approval: bool = False
    reviewer: Ident | None = None
    value: Value = Value.STANDARD
    canary: bool = True
    stall_after: Seconds = 600.0  # no progress for this long: the watchdog cancels the job at the vendor
    input: dict[str, Any] = Field(default_factory=dict)
    output: OutputSpec | None = None
    # Data inputs by name: an upstream stage (item to item between fan-outs of one width), or a list of them
    # (every output, in order). None: each direct dependency's output under its id (rules.inputs).
    inputs: dict[Ident, Ident | tuple[Ident, ...]] | None = Field(default=None, max_length=50)
    compensation: Compensation | None = None

    @model_validator(mode="after")
    def _fan_out_bounds(self) -> Stage:
        if isinstance(self.fan_out, int) and not 1 <= self.fan_out <= MAX_FAN_OUT:
            raise ValueError(f"fan_out must be between 1 and {MAX_FAN_OUT}")
        if isinstance(self.fan_out, tuple):
            if not 1 <= len(self.fan_out) <= MAX_FAN_OUT:
                raise ValueError(f"fan_out must list between 1 and {MAX_FAN_OUT} items")
            if len(set(self.fan_out)) != len(self.fan_out):
                raise ValueError("fan_out items must be unique")
        return self

    def items(self) -> tuple[str, ...]:
        """The fan-out item names (``S01``… for a count), or ``()`` for a single-node stage."""
        if self.fan_out is None:
            return ()
        if isinstance(self.fan_out, int):
            width = max(2, len(str(self.fan_out)))
            return tuple(f"S{i:0{width}d}" for i in range(1, self.fan_out + 1))
        return self.fan_out


class ComposeSpec(_Strict):
    """What ``compose`` assembles into the episode: video stages in order, and one audio stage."""

    video: tuple[Ident, ...] = Field(min_length=1, max_length=50)
    audio: Ident | None = None


class PlanQuote(_Strict):
    """The quote ``submit --budget-from-quote`` set the ceiling from (ledgerflow.views.quote): the total and
    each stage's spend at that percentile, and when. Recorded with the plan in TaskCreated (quote --drift)."""

    percentile: Literal["p50", "p95"]
    total: Amount
    stages: dict[Ident, Amount] = Field(default_factory=dict, max_length=MAX_STAGES + 2)
    computed_at: datetime


class Plan(_Strict):
    """A validated plan. Build it with :func:`load_plan` or :func:`validate_plan`, not directly."""

    task_id: Ident | None = None
    goal: str = Field(min_length=1, max_length=2000)
    project: Ident = "default"
    episode: Ident | None = None
    budget_ceiling: Amount
    time_ceiling: Seconds = 24 * 3600.0
    rework_limit: int = Field(default=2, ge=0, le=20)
    gate_threshold: Amount | None = None
    concurrency: int = Field(default=8, ge=1, le=MAX_FAN_OUT)  # per stage: in-flight nodes of one fan-out
    # Above soft_limit × ceiling (spent + reserved), fan-outs widen no further: one node in flight per stage.
    soft_limit: float = Field(default=0.8, gt=0, le=1)
    approval: ApprovalPolicy = ApprovalPolicy()
    review: ReviewConfig = ReviewConfig()
    # None: compose records a manifest of every output. Set: it really assembles the video (media.assemble).
    compose: ComposeSpec | None = None
    # Which earlier outputs an unchanged request may reuse instead of paying again: this task's own ("task"),
    # or any earlier task's of the same project too ("project", opt-in: a resubmitted plan).
    reuse: Literal["task", "project"] = "task"
    # Where this task's dispatches queue on a route that is at its concurrency quota: hero before standard
    # before background, then the earlier deadline (rules.routing.rank; waiting moves a dispatch up).
    priority: Literal["hero", "standard", "background"] = "standard"
    stages: tuple[Stage, ...] = Field(min_length=1)
    quote: PlanQuote | None = None  # set by ``submit --budget-from-quote`` (None: no quote)

    def stage(self, stage_id: str) -> Stage:
        for s in self.all_stages():
            if s.id == stage_id:
                return s
        raise KeyError(stage_id)

    def all_stages(self) -> tuple[Stage, ...]:
        """Business stages followed by the framework's compose and review stages."""
        business_ids = {s.id for s in self.stages}
        depended = {d for s in self.stages for d in s.depends_on}
        sinks = tuple(s.id for s in self.stages if s.id not in depended and s.id in business_ids)
        compose_inputs: dict[str, str | tuple[str, ...]] | None = None
        if self.compose is not None:
            compose_inputs = {"shots": self.compose.video}
            if self.compose.audio is not None:
                compose_inputs["audio"] = self.compose.audio
        compose = Stage(id=COMPOSE, executor=COMPOSE, depends_on=sinks, retries=2, inputs=compose_inputs)
        review = Stage(
            id=REVIEW, executor=REVIEW, depends_on=(COMPOSE,), estimate=self.review.estimate, retries=2
        )
        return (*self.stages, compose, review)


class Routes(_Strict):
    """What this deployment can run: executor names and reviewer names it has a route for."""

    executors: frozenset[str]
    reviewers: frozenset[str]
    # Executors a route of which is paid and declares no price: a stage on one needs an estimate, or nothing
    # would bound what admission reserves for it (rules.pricing).
    unpriced: frozenset[str] = frozenset()


def validate_plan(raw: dict[str, Any], routes: Routes, *, task_id: str | None = None) -> Plan:
    """Validate a plan document against this deployment's routes.

    Raises:
        PlanError: with one line naming the offending stage or field.
    """
    if not isinstance(raw, dict):
        raise PlanError("plan: the document must be a mapping with goal, budget_ceiling and stages")
    if task_id is not None:
        raw = {**raw, "task_id": task_id}
    stages_raw = raw.get("stages")
    if isinstance(stages_raw, list) and len(stages_raw) > MAX_STAGES:
        raise PlanError(f"plan: at most {MAX_STAGES} stages, got {len(stages_raw)}")
    if isinstance(stages_raw, list):
        _check_input_sizes(stages_raw)  # before the model: it would accept any depth and size
    try:
        plan = Plan.model_validate(raw)
    except ValidationError as e:
        raise PlanError(_describe(e, raw)) from None
    _check_nodes(plan)
    _check_graph(plan)
    _check_data(plan)
    _check_typed_refs(plan)
    _check_routes(plan, routes)
    _check_budget(plan)
    return plan


class _AliasRefused(yaml.YAMLError):
    def __init__(self, alias: str, line: int) -> None:
        super().__init__(alias)
        self.alias, self.line = alias, line


class _NoAliasLoader(yaml.SafeLoader):
    """The safe loader without aliases: ``*name`` repeats a node without repeating its text, so a few KB of
    YAML can expand to gigabytes (an alias bomb). A plan never needs one; anchors alone are harmless."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise _AliasRefused(str(event.anchor)[:40], event.start_mark.line + 1)
        return super().compose_node(parent, index)


def load_yaml(text: str, what: str = "plan") -> Any:
    """A YAML (or JSON) document, without aliases; one-line :class:`PlanError` naming ``what`` if refused."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader, without aliases
    except _AliasRefused as e:
        raise PlanError(f"{what}: YAML aliases (*{e.alias}) are not allowed, at line {e.line}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise PlanError(f"{what}: not valid YAML{where}") from None
    except RecursionError:
        raise PlanError(f"{what}: nested too deeply to read") from None


def load_plan(text: str, routes: Routes, *, task_id: str | None = None) -> Plan:
    """Parse a YAML (or JSON) plan and validate it."""
    return validate_plan(load_yaml(text), routes, task_id=task_id)


def _stage_name(stages: list[Any], index: int) -> str:
    sid = stages[index].get("id") if isinstance(stages[index], dict) else None
    return f"stage {sid!r}" if isinstance(sid, str) and _ID_RE.fullmatch(sid) else f"stage #{index + 1}"


def _input_problem(value: Any, budget: int) -> tuple[str | None, int]:
    """What is wrong with one input (too deep, too large) and its serialised size (approximate: JSON with the
    default separators; counted no further than ``budget`` bytes). Iterative and bounded by the caps, so a
    deep, huge or self-referencing value costs at most ``budget`` steps, never a recursion."""
    size = 0
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list | tuple):
            if depth > MAX_INPUT_DEPTH:
                return f"is nested deeper than {MAX_INPUT_DEPTH} levels", size
            size += 2 + 2 * len(item)  # brackets, separators
            if size <= budget:
                if isinstance(item, dict):
                    size += sum(len(json.dumps(str(k))) for k in item)
                    todo.extend((v, depth + 1) for v in item.values())
                else:
                    todo.extend((v, depth + 1) for v in item)
        else:
            size += len(json.dumps(item, default=str))
        if size > budget:
            return None, size
    return None, size


def _check_input_sizes(stages: list[Any]) -> None:
    total = 0
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict):
            continue
        undo = stage.get("compensation")
        for field, value in (("input", stage.get("input")), ("compensation.input", _get(undo, "input"))):
            if value is None:
                continue
            problem, size = _input_problem(value, MAX_INPUT_BYTES)
            if problem is None and size > MAX_INPUT_BYTES:
                problem = f"is larger than {MAX_INPUT_BYTES // 1024} KiB serialised"
            if problem is not None:
                raise PlanError(f"{_stage_name(stages, i)}: {field} {problem}")
            total += size
    if total > MAX_PLAN_INPUT_BYTES:
        raise PlanError(
            f"plan: the stages' inputs are larger than {MAX_PLAN_INPUT_BYTES // 1024 // 1024} MiB together"
        )


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def node_count(plan: Plan) -> int:
    """How many nodes the plan expands into (fan-outs expanded, compose and review included): one per fan-out
    item, else one per stage, as the graph is built."""
    return sum(len(s.items()) or 1 for s in plan.all_stages())


def _check_nodes(plan: Plan) -> None:
    nodes = node_count(plan)
    if nodes > MAX_NODES:
        raise PlanError(
            f"plan: expands to {nodes:,} nodes (fan-outs included); at most {MAX_NODES:,} fit one task"
        )


def _describe(error: ValidationError, raw: dict[str, Any]) -> str:
    first = error.errors()[0]
    loc = list(first["loc"])
    where = "plan"
    if len(loc) >= 2 and loc[0] == "stages" and isinstance(loc[1], int):
        stages = raw.get("stages") or []
        sid = stages[loc[1]].get("id") if loc[1] < len(stages) and isinstance(stages[loc[1]], dict) else None
        where = f"stage {sid!r}" if isinstance(sid, str) and _ID_RE.fullmatch(sid) else f"stage #{loc[1] + 1}"
        loc = loc[2:]
    field = ".".join(str(p) for p in loc if not isinstance(p, int) and p not in ("function-before",))
    msg = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "missing":
        msg = "is required"
    elif first["type"] == "extra_forbidden":
        msg = "is not a known field"
    return f"{where}: {field} {msg}" if field else f"{where}: {msg}"


def _check_graph(plan: Plan) -> None:
    seen: set[str] = set()
    for s in plan.stages:
        if s.id in FRAMEWORK_STAGES:
            raise PlanError(f"stage {s.id!r}: the id is reserved for the framework's own stage")
        if s.id in seen:
            raise PlanError(f"stage {s.id!r}: duplicate stage id")
        seen.add(s.id)
    for s in plan.stages:
        for dep in s.depends_on:
            if dep not in seen:
                raise PlanError(f"stage {s.id!r}: depends on unknown stage {dep!r}")
            if dep == s.id:
                raise PlanError(f"stage {s.id!r}: depends on itself")
    cycle = find_cycle({s.id: s.depends_on for s in plan.stages})
    if cycle:
        raise PlanError(f"stage {cycle[0]!r}: dependency cycle {' -> '.join(cycle)}")


def _check_data(plan: Plan) -> None:
    problem = check_inputs(plan)
    if problem is not None:
        raise PlanError(problem)
    if plan.compose is not None:
        by_id = {s.id: s for s in plan.stages}
        for sid in (*plan.compose.video, *((plan.compose.audio,) if plan.compose.audio else ())):
            if sid not in by_id:
                raise PlanError(f"stage 'compose': assembles unknown stage {sid!r}")
        audio = plan.compose.audio
        if audio is not None and by_id[audio].fan_out is not None:
            raise PlanError(
                f"stage 'compose': audio {audio!r} must be one node, not a fan-out (mix it first)"
            )


def find_cycle(deps: dict[str, tuple[str, ...]]) -> list[str] | None:
    """Return one dependency cycle as a path that starts and ends on the same id, or None."""
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(deps, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = grey
        stack.append(node)
        for dep in deps.get(node, ()):
            if color.get(dep) == grey:
                return [*stack[stack.index(dep) :], dep]
            if color.get(dep) == white and (found := visit(dep)):
                return found
        stack.pop()
        color[node] = black
        return None

    for node in deps:
        if color[node] == white and (found := visit(node)):
            return found
    return None


def budget_scopes(plan: Plan, task_id: str) -> list[tuple[str, Decimal | None]]:
    """The budget accounts a task draws on, outermost first: project ⊃ episode ⊃ task.

    Only the task's own ceiling comes from the plan; project and episode ceilings are set by an operator
    (``ledgerflow budget set``) and are unlimited until then.
    """
    return scopes.chain(plan.project, plan.episode, task_id, plan.budget_ceiling)


def estimated_total(plan: Plan) -> Decimal:
    """The sum of every node's estimate (fan-out multiplies), framework stages included."""
    return sum((s.estimate * max(1, len(s.items())) for s in plan.all_stages()), Decimal(0))


def _check_budget(plan: Plan) -> None:
    total = estimated_total(plan) + INFERENCE_RESERVE
    if plan.budget_ceiling < total:
        raise PlanError(
            f"plan: budget_ceiling {plan.budget_ceiling} is below the plan's estimated total {total} "
            f"(estimates + {INFERENCE_RESERVE} inference reserve): the task could never finish"
        )


def _check_typed_refs(plan: Plan) -> None:
    """Artifact references come only from ``inputs:`` (an upstream stage's registered output). A value in a
    stage's free ``input`` (or its compensation's) shaped like one (``rules.inputs.is_ref``) would travel with
    the node's request as if a worker had stored it, and anything trusting references would read whatever
    file or object it names: refused, in one line naming the first."""
    for stage in plan.stages:
        undo = stage.compensation.input if stage.compensation is not None else None
        for field, value in (("input", stage.input), ("compensation.input", undo)):
            path = next((path for path, _ in ref_paths(value, field)), None) if value else None
            if path is not None:
                raise PlanError(
                    f"stage {stage.id!r}: {path} is an artifact reference (uri and sha256): a stage receives "
                    "artifacts only through inputs: naming an upstream stage"
                )


def _check_routes(plan: Plan, routes: Routes) -> None:
    for s in plan.stages:
        if s.executor not in routes.executors:
            raise PlanError(f"stage {s.id!r}: executor {s.executor!r} has no route")
        if s.estimate == 0 and s.executor in routes.unpriced:
            raise PlanError(
                f"stage {s.id!r}: estimate is 0 and route {s.executor!r} is paid with no declared price: "
                "give the stage an estimate or the route a price"
            )
        undo = s.compensation.executor if s.compensation is not None else None
        if undo is not None and (undo in FRAMEWORK_STAGES or undo not in routes.executors):
            raise PlanError(f"stage {s.id!r}: compensation executor {undo!r} has no route")
        if s.compensation is not None and s.compensation.estimate == 0 and undo in routes.unpriced:
            raise PlanError(
                f"stage {s.id!r}: compensation estimate is 0 and route {undo!r} is paid with no declared "
                "price: give the compensation an estimate or the route a price"
            )
        if s.reviewer is not None and s.reviewer not in routes.reviewers:
            raise PlanError(f"stage {s.id!r}: reviewer {s.reviewer!r} has no mapping")
    for r in plan.review.reviewers:
        if r not in routes.reviewers:
            raise PlanError(f"stage 'review': reviewer {r!r} has no mapping")
