"""LLM calls over an OpenAI-compatible chat API: the open-question decision and the review's judgement.

The API key is read from settings inside the activity; it never appears in an argument, a result, a
heartbeat or an error message. Every call's token usage is priced and lands in the ledger.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

import httpx
from opentelemetry import trace
from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.boundary import cross
from activities.contracts import Activity, ErrorType, LlmDecideInput
from activities.operation import heartbeating
from ledger.errors import StaleEpoch
from ledger.recorder import Recorder
from rules.actions import Action
from rules.events import Decision, to_new
from rules.keys import decision_key
from rules.llm import Proposal, check_llm_action, parse_proposal
from rules.money import MAX_AMOUNT, VendorAmount, priced_amount, usage_problem
from rules.projection import apply, fold
from runtime import telemetry
from runtime.settings import Settings
from vendors.openai import ChatCompletion

MAX_OUTPUT_CHARS = 20000


@dataclass(frozen=True)
class ChatReply:
    content: str
    tokens_in: int
    tokens_out: int
    cost: Decimal
    prompt_hash: str
    model: str
    # What was odd about the vendor's usage figure (with its raw value), if anything; ``unusable``: it could
    # not price the call, and ``cost`` is the bound from the call's bytes (a token is at least one byte).
    anomaly: str | None = None
    unusable: bool = False
    raw: str = ""  # the vendor's figure as given (the priced usage's, or the one that could not price it)

    def amount(self) -> VendorAmount:
        """The call's cost as the operation's settle path takes it (``Operation.settle_cost``): the priced
        usage, or unusable (the operation counts its estimate, flagged with the raw figure)."""
        return VendorAmount(None if self.unusable else self.cost, self.anomaly, self.raw)


class LlmRefused(ApplicationError):
    """The model API refused the call before running it (401/403: the key was refused, e.g. rotated; 408;
    429): nothing was billed. Retried like any outage, never a refusal of the request itself."""

    def __init__(self, status: int) -> None:
        super().__init__(f"LLM answered {status}", type=ErrorType.LLM_UNAVAILABLE)


class ChatClient:
    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        api_key: str,
        model: str,
        price_per_1k: Decimal,
        *,
        timeout: float = 120.0,
    ):
        self._client = client
        self._base = base_url.rstrip("/")
        self._key = api_key
        self.model = model
        self._price = price_per_1k
        # One timeout for the whole call, the one the review's write-ahead marker records (the shared client's
        # own 30 s would cut a slow model off and have it asked, and paid, again).
        self.timeout = timeout

    @classmethod
    def from_settings(cls, http: httpx.AsyncClient, settings: Settings) -> ChatClient:
        """The model this deployment is configured with (its key read here, inside the worker or command)."""
        return cls(
            http,
            settings.resolved_llm_url(),
            settings.llm_api_key.get_secret_value(),
            settings.llm_model,
            Decimal(settings.llm_price_per_1k_tokens),
        )

    async def complete(
        self,
        system: str,
        user: str,
        *,
        schema: dict[str, Any] | None = None,
        schema_name: str = "output",
        request_id: str | None = None,
    ) -> ChatReply:
        """One chat completion that must answer JSON.

        Args:
            schema: a JSON schema the answer should follow (OpenAI ``json_schema`` structured output); by
                default any JSON object. The caller validates the answer either way: a model may ignore it.
            schema_name: the schema's name in the request.
            request_id: sent as ``X-Client-Request-Id`` (the review's OperationKey, the planner Decision's
                key): the id the vendor's billing names the call by, so its bill is matched to the ledger.
        """
        response_format: dict[str, Any] = {"type": "json_object"}
        if schema is not None:
            response_format = {"type": "json_schema", "json_schema": {"name": schema_name, "schema": schema}}
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "response_format": response_format,
            "temperature": 0,
        }
        prompt_hash = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        # A client span in the GenAI semantic conventions' shape (operation, provider, model, usage), with
        # what the call costs as ``ledgerflow.cost``; never the prompt, the answer, the URL or the key.
        genai = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": self.model,
        }
        with telemetry.span(f"chat {self.model}", genai, kind=trace.SpanKind.CLIENT) as s:
            reply = await self._complete(body, prompt_hash, request_id)
            s.set_attributes(
                {
                    "gen_ai.response.model": reply.model,
                    "gen_ai.usage.input_tokens": reply.tokens_in,
                    "gen_ai.usage.output_tokens": reply.tokens_out,
                    "ledgerflow.cost": str(reply.cost),
                }
            )
            return reply

    async def _complete(self, body: dict[str, Any], prompt_hash: str, request_id: str | None) -> ChatReply:
        try:
            r = await self._client.post(
                f"{self._base}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {self._key}"}
                | ({"X-Client-Request-Id": request_id} if request_id else {}),
                timeout=self.timeout,
            )
        except httpx.HTTPError as e:
            raise ApplicationError(
                f"LLM unreachable: {type(e).__name__}", type=ErrorType.LLM_UNAVAILABLE
            ) from None
        if r.status_code in (401, 403, 408, 429):
            raise LlmRefused(r.status_code)
        if r.status_code >= 500:
            # The model may have run (and billed) before the server failed: not a proven refusal.
            raise ApplicationError(f"LLM answered {r.status_code}", type=ErrorType.LLM_UNAVAILABLE)
        if r.status_code >= 400:
            raise ApplicationError(
                f"LLM refused the request ({r.status_code})", type=ErrorType.LLM_REJECTED, non_retryable=True
            )
        try:
            answer = json.loads(r.content)
            # The usage is a vendor figure, judged by the money gate below: an odd one (negative, NaN) must
            # not make a paid answer unreadable (and asked, and paid for, again).
            usage = answer.pop("usage", None) if isinstance(answer, dict) else None
            chat = ChatCompletion.model_validate(answer)
        except (ValueError, RecursionError, ValidationError):  # not JSON, or not a chat completion
            # Answered 2xx, so the model ran and billed: not a refusal, and not to be read by guesswork.
            raise ApplicationError(
                "LLM answer is not a chat completion", type=ErrorType.LLM_UNAVAILABLE
            ) from None
        tokens_in, tokens_out, amount = usage_amount(usage, self._price)
        content = chat.text[:MAX_OUTPUT_CHARS]
        model = chat.model or self.model
        if amount.amount is None:
            # Never less than the call can have cost: every token is at least a byte of the exchange.
            size = len(json.dumps(body).encode()) + len(r.content)
            bound = priced_amount(Decimal(size) * self._price / 1000).amount
            cost = bound if bound is not None else MAX_AMOUNT
            return ChatReply(content, 0, 0, cost, prompt_hash, model, amount.anomaly, True, amount.raw)
        return ChatReply(
            content, tokens_in, tokens_out, amount.amount, prompt_hash, model, amount.anomaly, raw=amount.raw
        )


def usage_amount(usage: Any, price_per_1k: Decimal) -> tuple[int, int, VendorAmount]:
    """A chat answer's ``usage`` (input and output tokens) priced into money, through the money gate.

    No usage is no tokens, as OpenAI's schema defaults it. A count that is not a finite number at least 0
    (negative, NaN, absurd) or a usage that is not an object is unusable: the caller counts the call at its
    estimate (or a bound), flagged with the raw figure — never a smaller charge, never an unreadable answer.
    """
    if usage is None:
        usage = {}
    if not isinstance(usage, dict):
        return 0, 0, VendorAmount(None, f"vendor usage {str(usage)[:60]!r} is unusable", str(usage)[:60])
    counts: list[int] = []
    for what in ("prompt_tokens", "completion_tokens"):
        raw = usage.get(what, 0)
        if (problem := usage_problem(raw, what=what)) is not None:
            return 0, 0, VendorAmount(None, problem, str(raw)[:60])
        counts.append(int(Decimal(str(raw)).to_integral_value(ROUND_CEILING)))  # a fraction counts whole
    tokens_in, tokens_out = counts
    priced = priced_amount(Decimal(tokens_in + tokens_out) * price_per_1k / 1000, what="inference cost")
    return tokens_in, tokens_out, priced


def parse_json_object(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The model's output as a JSON object, or why it is not one (truncated, not JSON, not an object)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None, "output is not valid JSON"
    if not isinstance(value, dict):
        return None, "output is not a JSON object"
    return value, None


DECIDE_SYSTEM = (
    "You are the fallback planner of a production pipeline. No rule matched. Answer with one JSON object "
    '{"action": one of %s, "node": node id for dispatch, "reason": short text}. Nothing else.'
)


def reply_details(reply: ChatReply, **label: str) -> dict[str, Any]:
    """A paid answer as heartbeat details, so a retry of the attempt reuses it instead of paying again."""
    return dataclasses.asdict(reply) | {"cost": str(reply.cost)} | label


def cached_reply(details: Any, **label: str) -> ChatReply | None:
    """The answer a previous attempt already paid for (``reply_details``, with the same ``label``), if any."""
    if not isinstance(details, dict) or any(details.get(k) != v for k, v in label.items()):
        return None
    try:
        fields = {
            f.name: details[f.name]
            for f in dataclasses.fields(ChatReply)
            if f.name in details or f.default is dataclasses.MISSING  # an older attempt's has no anomaly
        }
        return ChatReply(**fields | {"cost": Decimal(str(details["cost"]))})
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return None


class LlmActivities:
    def __init__(self, recorder: Recorder, chat: ChatClient):
        self.recorder = recorder
        self.chat = chat

    @activity.defn(name=Activity.LLM_DECIDE)
    async def decide(self, inp: LlmDecideInput) -> dict[str, Any] | None:
        """Ask the model for one action; record a Decision event; return the syntactically valid proposal.

        The Decision records the action the proposal becomes under the loop's own checks (the same pure
        ``check_llm_action`` on the same fold and time), so the record says what the model's answer was worth;
        the workflow recomputes it and acts on its own result.
        """
        try:
            return await self._decide(inp)
        except Exception as e:
            cross(e)

    async def _decide(self, inp: LlmDecideInput) -> dict[str, Any] | None:
        dedup = decision_key(inp.task_id, inp.watermark)
        current, existing = await asyncio.to_thread(self.recorder.preflight, inp.task_id, dedup)
        if existing is not None:  # a retry after the decision was recorded: never pay for it twice
            return existing.payload.get("proposal")
        async with heartbeating() as beat:
            reply = cached_reply(beat.details)
            if reply is None:
                if inp.epoch is not None and current != inp.epoch:
                    # The fence before a paid call: a zombie of a fenced-off run never pays for a decision.
                    cross(StaleEpoch(inp.task_id, inp.epoch, current or 0))
                question = json.dumps({"task": inp.summary}, sort_keys=True, default=str)
                reply = await self.chat.complete(DECIDE_SYSTEM % inp.allowed, question, request_id=dedup)
                beat.beat(reply_details(reply))  # a retry reuses the answer
        if reply.anomaly:  # the planner has no operation: its spend is the figure, or the call's byte bound
            activity.logger.warning("cost anomaly (inference): %s; counted %s", reply.anomaly, reply.cost)
        raw, problem = parse_json_object(reply.content)
        proposal, problem = parse_proposal(raw) if raw is not None else (None, problem)
        decision = Decision(
            model=reply.model,
            prompt_hash=reply.prompt_hash,
            raw_output=reply.content,
            proposal=proposal.model_dump() if proposal else None,
            valid=proposal is not None,
            error=problem,
            tokens_in=reply.tokens_in,
            tokens_out=reply.tokens_out,
            cost=reply.cost,
        )
        if proposal is not None and inp.decided_at is not None:
            problem, action = await self._admit(inp, decision, proposal, dedup)
            decision = decision.model_copy(
                update={"action": action, "valid": problem is None, "error": problem}
            )
        append = functools.partial(
            self.recorder.append_idempotent, inp.task_id, to_new(decision, dedup_key=dedup), spend=reply.cost
        )
        await asyncio.to_thread(append)  # inference is spent on every budget scope, like vendor work
        return decision.proposal

    async def _admit(
        self, inp: LlmDecideInput, decision: Decision, proposal: Proposal, dedup: str
    ) -> tuple[str | None, Action | None]:
        """The loop's check of ``proposal``: on the fold at the watermark plus this Decision (its inference
        spend counts, as it does in the workflow's projection, which folds the Decision before checking)."""
        assert inp.decided_at is not None
        events = await asyncio.to_thread(self.recorder.read_events, inp.task_id)
        p = fold(e for e in events if e.seq <= inp.watermark)
        # At seq watermark + 1: where the workflow will find it (nothing else is written meanwhile).
        apply(p, to_new(decision, dedup_key=dedup).stored(inp.task_id, inp.watermark + 1, 0, inp.decided_at))
        return check_llm_action(p, proposal.model_dump(), inp.decided_at)
