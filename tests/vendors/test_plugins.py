"""Issue 29 §1, adapters are plugins: a distribution made here, on the fly, registers adapters in the entry
point group ``ledgerflow.adapters``; a route names one, the route file loads, and the registry builds it.

The distribution is real metadata (a ``.dist-info`` directory with ``METADATA`` and ``entry_points.txt``, and
its package beside it) on ``sys.path``: exactly what ``importlib.metadata`` reads for an installed wheel. Its
adapter subclasses the ``jobs`` adapter and talks to the vendor simulator over real HTTP; ``ledgerflow routes
--json`` runs as a subprocess against the ledger's Postgres.
"""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from clikit import assert_one_line_error, run

from ledger.recorder import Recorder
from vendors import plugins
from vendors.adapter import ADAPTER_PROTOCOL_VERSION, JobStatus
from vendors.jobs import JobsAdapter
from vendors.registry import Adapters
from vendors.routes import AdapterKind, RouteError, RouteSpec, RouteTable, load_table
from vendors.traced import TracedAdapter

API_KEY = "sk-test-4f1c9e"  # the simulator's key (tests/vendors/conftest.py)
OWN = f"ledgerflow {version('ledgerflow')} (built in)"


@dataclass(frozen=True)
class Site:
    """A directory on ``sys.path`` holding one made-up distribution, ``acme-vendor 1.2``."""

    path: Path
    package: str  # its import name (unique per session: modules are cached by name)


