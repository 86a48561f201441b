"""Refresh the vendor OpenAPI documents (or extracts of them) that tests/vendors/openapi_check.py reads.

Run from the repository root with the vendors' published repositories (see SOURCES.md):

    python tests/vendors/schemas/extract.py --openai PATH --replicate PATH

Each PATH is either a git directory (a clone or a bare mirror of the repository, read with ``git show`` at
``--openai-rev`` / ``--replicate-rev``, HEAD by default: nothing is checked out) or the document itself (YAML
or JSON). Either may be left out; only the given one is rewritten. For a git directory the commit sha and
date used are printed, for SOURCES.md.

* OpenAI: the document is several MB, so only the operations ledgerflow calls are kept, with every component
  they reference, transitively (see ``extract``). Nothing is rewritten: every kept object is copied whole.
* Replicate: the document is copied byte for byte when it is at most ``MAX_WHOLE_BYTES``; past that it is
  extracted the same way as OpenAI's.

Afterwards, update the commit sha and date in SOURCES.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
MAX_WHOLE_BYTES = 300 * 1024

# Where the document lives inside each vendor's repository (see SOURCES.md).
OPENAI_REPO_FILE = "openapi.yaml"  # openai/openai-openapi
REPLICATE_REPO_FILE = "src/libs/Replicate/openapi.json"  # tryAGI/Replicate: api.replicate.com/openapi.json

# (method, path template) of every operation the adapters use.
OPENAI_OPERATIONS: list[tuple[str, str]] = [
    ("post", "/chat/completions"),
    ("post", "/images/generations"),
]
REPLICATE_OPERATIONS: list[tuple[str, str]] = [
    ("post", "/predictions"),
    ("get", "/predictions"),
    ("get", "/predictions/{prediction_id}"),
    ("post", "/predictions/{prediction_id}/cancel"),
    ("post", "/models/{model_owner}/{model_name}/predictions"),
]

# Top-level keys copied unchanged into an extract (tags are filtered to the ones the kept operations use).
TOP_LEVEL_KEYS = ("openapi", "info", "jsonSchemaDialect", "servers", "security")
PATH_ITEM_SHARED_KEYS = ("summary", "description", "servers", "parameters")


class _StringTimestampLoader(yaml.SafeLoader):
    """A SafeLoader that keeps YAML timestamps (``2024-10-01``) as strings, as JSON would have them."""


_StringTimestampLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def read_source(path: Path, repo_file: str, rev: str) -> tuple[bytes, str]:
    """The document's bytes and its file name: from ``repo_file`` at ``rev`` when ``path`` is a git directory.

    A git directory is a bare mirror (it holds ``HEAD`` and ``objects``) or a work tree's ``.git``; a work
    tree itself is read through its ``.git``. The commit used is printed.
    """
    if path.is_dir():
        git_dir = path / ".git" if (path / ".git").exists() else path
        git = ["git", f"--git-dir={git_dir}"]
        commit = subprocess.run(
            [*git, "log", "-1", "--format=%H %cI", rev], check=True, capture_output=True, text=True
        ).stdout.strip()
        data = subprocess.run([*git, "show", f"{rev}:{repo_file}"], check=True, capture_output=True).stdout
        print(f"{git_dir}: {repo_file} at commit {commit}")
        return data, repo_file
    return path.read_bytes(), path.name


def load_document(data: bytes, name: str) -> dict[str, Any]:
    """Parse an OpenAPI document: JSON when ``name`` ends in ``.json``, else YAML (timestamps stay text)."""
    text = data.decode("utf-8")
    doc = json.loads(text) if name.endswith(".json") else yaml.load(text, Loader=_StringTimestampLoader)
    if not isinstance(doc, dict) or "paths" not in doc:
        raise SystemExit(f"{name}: not an OpenAPI document")
    return doc


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _refs(node: Any) -> list[str]:
    """Every ``$ref`` string anywhere under ``node``."""
    found: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                found.append(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _component_of(ref: str) -> tuple[str, str]:
    """``#/components/<section>/<name>[/...]`` -> (section, name); any other reference is refused."""
    if not ref.startswith("#/components/"):
        raise SystemExit(f"unsupported $ref (only #/components/... is handled): {ref}")
    parts = [_unescape(p) for p in ref[len("#/") :].split("/")]
    if len(parts) < 3:
        raise SystemExit(f"unsupported $ref: {ref}")
    return parts[1], parts[2]


