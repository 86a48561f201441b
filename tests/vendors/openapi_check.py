"""Check JSON bodies against the vendors' published OpenAPI documents (tests/vendors/schemas/).

The documents are the vendors' own (see schemas/SOURCES.md): Replicate's whole ``openapi.json`` and an
extract of OpenAI's ``openapi.yaml`` holding the operations the adapters use. A test asks, for an operation
named by its method and path template as the document spells them::

    doc = load("replicate")
    assert request_problems(doc, "POST", "/predictions", body) == []
    assert response_problems(doc, "GET", "/predictions/{prediction_id}", 200, answer) == []

Each function returns a list of readable problems (empty when the body conforms), so a failing assertion
shows every difference at once.

How the schemas are read:

* ``$ref`` is resolved inside the document (a schema is validated in place, so ``#/components/...`` works
  at any depth). The document is never modified: validation runs on a prepared copy.
* ``nullable: true`` (OpenAPI 3.0's keyword, which both vendors still use in their 3.1 documents) becomes
  a JSON Schema union with ``null``: ``type`` gains ``"null"`` (and an ``enum`` gains ``None``); a schema
  with no ``type`` (a ``$ref``, ``anyOf`` ...) becomes ``anyOf: [<schema>, {"type": "null"}]``.
* A 3.1 document is checked with JSON Schema draft 2020-12, a 3.0 document with draft 4 (its base).
* ``format`` is an annotation, not asserted (``date-time``, ``uri``, OpenAI's ``unixtime`` ...).
* ``readOnly`` / ``writeOnly`` and ``discriminator`` are not interpreted (neither document relies on them
  for the operations kept here).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs installed (types-jsonschema)
from referencing import Registry
from referencing.jsonschema import DRAFT4, DRAFT202012

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
_DOC_URI = "urn:ledgerflow:openapi-document"
_NOT_SCHEMA_VALUES = frozenset({"example", "examples", "default", "enum", "const"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_MAX_MESSAGE = 400

Document = dict[str, Any]


@functools.cache
def load(name: str) -> Document:
    """Load ``schemas/<name>-openapi.json`` (or ``schemas/<name>`` when it ends in ``.json``), cached.

    The same object is returned on every call: treat it as read-only.
    """
    file_name = name if name.endswith(".json") else f"{name}-openapi.json"
    doc = json.loads((SCHEMA_DIR / file_name).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or "paths" not in doc:
        raise ValueError(f"{file_name} is not an OpenAPI document")
    return doc


def _pointer(*tokens: str) -> str:
    """A JSON pointer fragment (``#/a/b``) from raw tokens, escaping ``~`` and ``/``."""
    return "#/" + "/".join(t.replace("~", "~0").replace("/", "~1") for t in tokens)


def _resolve(doc: Mapping[str, Any], node: Any) -> Any:
    """Follow ``$ref`` (local, ``#/...``) until ``node`` is not a reference object."""
    seen: set[str] = set()
    while isinstance(node, Mapping) and isinstance(node.get("$ref"), str):
        ref: str = node["$ref"]
        if not ref.startswith("#/") or ref in seen:
            raise ValueError(f"cannot resolve $ref {ref!r}")
        seen.add(ref)
        target: Any = doc
        for token in ref[2:].split("/"):
            target = target[token.replace("~1", "/").replace("~0", "~")]
        node = target
    return node


def operation(doc: Mapping[str, Any], method: str, path_template: str) -> dict[str, Any]:
    """The operation object for ``method`` and ``path_template`` (as the document spells the path)."""
    item = doc["paths"].get(path_template)
    if item is None:
        raise KeyError(f"{path_template} is not a path of the document (paths: {sorted(doc['paths'])})")
    op = item.get(method.lower())
    if op is None:
        methods = sorted(k.upper() for k in item if k in {"get", "put", "post", "delete", "patch"})
        raise KeyError(f"{method.upper()} {path_template} is not in the document (methods: {methods})")
    return dict(op)


def _unescape(ref: str) -> tuple[str, ...]:
    """The raw tokens of a local reference (``#/a/b~1c`` -> ``("a", "b/c")``)."""
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/"))


def _parameter_entries(
    doc: Mapping[str, Any], method: str, path_template: str
) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """(parameter, where it is in the document) for the operation, path-level ones included, resolved."""
    item = doc["paths"][path_template]
    operation(doc, method, path_template)  # a clear error for an unknown operation
    places = {
        ("paths", path_template, "parameters"): item.get("parameters", []),
        ("paths", path_template, method.lower(), "parameters"): item[method.lower()].get("parameters", []),
    }
    merged: dict[tuple[str, str], tuple[dict[str, Any], tuple[str, ...]]] = {}
    for place, raw_list in places.items():
        for index, raw in enumerate(raw_list):
            where = _unescape(raw["$ref"]) if "$ref" in raw else (*place, str(index))
            param = _resolve(doc, raw)
            merged[(param["in"], param["name"].lower())] = (dict(param), where)  # the operation's win
    return list(merged.values())


def parameters(doc: Mapping[str, Any], method: str, path_template: str) -> list[dict[str, Any]]:
    """The operation's parameters, path-level ones included (an operation's own override them), resolved."""
    return [param for param, _ in _parameter_entries(doc, method, path_template)]


def _nullable_to_union(node: Any, in_schema: bool = True) -> Any:
    """A copy of ``node`` with every schema's ``nullable: true`` turned into a JSON Schema union with null.

    ``in_schema`` is false for a mapping of names to schemas (``properties`` ...), whose keys are not
    keywords: a property named ``nullable`` stays a property.
    """
    if isinstance(node, list):
        return [_nullable_to_union(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: (
            value
            if in_schema and key in _NOT_SCHEMA_VALUES
            else _nullable_to_union(value, not (in_schema and key in _SCHEMA_MAPS))
        )
        for key, value in node.items()
    }
    if not in_schema or out.get("nullable") is not True:
        return out
    del out["nullable"]
    if "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"] if "null" not in types else types
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        return out
    return {"anyOf": [out, {"type": "null"}]}


class _Prepared:
    """A document made ready for validation: nullable rewritten, registered under one URI."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.source = doc  # held so that id(doc) stays this document's while it is cached
        self.is_31 = str(doc.get("openapi", "3.0")).startswith("3.1")
        self.contents: dict[str, Any] = _nullable_to_union(copy.deepcopy(dict(doc)))
        spec = DRAFT202012 if self.is_31 else DRAFT4
        self.registry: Registry[Any] = Registry().with_resource(_DOC_URI, spec.create_resource(self.contents))
        self.validator_class: Any = (
            jsonschema.Draft202012Validator if self.is_31 else jsonschema.Draft4Validator
        )

    def problems(self, pointer: str, instance: Any) -> list[str]:
        """Validate ``instance`` against the schema at ``pointer`` (a ``#/...`` fragment of the document)."""
        validator = self.validator_class({"$ref": _DOC_URI + pointer}, registry=self.registry)
        found = []
        for error in sorted(validator.iter_errors(instance), key=lambda e: str(e.json_path)):
            message = error.message
            if len(message) > _MAX_MESSAGE:
                message = message[:_MAX_MESSAGE] + "…"
            found.append(f"{error.json_path}: {message}")
        return found


_PREPARED: dict[int, _Prepared] = {}


def _prepared(doc: Mapping[str, Any]) -> _Prepared:
    entry = _PREPARED.get(id(doc))
    if entry is None or entry.source is not doc:
        entry = _PREPARED[id(doc)] = _Prepared(doc)
    return entry


def _media_schema_pointer(
    content: Mapping[str, Any], base: tuple[str, ...], content_type: str, what: str
) -> str:
    """The pointer to the schema of ``content_type`` in the ``content`` found at ``base``."""
    if content_type not in content:
        raise KeyError(f"{what} has no {content_type} body (content types: {sorted(content)})")
    if "schema" not in content[content_type]:
        raise KeyError(f"{what} declares {content_type} without a schema")
    return _pointer(*base, "content", content_type, "schema")


def request_problems(
    doc: Mapping[str, Any],
    method: str,
    path_template: str,
    body: Any,
    content_type: str = "application/json",
) -> list[str]:
    """Problems of ``body`` (parsed JSON) as the request body of the operation; [] when it conforms.

    A missing body (``None``) is a problem only when the operation marks its body ``required``.
    """
    op = operation(doc, method, path_template)
    what = f"{method.upper()} {path_template}"
    if "requestBody" not in op:
        return [] if body is None else [f"{what} takes no request body"]
    request_body = _resolve(doc, op["requestBody"])
    if body is None:
        return [f"{what} requires a request body"] if request_body.get("required") else []
    raw = op["requestBody"]
    if isinstance(raw, Mapping) and "$ref" in raw:  # a shared requestBody: validate at its own place
        base = _unescape(raw["$ref"])
    else:
        base = ("paths", path_template, method.lower(), "requestBody")
    pointer = _media_schema_pointer(request_body.get("content", {}), base, content_type, what)
    return _prepared(doc).problems(pointer, body)


def _response_key(responses: Mapping[str, Any], status: int) -> str | None:
    for key in (str(status), f"{str(status)[0]}XX", f"{str(status)[0]}xx", "default"):
        if key in responses:
            return key
    return None


def response_problems(
    doc: Mapping[str, Any],
    method: str,
    path_template: str,
    status: int,
    body: Any,
    content_type: str = "application/json",
) -> list[str]:
    """Problems of ``body`` (parsed JSON) as the operation's response with ``status``; [] when it conforms.

    A status the operation does not declare (nor a ``2XX`` range or ``default`` covering it) is a problem
    in itself: Replicate, for instance, answers a created prediction with 201 or 202, never 200.
    """
    op = operation(doc, method, path_template)
    what = f"{method.upper()} {path_template}"
    responses = op.get("responses", {})
    key = _response_key(responses, status)
    if key is None:
        return [f"{what} declares no response {status} (declared: {sorted(responses)})"]
    raw = responses[key]
    response = _resolve(doc, raw)
    content = response.get("content", {})
    if not content:
        return [] if body is None else [f"{what} response {key} declares no body"]
    if isinstance(raw, Mapping) and "$ref" in raw:
        base = _unescape(raw["$ref"])
    else:
        base = ("paths", path_template, method.lower(), "responses", key)
    pointer = _media_schema_pointer(content, base, content_type, f"{what} response {key}")
    return _prepared(doc).problems(pointer, body)


def schema_problems(doc: Mapping[str, Any], component: str, body: Any) -> list[str]:
    """Problems of ``body`` against ``components.schemas[component]`` (e.g. a webhook's payload)."""
    if component not in doc.get("components", {}).get("schemas", {}):
        raise KeyError(f"no schema {component!r} in the document")
    return _prepared(doc).problems(_pointer("components", "schemas", component), body)


def parameter_problems(
    doc: Mapping[str, Any], method: str, path_template: str, location: str, values: Mapping[str, Any]
) -> list[str]:
    """Problems of ``values`` (name -> value) as the operation's parameters ``in`` ``location``.

    ``location`` is ``header``, ``query``, ``path`` or ``cookie``. Header names compare case-insensitively.
    Required parameters that are missing are problems; names the operation does not declare are not (a
    request carries ``Authorization``, ``Content-Type`` ... which no operation lists). Values are checked
    as given (pass a header's or a query's string).
    """
    fold = location == "header"
    given = {(k.lower() if fold else k): v for k, v in values.items()}
    found: list[str] = []
    for param, where in _parameter_entries(doc, method, path_template):
        if param["in"] != location:
            continue
        name = param["name"].lower() if fold else param["name"]
        if name not in given:
            if param.get("required"):
                found.append(f"{location} {param['name']!r} is required")
            continue
        if "schema" in param:
            problems = _prepared(doc).problems(_pointer(*where, "schema"), given[name])
            found.extend(f"{location} {param['name']!r}: {problem.split(': ', 1)[1]}" for problem in problems)
    return found
