"""The ``openai`` adapter: OpenAI-compatible chat completions and image generation, synchronous.

    POST /v1/chat/completions     {model, messages}                      → {id, choices, usage}
    POST /v1/images/generations   {model, prompt, size, response_format} → {data: [{b64_json} | {url}]}

A call is the whole job: ``submit`` returns it finished, its output inline (or at a URL), so there is no job
to poll, look up or cancel and no late creation. Nothing is idempotent (mode ``none``): a call whose answer
was lost is an unknown outcome for a person. The OperationKey travels as ``X-Client-Request-Id`` so the
vendor's records can be matched to operations. Cost: the route's price of the usage (input and output tokens,
per call for images). Responses are validated; nothing is read with an unguarded ``r.json()[...]``.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, Field

from vendors.adapter import Capabilities, JobStatus, ResultFile, VendorCharge, VendorJob
from vendors.errors import VendorBadResponse, VendorCannotTell, VendorNotFound
from vendors.httpbase import HttpVendor


class _Message(BaseModel):
    content: str | None = None


class _Choice(BaseModel):
    message: _Message


class _Usage(BaseModel):
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)


class ChatCompletion(BaseModel):
    """A chat completion's answer, validated (also read by the review's and the planner's chat client)."""

    id: str
    model: str | None = None
    choices: list[_Choice] = Field(min_length=1)
    usage: _Usage = Field(default_factory=_Usage)

    @property
    def text(self) -> str:
        return self.choices[0].message.content or ""


class _Image(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class _Images(BaseModel):
    created: int = 0
    data: list[_Image] = Field(min_length=1)


def _is_image(executor: str) -> bool:
    return executor.startswith("image.")


class OpenAIAdapter(HttpVendor):
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(can_lookup=False, can_cancel=False, synchronous=True, has_billing=False)

    async def submit(
        self,
        *,
        operation_key: str,
        executor: str,
        request: dict[str, Any],
        estimate: Decimal,
        files: dict[str, str] | None = None,
    ) -> VendorJob:
        headers = {"X-Client-Request-Id": operation_key}
        model = self.route.model or ("gpt-image-1" if _is_image(executor) else "gpt-4o-mini")
        if _is_image(executor):
            size = f"{request.get('width', 512)}x{request.get('height', 512)}"
            prompt = str(request.get("prompt") or request.get("shot") or json.dumps(request, sort_keys=True))
            body = {
                "model": model,
                "prompt": prompt[:4000],
                "size": size,
                "n": 1,
                "response_format": "b64_json",
            }
            response = await self.request("POST", "/v1/images/generations", json=body, headers=headers)
            images: _Images = self.parse(_Images, response)
            first = images.data[0]
            job_id = f"img-{operation_key}"
            if first.b64_json is not None:
                try:
                    data = base64.b64decode(first.b64_json, validate=True)
                except (binascii.Error, ValueError) as e:
                    raise VendorBadResponse("image data is not valid base64") from e
                return VendorJob(id=job_id, status=JobStatus.SUCCEEDED, progress=1.0, inline=data)
            if first.url is not None:
                return VendorJob(
                    id=job_id, status=JobStatus.SUCCEEDED, progress=1.0, result=ResultFile(url=first.url)
                )
            raise VendorBadResponse("image answer has neither b64_json nor url")
        messages = [
            {"role": "system", "content": f"You are the {executor} step of a production pipeline."},
            {"role": "user", "content": json.dumps(request, sort_keys=True)},
        ]
        response = await self.request(
            "POST", "/v1/chat/completions", json={"model": model, "messages": messages}, headers=headers
        )
        chat: ChatCompletion = self.parse(ChatCompletion, response)
        text = chat.text
        return VendorJob(
            id=chat.id,
            status=JobStatus.SUCCEEDED,
            progress=1.0,
            tokens_in=chat.usage.prompt_tokens,
            tokens_out=chat.usage.completion_tokens,
            inline=text.encode(),
        )

    async def get(self, job_id: str) -> VendorJob:
        raise VendorNotFound(f"{job_id}: a synchronous API keeps no jobs to look at")

    async def find_by_key(self, operation_key: str, *, since: datetime | None = None) -> list[VendorJob]:
        raise VendorCannotTell("a synchronous API cannot look calls up")

    async def cancel(self, job_id: str) -> VendorJob:
        raise VendorNotFound(f"{job_id}: a synchronous call cannot be cancelled")

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        return None

    async def charges(self, since: datetime) -> list[VendorCharge]:
        # OpenAI's usage and costs APIs report totals per time bucket, model and project, never per call:
        # nothing there names a request, so no charge can be matched to an operation.
        raise VendorCannotTell("the usage API reports totals per time bucket, not charges per call")
