"""The route table: which executors and reviewers this deployment can run.

A plan naming an executor or reviewer outside this table is refused at submission. Override it with a YAML
file (``LEDGERFLOW_ROUTES_FILE``) holding ``executors: [...]`` and ``reviewers: [...]``.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from rules.plan import Routes

DEFAULT_ROUTES = Routes(
    executors=frozenset(
        {
            "llm.text",
            "llm.code",
            "code.validate",
            "image.asset",
            "image.keyframe",
            "video.motion",
            "qc.check",
            "edit.assembly",
            "audio.tts",
            "audio.mix",
            "graphics.render",
            "subtitle.render",
            "color.grade",
            "release.package",
            "publish.cms",
        }
    ),
    reviewers=frozenset({"compliance.rules", "content.llm", "qc.visual", "pedagogy.llm", "safety.rules"}),
)


def load_routes() -> Routes:
    path = os.environ.get("LEDGERFLOW_ROUTES_FILE")
    if not path:
        return DEFAULT_ROUTES
    data = yaml.safe_load(Path(path).read_text()) or {}
    return Routes(
        executors=frozenset(data.get("executors", [])), reviewers=frozenset(data.get("reviewers", []))
    )