def make_distribution(
    root: Path, name: str, dist_version: str, entry_points: dict[str, str], modules: dict[str, str]
) -> None:
    """``name`` ``dist_version`` as installed into ``root``: its metadata and its modules."""
    info = root / f"{name.replace('-', '_')}-{dist_version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {dist_version}\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{plugins.ADAPTER_GROUP}]\n{lines}")
    for module, source in modules.items():
        path = root / Path(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


ADAPTER = """
    from vendors.jobs import JobsAdapter

    ADAPTER_PROTOCOL_VERSION = 1
    BUILT = []


    class AcmeAdapter(JobsAdapter):
        '''The jobs protocol, as Acme speaks it (here: as the simulator does).'''

        @classmethod
        def build(cls, context):
            BUILT.append(context.route_name)
            return super().build(context)


    def make(context):
        BUILT.append("factory:" + context.route_name)
        base, key = context.require_base_url(), context.api_key()
        return AcmeAdapter(context.route, base, key, client=context.client)
"""
FUTURE = """
    from vendors.jobs import JobsAdapter

    ADAPTER_PROTOCOL_VERSION = "2.0"


    class FutureAdapter(JobsAdapter):
        pass
"""
BROKEN = """
    import acme_dependency_that_is_not_installed  # noqa: F401
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """acme-vendor 1.2 on ``sys.path``: ``acme`` (a class), ``acme-fn`` (a factory function), ``acme-broken``
    (its module cannot be imported), ``acme-future`` (written for another protocol)."""
    root = tmp_path_factory.mktemp("site")
    package = f"acme_vendor_{uuid.uuid4().hex[:8]}"
    make_distribution(
        root,
        "acme-vendor",
        "1.2",
        {
            "acme": f"{package}.adapter:AcmeAdapter",
            "acme-fn": f"{package}.adapter:make",
            "acme-broken": f"{package}.broken:Adapter",
            "acme-future": f"{package}.future:FutureAdapter",
        },
        {
            f"{package}.__init__": "",
            f"{package}.adapter": ADAPTER,
            f"{package}.broken": BROKEN,
            f"{package}.future": FUTURE,
        },
    )
    sys.path.insert(0, str(root))
    plugins.refresh()
    try:
        yield Site(root, package)
    finally:
        sys.path.remove(str(root))
        plugins.refresh()


def route_file(tmp_path: Path, routes: dict[str, Any]) -> Path:
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"routes": routes}))
    return path


def no_store(uri: str) -> Any:
    raise AssertionError("no artifacts here")


async def test_a_route_naming_a_plugin_loads_and_the_registry_builds_its_adapter(
    site: Site, sim: Any, tmp_path: Path
) -> None:
    table = load_table(
        route_file(tmp_path, {"video.acme": {"adapter": "acme"}, "video.fn": {"adapter": "acme-fn"}})
    )
    assert table.routes["video.acme"].adapter == "acme"
    module = sys.modules[
        f"{site.package}.adapter"
    ]  # imported when the file loaded: a broken one is refused there

    async with httpx.AsyncClient() as client:
        adapters = Adapters(
            table, vendor_url=sim.url, credential=lambda name: API_KEY, client=client, store_for=no_store
        )
        adapter = adapters.get("video.acme")
        by_function = adapters.get("video.fn")
        assert isinstance(adapter, TracedAdapter) and type(adapter.inner).__name__ == "AcmeAdapter"
        assert isinstance(adapter.inner, JobsAdapter) and isinstance(by_function.inner, JobsAdapter)  # type: ignore[attr-defined]
        assert module.BUILT == ["video.acme", "factory:video.fn"]

        # Its calls are real: the simulator accepts, runs and delivers the job it submits.
        job = await adapter.submit(
            operation_key=f"plugin-{uuid.uuid4().hex[:12]}",
            executor="image.keyframe",
            request={"format": "png", "width": 64, "height": 64},
            estimate=Decimal("1"),
        )
        while job.status == JobStatus.RUNNING:
            job = await adapter.get(job.id)
        assert job.status == JobStatus.SUCCEEDED
        await adapters.aclose()


def test_an_unknown_adapter_is_one_line_naming_the_route_the_name_and_the_installed_ones(
    site: Site, tmp_path: Path
) -> None:
    path = route_file(tmp_path, {"video.motion": {"adapter": "acme-video"}})
    with pytest.raises(RouteError) as e:
        load_table(path)
    line = str(e.value)
    assert "\n" not in line
    assert line == (
        f"route file {path}: route 'video.motion': adapter 'acme-video' is not an installed adapter "
        "(installed: acme, acme-broken, acme-fn, acme-future, jobs, local, openai, predictions, queue)"
    )


def test_a_broken_plugin_is_one_line_naming_the_entry_point_and_the_error(site: Site, tmp_path: Path) -> None:
    path = route_file(tmp_path, {"video.motion": {"adapter": "acme-broken"}})
    with pytest.raises(RouteError) as e:
        load_table(path)
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"route file {path}: route 'video.motion': adapter 'acme-broken': ")
    assert (
        f"entry point acme-broken = {site.package}.broken:Adapter (acme-vendor 1.2) cannot be imported"
        in line
    )
    assert "ModuleNotFoundError: No module named 'acme_dependency_that_is_not_installed'" in line

    # As an operator meets it: `ledgerflow routes check` exits 2 with that one line, no traceback.
    checked = run(["routes", "check", str(path)], env={"PYTHONPATH": str(site.path)}, cwd=tmp_path)
    assert_one_line_error(
        checked, "route 'video.motion'", "acme-broken", "acme_dependency_that_is_not_installed"
    )


def test_a_plugin_written_for_another_protocol_major_is_refused_in_one_line(
    site: Site, tmp_path: Path
) -> None:
    path = route_file(tmp_path, {"video.motion": {"adapter": "acme-future"}})
    with pytest.raises(RouteError) as e:
        load_table(path)
    line = str(e.value)
    assert "\n" not in line
    assert f"entry point acme-future = {site.package}.future:FutureAdapter (acme-vendor 1.2)" in line
    speaks = f"this ledgerflow speaks adapter protocol {ADAPTER_PROTOCOL_VERSION}"
    assert f"declares ADAPTER_PROTOCOL_VERSION '2.0'; {speaks}" in line


async def test_the_worker_s_adapters_refuse_an_unusable_plugin_before_anything_is_built(site: Site) -> None:
    # A table made in code is not a route file: the worker's Adapters check it all the same.
    table = RouteTable(routes={"video.motion": RouteSpec(adapter="acme-broken")})
    async with httpx.AsyncClient() as client:
        with pytest.raises(
            RouteError, match=r"^route 'video.motion': adapter 'acme-broken': .*cannot be imported"
        ):
            Adapters(
                table, vendor_url=None, credential=lambda name: API_KEY, client=client, store_for=no_store
            )


def test_a_name_two_distributions_claim_is_refused_naming_both(
    site: Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other-site"
    make_distribution(other, "rival-vendor", "0.3", {"jobs": "rival_jobs:RivalAdapter"}, {"rival_jobs": ""})
    monkeypatch.syspath_prepend(str(other))
    path = route_file(tmp_path, {"image.keyframe": {"adapter": "jobs"}})
    with pytest.raises(RouteError) as e:
        load_table(path)
    line = str(e.value)
    assert "\n" not in line and "route 'image.keyframe': adapter 'jobs' is claimed by 2 entry points" in line
    assert (
        "vendors.jobs:JobsAdapter (ledgerflow" in line
        and "rival_jobs:RivalAdapter (rival-vendor 0.3)" in line
    )


def test_built_in_names_stay_usable_as_adapter_kinds() -> None:
    spec = RouteSpec(adapter=AdapterKind.PREDICTIONS)
    assert type(spec.adapter) is str and spec.adapter == AdapterKind.PREDICTIONS == "predictions"
    assert RouteSpec().adapter == AdapterKind.JOBS
    assert {name: plugins.find(name).origin for name in AdapterKind} == {name: OWN for name in AdapterKind}


async def test_ledgerflow_routes_shows_where_each_adapter_comes_from(
    site: Site, recorder: Recorder, pg_url: str, simulator_url: str, tmp_path: Path
) -> None:
    path = route_file(tmp_path, {"video.acme": {"adapter": "acme"}, "image.keyframe": {"adapter": "jobs"}})
    env = {
        "PYTHONPATH": str(site.path),
        "LEDGERFLOW_ROUTES_FILE": str(path),
        "LEDGERFLOW_DATABASE_URL": pg_url,
        "LEDGERFLOW_VENDOR_URL": simulator_url,
        "LEDGERFLOW_STATE_DIR": str(tmp_path / "state"),
    }

    listed = run(["routes", "--json"], env=env, cwd=tmp_path)

    assert listed.returncode == 0, listed.stderr
    rows = {r["route"]: r for r in json.loads(listed.stdout)}
    acme, jobs = rows["video.acme"], rows["image.keyframe"]
    assert (acme["adapter"], acme["adapter_from"], acme["adapter_built_in"]) == (
        "acme",
        "acme-vendor 1.2",
        False,
    )
    assert (acme["adapter_distribution"], acme["adapter_version"]) == ("acme-vendor", "1.2")
    assert acme["adapter_entry_point"] == f"{site.package}.adapter:AcmeAdapter"
    assert (jobs["adapter"], jobs["adapter_from"], jobs["adapter_built_in"]) == ("jobs", OWN, True)

    shown = run(["routes"], env={**env, "COLUMNS": "250"}, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "acme-vendor 1.2" in shown.stdout and OWN in shown.stdout