def extract(doc: dict[str, Any], operations: list[tuple[str, str]]) -> dict[str, Any]:
    """Keep ``operations`` and the transitive closure of the components they reference, copied unchanged.

    The top-level keys in ``TOP_LEVEL_KEYS`` are kept as they are, ``tags`` only for the tags the kept
    operations name, and ``components.securitySchemes`` only for the schemes a kept ``security`` requirement
    names. A path item keeps its shared keys (``parameters`` ...) and only the listed methods.
    """
    out: dict[str, Any] = {key: doc[key] for key in TOP_LEVEL_KEYS if key in doc}
    paths: dict[str, Any] = {}
    security: list[Any] = list(doc.get("security", []))
    tags: set[str] = set()
    for method, template in operations:
        item = doc["paths"].get(template)
        if item is None or method not in item:
            raise SystemExit(f"{method.upper()} {template} is not in the document")
        kept = paths.setdefault(template, {k: item[k] for k in PATH_ITEM_SHARED_KEYS if k in item})
        kept[method] = item[method]
        security.extend(item[method].get("security", []))
        tags.update(item[method].get("tags", []))
    out["paths"] = paths
    if "tags" in doc and tags:
        out["tags"] = [tag for tag in doc["tags"] if tag.get("name") in tags]

    components: dict[str, Any] = doc.get("components", {})
    wanted: set[tuple[str, str]] = set()
    pending = [_component_of(ref) for ref in _refs(paths)]
    for requirement in security:
        pending.extend(("securitySchemes", name) for name in requirement)
    while pending:
        key = pending.pop()
        if key in wanted:
            continue
        section, name = key
        if name not in components.get(section, {}):
            raise SystemExit(f"dangling reference: #/components/{section}/{name}")
        wanted.add(key)
        pending.extend(_component_of(ref) for ref in _refs(components[section][name]))

    kept_components: dict[str, Any] = {}
    for section, entries in components.items():  # the document's own order, section by section
        chosen = {name: value for name, value in entries.items() if (section, name) in wanted}
        if chosen:
            kept_components[section] = chosen
    out["components"] = kept_components
    return out


def _write_json(doc: dict[str, Any], target: Path) -> None:
    target.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {target} ({target.stat().st_size} bytes)")


def refresh_openai(source: Path, rev: str = "HEAD") -> None:
    """Write openai-openapi.json: the OpenAI operations ledgerflow uses, with their components."""
    data, name = read_source(source, OPENAI_REPO_FILE, rev)
    _write_json(extract(load_document(data, name), OPENAI_OPERATIONS), HERE / "openai-openapi.json")


def refresh_replicate(source: Path, rev: str = "HEAD") -> None:
    """Write replicate-openapi.json: the whole document if it is small enough, else an extract."""
    data, name = read_source(source, REPLICATE_REPO_FILE, rev)
    doc = load_document(data, name)  # refuses a file that is not an OpenAPI document
    target = HERE / "replicate-openapi.json"
    if name.endswith(".json") and len(data) <= MAX_WHOLE_BYTES:
        target.write_bytes(data)
        print(f"copied {name} to {target} unchanged ({len(data)} bytes)")
        return
    _write_json(extract(doc, REPLICATE_OPERATIONS), target)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and refresh the documents given."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--openai", type=Path, help="openai/openai-openapi's git dir, or its openapi.yaml")
    parser.add_argument("--replicate", type=Path, help="tryAGI/Replicate's git dir, or Replicate's JSON")
    parser.add_argument("--openai-rev", default="HEAD", help="commit to read from --openai's git dir")
    parser.add_argument("--replicate-rev", default="HEAD", help="commit to read from --replicate's git dir")
    args = parser.parse_args(argv)
    if args.openai is None and args.replicate is None:
        parser.error("give --openai and/or --replicate")
    if args.openai is not None:
        refresh_openai(args.openai, args.openai_rev)
    if args.replicate is not None:
        refresh_replicate(args.replicate, args.replicate_rev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
