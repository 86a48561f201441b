"""Route files are an operator's: what yaml.safe_dump writes for them (anchors for repeated values) loads."""

from __future__ import annotations

from pathlib import Path

import yaml

from ledgerflow.runs.drill import drill_setup
from vendors.routes import RouteTable, load_table


def test_the_drills_route_file_with_its_anchors_loads(tmp_path: Path) -> None:
    _, routes = drill_setup("realistic", "idempotent")
    assert routes is not None
    text = yaml.safe_dump(routes)
    assert "&id" in text and "*id" in text  # repeated values written once and referred to
    path = tmp_path / "routes.yaml"
    path.write_text(text)
    table = load_table(path)
    assert set(table.routes) == set(routes["routes"])  # every route the drill declares is there
    assert table == RouteTable.model_validate(routes)  # each as declared, its aliases resolved
