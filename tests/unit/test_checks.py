"""Review phase 1 (rules.checks): each whitelisted check's pass and fail, the short-circuit, the gate; and the
phase-2 Judgement the model's answer must parse as."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rules.checks import (
    GATE,
    PHASE1,
    ArtifactFacts,
    Facts,
    Kind,
    NodeFacts,
    gate,
    output_problems,
    phase1,
)
from rules.events import Media, Verdict
from rules.plan import OutputSpec
from rules.verdicts import Severity, aggregate, parse_judgement

RIGHTS = {"license": "cc-by-4.0", "holder": "studio"}
GOOD_MEDIA = Media(format="mp4", duration_s=30.0, width=1920, height=1080, rights=RIGHTS)
BOUNDS = OutputSpec(formats=("mp4", "webm"), duration=(20.0, 40.0), min_width=1280, min_height=720)


def media(**changes: Any) -> Media:
    return GOOD_MEDIA.model_copy(update=changes)


def artifact(media: Media | None = GOOD_MEDIA, *, actual: str | None = "abc") -> ArtifactFacts:
    return ArtifactFacts(sha256="abc", actual_sha256=actual, media=media)


def node(name: str = "edit", **fields: Any) -> NodeFacts:
    fields.setdefault("input", {"prompt": "a calm lake"})
    fields.setdefault("artifact", artifact())
    return NodeFacts(node=name, **fields)


def facts(*nodes: NodeFacts, **fields: Any) -> Facts:
    return Facts(nodes=nodes or (node(),), **fields)


def by_check(results: list[Any]) -> dict[str, list[tuple[Severity, str, tuple[str, ...]]]]:
    out: dict[str, list[tuple[Severity, str, tuple[str, ...]]]] = {}
    for r in results:
        out.setdefault(r.check, []).append((r.severity, r.message, r.nodes))
    return out


# ── the whitelist ─────────────────────────────────────────────────────────────────────────────────────
def test_phase1_is_exactly_the_whitelisted_checks_compliance_first() -> None:
    assert [c.name for c in PHASE1] == [
        "compliance.rights",
        "compliance.terms",
        "technical.hash",
        "technical.media",
    ]
    kinds = [c.kind for c in PHASE1]
    assert kinds == sorted(kinds, key=[Kind.COMPLIANCE, Kind.TECHNICAL].index)


def test_technical_checks_are_named_technical_and_every_other_check_is_compliance() -> None:
    for c in (*PHASE1, *GATE):
        assert c.name.split(".")[0] in {"compliance", "technical", "gate"}
        assert c.kind == (Kind.TECHNICAL if c.name.startswith("technical.") else Kind.COMPLIANCE)


def test_gate_is_the_compliance_checks_plus_inputs_intact() -> None:
    assert [c.name for c in GATE] == ["compliance.rights", "compliance.terms", "gate.inputs"]


def test_a_clean_production_passes_phase1() -> None:
    assert phase1(facts(node("a"), node("b", output=BOUNDS))) == []


# ── compliance.rights ─────────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("media", "why"),
    [
        (None, "edit has no rights metadata"),
        (media(rights=None), "edit has no rights metadata"),
        (media(rights={}), "edit has no rights metadata"),
        (media(rights={"license": "cc-by-4.0"}), "edit rights metadata lacks holder"),
        (media(rights={"license": " ", "holder": "x"}), "edit rights metadata lacks license"),
    ],
)
def test_an_artifact_without_rights_metadata_blocks(media: Media | None, why: str) -> None:
    assert by_check(phase1(facts(node(artifact=artifact(media))))) == {
        "compliance.rights": [(Severity.BLOCK, why, ("edit",))]
    }


def test_rights_are_not_required_when_the_plan_says_so() -> None:
    assert phase1(facts(node(artifact=artifact(None)), require_rights=False)) == []


def test_a_node_with_no_artifact_is_not_judged_on_rights_but_flagged_by_the_hash_check() -> None:
    results = by_check(phase1(facts(node(artifact=None))))
    assert list(results) == ["technical.hash"]


# ── compliance.terms ──────────────────────────────────────────────────────────────────────────────────
def test_a_banned_term_in_a_node_s_request_blocks_case_insensitively() -> None:
    results = phase1(facts(node("a"), node("b", input={"music": {"track": "UNLICENSED remix"}})))
    assert by_check(results) == {"compliance.terms": [(Severity.BLOCK, "b uses 'unlicensed'", ("b",))]}


def test_the_plan_s_own_banned_terms_replace_the_defaults() -> None:
    inp = {"note": "unlicensed", "logo": "acme"}
    results = phase1(facts(node(input=inp), banned_terms=("acme",)))
    assert [r.message for r in results] == ["edit uses 'acme'"]


# ── technical.hash ────────────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("art", "why"),
    [
        (None, "edit has no artifact"),
        (artifact(actual=None), "edit artifact missing"),
        (artifact(actual="abd"), "edit artifact does not match its registered sha256"),
    ],
)
def test_a_missing_or_altered_artifact_asks_for_rework_of_its_node(
    art: ArtifactFacts | None, why: str
) -> None:
    assert by_check(phase1(facts(node("ok"), node(artifact=art)))) == {
        "technical.hash": [(Severity.REWORK, why, ("edit",))]
    }


# ── technical.media ───────────────────────────────────────────────────────────────────────────────────
def test_media_within_the_stage_s_bounds_passes_inclusive_of_the_limits() -> None:
    edge = media(format="WebM", duration_s=40.0, width=1280, height=720)
    assert phase1(facts(node(output=BOUNDS, artifact=artifact(edge)))) == []


def test_media_outside_the_bounds_asks_for_rework_naming_every_problem() -> None:
    bad = media(format="gif", duration_s=60.0, width=960, height=540)
    results = phase1(facts(node("a", output=BOUNDS), node(output=BOUNDS, artifact=artifact(bad))))
    assert by_check(results) == {
        "technical.media": [
            (
                Severity.REWORK,
                "edit format gif is not one of mp4, webm; duration 60s is outside 20-40s; "
                "width 960 is below 1280; height 540 is below 720",
                ("edit",),
            )
        ]
    }


def test_a_short_duration_is_out_of_bounds_too() -> None:
    results = phase1(
        facts(
            node(
                output=OutputSpec(duration=(20.0, 40.0)),
                artifact=artifact(media(duration_s=5.0)),
            )
        )
    )
    assert [r.message for r in results] == ["edit duration 5s is outside 20-40s"]


def test_a_stage_without_output_bounds_is_not_media_checked() -> None:
    bad = media(format="gif", duration_s=600.0, width=1, height=1)
    assert phase1(facts(node(artifact=artifact(bad)))) == []


def test_a_vendor_claim_that_disagrees_with_the_probed_file_is_a_soft_finding() -> None:
    claimed = media(duration_s=60.0, width=3840, height=2160)
    found = ArtifactFacts(sha256="abc", actual_sha256="abc", media=GOOD_MEDIA, claimed=claimed)
    results = phase1(facts(node(output=BOUNDS, artifact=found)))
    assert by_check(results) == {
        "technical.media": [
            (
                Severity.SOFT,
                "edit: the vendor's claim disagrees with the file (duration 60s claimed, 30s found; "
                "width 3840 claimed, 1920 found; height 2160 claimed, 1080 found)",
                ("edit",),
            )
        ]
    }
    assert aggregate(results)[0] == Verdict.SOFT_WARNING  # the file is within bounds: nothing to redo


def test_bounds_with_no_media_metadata_to_hold_them_to_ask_for_rework() -> None:
    results = phase1(facts(node(output=BOUNDS, artifact=artifact(None)), require_rights=False))
    assert by_check(results) == {
        "technical.media": [
            (Severity.REWORK, "edit has no media metadata to hold to its stage's output bounds", ("edit",))
        ]
    }


def test_a_bounded_value_the_vendor_did_not_report_asks_for_rework() -> None:
    partial = Media(format="mp4", rights=RIGHTS)
    results = phase1(facts(node(output=BOUNDS, artifact=artifact(partial))))
    assert [r.message for r in results] == ["edit duration unknown; width unknown; height unknown"]


# ── the short-circuit ─────────────────────────────────────────────────────────────────────────────────
def test_the_node_check_on_arrival_holds_one_artifact_to_its_stage_s_bounds() -> None:
    assert output_problems(None, None) == [], "a stage without bounds accepts any output"
    assert output_problems(BOUNDS, GOOD_MEDIA) == []
    assert output_problems(BOUNDS, None) == ["has no media metadata to hold to its stage's output bounds"]
    assert output_problems(BOUNDS, media(format="gif", height=480)) == [
        "format gif is not one of mp4, webm",
        "height 480 is below 720",
    ]


def test_a_compliance_block_skips_the_technical_checks() -> None:
    bad = media(format="gif")
    nodes = (
        node("a", input={"note": "[banned] logo"}),
        node("b", artifact=artifact(actual=None)),
        node("c", output=BOUNDS, artifact=artifact(bad)),
    )
    results = phase1(facts(*nodes))
    assert list(by_check(results)) == ["compliance.terms"]
    assert aggregate(results)[0] == Verdict.COMPLIANCE_BLOCK


def test_without_a_block_every_technical_finding_is_reported_and_flags_its_node() -> None:
    bad = media(format="gif")
    results = phase1(
        facts(node("b", artifact=artifact(actual=None)), node("c", output=BOUNDS, artifact=artifact(bad)))
    )
    verdict, flagged, findings = aggregate(results)
    assert verdict == Verdict.QUALITY_REWORK and flagged == ("b", "c")
    assert findings == (
        "technical.hash: b artifact missing",
        "technical.media: c format gif is not one of mp4, webm",
    )


# ── the static gate ───────────────────────────────────────────────────────────────────────────────────
def test_gate_passes_a_clean_node_whose_own_artifact_does_not_exist_yet() -> None:
    assert gate(facts(node("motion", artifact=None), node("storyboard"), gated="motion")) == []


def test_gate_blocks_on_an_input_that_is_not_intact_or_has_no_rights_or_a_banned_term() -> None:
    nodes = (
        node("motion", artifact=None, input={"music": "unlicensed"}),
        node("storyboard", artifact=artifact(actual="zzz")),
        node("refs", artifact=artifact(media(rights=None))),
    )
    results = gate(facts(*nodes, gated="motion"))
    assert {r.severity for r in results} == {Severity.BLOCK}
    assert [f"{r.check}: {r.message}" for r in results] == [
        "compliance.rights: refs has no rights metadata",
        "compliance.terms: motion uses 'unlicensed'",
        "gate.inputs: input storyboard artifact does not match its registered sha256",
    ]  # every gate check is a compliance check: all of them are reported


def test_gate_blocks_on_an_altered_input() -> None:
    results = gate(
        facts(
            node("motion", artifact=None), node("storyboard", artifact=artifact(actual="zzz")), gated="motion"
        )
    )
    assert [(r.check, r.severity, r.message) for r in results] == [
        ("gate.inputs", Severity.BLOCK, "input storyboard artifact does not match its registered sha256")
    ]


# ── phase 2: the judgement ────────────────────────────────────────────────────────────────────────────
def test_a_judgement_parses_ignoring_extra_fields_and_keeps_only_known_blamed_nodes() -> None:
    text = json.dumps(
        {"verdict": "pass", "scores": {"visual": 0.4}, "blame": {"visual": ["shots/S02", "shots/S99"]}}
    )
    judgement, problem = parse_judgement(text)
    assert problem is None and judgement is not None
    assert judgement.scores == {"visual": 0.4} and judgement.reasons == []
    assert judgement.blamed({"shots/S01", "shots/S02"}) == {"visual": ("shots/S02",)}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("not json", "output is not valid JSON"),
        ("[1, 2]", "output is not a JSON object"),
        ('{"scores": {"visual": 1.5}}', "scores.visual: Input should be less than or equal to 1"),
        ('{"scores": {"visual": true}}', "scores.visual: Input should be a valid number"),
        ('{"scores": {"visual": "0.9"}}', "scores.visual: Input should be a valid number"),
        ('{"blame": {"visual": "shots/S02"}}', "blame.visual: Input should be a valid array"),
        (
            json.dumps({"scores": {f"d{i}": 0.5 for i in range(21)}}),
            "scores: Dictionary should have at most 20 items after validation, not more",
        ),
        (
            json.dumps({"scores": {"x" * 41: 0.5}}),
            f"scores.{'x' * 41}.[key]: String should have at most 40 characters",
        ),
    ],
)
def test_an_unusable_judgement_says_why_in_one_short_line(text: str, why: str) -> None:
    judgement, problem = parse_judgement(text)
    assert judgement is None and problem == why
