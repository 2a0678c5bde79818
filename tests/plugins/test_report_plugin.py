"""The mass-ops Airflow plugin: found through its entry point, its reports app (auth, names, 404s) over a local
artifact folder, and the 'Cycle report' link of the report operator."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote, urljoin

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from mass_ops.cli import app as cli_app
from mass_ops.evaluation.report import Block, render_html
from mass_ops.layout import report_prefix
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import ArtifactStore

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))  # the app serves bytes; they need not decode as an image
CYCLE = "demo-L0"


def test_airflow_finds_the_plugin_through_its_entry_point():
    from airflow import plugins_manager
    from mass_ops_airflow.operators.report import ReportLink
    from mass_ops_airflow.plugin import MassOpsPlugin

    (info,) = [p for p in plugins_manager.get_plugin_info() if p["name"] == "mass_ops"]
    source = str(info["source"])  # an entry point of the installed package, not a file in the plugins folder
    assert source.startswith("mass-ops-airflow==") and "mass_ops_airflow.plugin:MassOpsPlugin" in source
    assert not [k for k in plugins_manager.get_import_errors() if "mass_ops" in k]
    apps, _ = plugins_manager.get_fastapi_plugins()
    (entry,) = [a for a in apps if a["name"] == "mass-ops reports"]
    assert entry["url_prefix"] == "/mass-ops" and isinstance(entry["app"], FastAPI)
    assert any(isinstance(link, ReportLink) for link in plugins_manager.get_operator_extra_links())
    assert MassOpsPlugin.name == "mass_ops"


def test_the_api_server_mounts_the_app_and_it_refuses_anonymous_callers():
    """Airflow's own mounting (`init_plugins`) puts the app under /mass-ops; no credential → 401."""
    from airflow.api_fastapi.app import init_plugins

    root = FastAPI()
    init_plugins(root)
    client = TestClient(root)
    for path in (
        f"/mass-ops/reports/{CYCLE}/",
        f"/mass-ops/reports/{CYCLE}",
        f"/mass-ops/reports/{CYCLE}/figures/x.png",
    ):
        response = client.get(path, follow_redirects=False)
        assert response.status_code == 401, path
    assert client.get("/mass-ops/openapi.json").status_code == 404, "no unauthenticated schema page"
    assert client.get("/mass-ops/docs").status_code == 404


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return open_artifact_store(str(tmp_path / "artifacts"))


def client_for(open_store: Callable[[], ArtifactStore], *, raise_server_exceptions: bool = True) -> TestClient:
    """The reports app over the store `open_store` opens, mounted as the API server mounts it, with a signed-in user
    (`raise_server_exceptions=False`: a crash is the 500 a caller would see)."""
    from airflow.api_fastapi.core_api.security import get_user
    from mass_ops_airflow.report_app import create_app

    app = create_app(open_store)
    app.dependency_overrides[get_user] = lambda: SimpleNamespace(username="reader")
    root = FastAPI()
    root.mount("/mass-ops", app)
    return TestClient(root, raise_server_exceptions=raise_server_exceptions)


def publish_report(store: ArtifactStore, cycle: str) -> bytes:
    """A report as `write_report` lays it out: the page (rendered by the report module) and its figure file."""
    page = render_html(
        [Block("title", f"MASS cycle report: {cycle}"), Block("figure", "loss_curves")], {"loss_curves": PNG}
    )
    store.put_bytes(f"{report_prefix(cycle)}/figures/loss_curves.png", PNG)
    store.put_bytes(f"{report_prefix(cycle)}/report.html", page.encode())
    return page.encode()


def test_the_page_and_its_figures_are_served_from_the_store(store):
    page = publish_report(store, CYCLE)
    client = client_for(lambda: store)

    redirect = client.get(f"/mass-ops/reports/{CYCLE}", follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"] == f"{CYCLE}/"
    response = client.get(f"/mass-ops/reports/{CYCLE}")  # the link target without the slash lands on the page
    assert response.status_code == 200 and response.content == page
    assert response.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in response.headers["content-security-policy"]

    # The page's figure link, resolved against the page's URL the way a browser does, reaches the PNG.
    (target,) = re.findall(r'<a href="([^"]+)"><img src="data:image/png', response.text)
    figure = client.get(urljoin(str(response.url), target))
    assert figure.status_code == 200 and figure.content == PNG
    assert figure.headers["content-type"] == "image/png"
    assert str(figure.url).endswith(f"/mass-ops/reports/{CYCLE}/figures/loss_curves.png")


def test_a_missing_report_or_figure_is_a_404_with_one_line(store):
    publish_report(store, CYCLE)
    client = client_for(lambda: store)
    for path, words in (
        ("/mass-ops/reports/other-L1/", "cycle other-L1 has no report yet"),
        (f"/mass-ops/reports/{CYCLE}/figures/judge_agreement.png", "no report figure judge_agreement.png"),
    ):
        response = client.get(path)
        assert response.status_code == 404, path
        assert words in response.text and response.text.count("\n") == 1


@pytest.mark.parametrize(
    "path",
    [
        "/mass-ops/reports/%2e%2e/",
        "/mass-ops/reports/.hidden/",
        "/mass-ops/reports/%2e%2e",
        "/mass-ops/reports/a%20b/",
        "/mass-ops/reports/" + "x" * 64 + "/",
        f"/mass-ops/reports/{CYCLE}/figures/%2e%2e.png",
        f"/mass-ops/reports/{CYCLE}/figures/.secret.png",
    ],
)
def test_names_outside_the_rule_are_refused_before_the_store_is_read(tmp_path, path):
    opened = []
    client = client_for(lambda: opened.append(1) or open_artifact_store(str(tmp_path)))
    response = client.get(path, follow_redirects=False)
    assert response.status_code == 400, (path, response.text)
    assert response.text.count("\n") == 1 and ("cycle" in response.text or "figure" in response.text)
    assert opened == [], "a refused name never reaches the store"


def test_the_name_rules_are_whole_string_rules():
    from mass_ops_airflow.reports import ReportNameError, check_cycle, check_figure, report_path

    assert report_path("nightly-0123456789") == "/mass-ops/reports/nightly-0123456789/"
    for name in ("demo-L0\n", "..", "a/b", "", "x" * 64, "-lead"):
        with pytest.raises(ReportNameError, match="a cycle name is 1-63"):
            check_cycle(name)
    for name in ("loss_curves\n", "..", "a.b", "a/b"):
        with pytest.raises(ReportNameError, match="a figure name is"):
            check_figure(name)


def test_traversal_never_reaches_files_outside_the_report(tmp_path, store):
    publish_report(store, CYCLE)
    store.put_bytes(f"cycles/{CYCLE}/calls/secret.json", b'{"secret": 1}')
    (tmp_path / "outside.html").write_text("outside the store")
    client = client_for(lambda: store)
    for path in (
        f"/mass-ops/reports/{CYCLE}/..%2Fcalls%2Fsecret.json",
        f"/mass-ops/reports/{CYCLE}%2F..%2Fcalls/",
        "/mass-ops/reports/..%2F..%2Foutside.html",
        f"/mass-ops/reports/{CYCLE}/figures/..%2F..%2Fcalls%2Fsecret.png",
        f"/mass-ops/reports/{CYCLE}/figures/%2e%2e%2f%2e%2e%2fcalls%2fsecret.png",
    ):
        response = client.get(path, follow_redirects=False)
        assert response.status_code in (400, 404), (path, response.status_code)
        assert b"secret" not in response.content and b"outside the store" not in response.content, path


def test_an_unreachable_store_is_a_503_with_one_line_and_is_retried(tmp_path, store):
    publish_report(store, CYCLE)
    attempts = []

    def flaky() -> ArtifactStore:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("endpoint refused the connection\nsecond line")
        return store

    client = client_for(flaky)
    first = client.get(f"/mass-ops/reports/{CYCLE}/")
    assert first.status_code == 503 and first.text == (
        "the artifact store cannot be opened: endpoint refused the connection\n"
    )
    assert client.get(f"/mass-ops/reports/{CYCLE}/").status_code == 200
    assert client.get(f"/mass-ops/reports/{CYCLE}/").status_code == 200 and len(attempts) == 2, "opened once"


def test_the_deployment_store_is_the_connection_s_else_the_environment_s(monkeypatch, tmp_path):
    from mass_ops_airflow.report_app import deployment_store

    monkeypatch.delenv("AIRFLOW_CONN_MASS_ARTIFACTS", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_MASS_METADATA", raising=False)
    monkeypatch.setenv("MASS_ARTIFACT_URL", str(tmp_path / "from-env"))
    assert deployment_store().url == (tmp_path / "from-env").as_uri()

    connection = {
        "conn_type": "aws",
        "login": "AKIAEXAMPLE",
        "password": "not-a-real-secret",
        "extra": {"artifact_url": "s3://mass-artifacts/prod", "region_name": "eu-west-1"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_MASS_ARTIFACTS", json.dumps(connection))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    s3 = deployment_store()
    assert s3.url == "s3://mass-artifacts/prod"
    assert "AWS_ACCESS_KEY_ID" not in os.environ, "the credentials were exported only while the store opened"


# -- the link -----------------------------------------------------------------------------------------------------


def ti_key(**changes):
    fields = {"dag_id": "mass_cycle", "task_id": "report", "run_id": "manual__1", "try_number": 1, "map_index": -1}
    return SimpleNamespace(**{**fields, **changes})


@pytest.fixture
def xcom(monkeypatch):
    """Return values by (dag, task, run) that the link reads as the worker's XCom client would."""
    from airflow.sdk.execution_time import xcom as xcom_module

    values: dict[tuple[str, str, str], object] = {}

    def get_value(*, ti_key, key):
        assert key == "return_value"
        return values.get((ti_key.dag_id, ti_key.task_id, ti_key.run_id))

    monkeypatch.setattr(xcom_module.XCom, "get_value", staticmethod(get_value))
    return values


def test_the_link_points_at_the_reported_cycle(xcom, monkeypatch):
    from mass_ops_airflow.operators.report import ReportLink, ReportOperator

    operator = ReportOperator(task_id="report", stage="report")
    assert [link.name for link in operator.operator_extra_links] == ["Cycle report"]
    link = ReportLink()
    xcom[("mass_cycle", "report", "manual__1")] = {"cycle": CYCLE, "html": "file:///x/report.html"}
    assert link.get_link(operator, ti_key=ti_key()) == f"/mass-ops/reports/{CYCLE}/"
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.org/ops")
    assert link.get_link(operator, ti_key=ti_key()) == f"https://airflow.example.org/ops/mass-ops/reports/{CYCLE}/"
    # No return value (the task failed before writing), or a name the app would refuse: no link.
    assert link.get_link(operator, ti_key=ti_key(run_id="manual__2")) == ""
    xcom[("mass_cycle", "report", "manual__3")] = {"cycle": "../etc"}
    assert link.get_link(operator, ti_key=ti_key(run_id="manual__3")) == ""


def test_the_operator_returns_the_stage_uris_and_the_reported_cycle(stages):
    from mass_ops_airflow.cycle import cycle_config
    from mass_ops_airflow.operators.report import ReportOperator

    from tests.support.airflow import task_context

    params = {"preset": "demo"}
    stages.results["report"] = {"markdown": "file:///r/report.md", "html": "file:///r/report.html", "figures": 7}
    stages.results["nightly_report"] = {"cycle": "nightly-0123456789", "html": "file:///n/report.html", "figures": 7}
    own = ReportOperator(task_id="report").execute(task_context(params))
    assert own == {**stages.results["report"], "cycle": cycle_config(params).cycle_name}, "the run's own cycle"
    nightly = ReportOperator(task_id="nightly_report", stage="nightly_report").execute(task_context(params))
    assert nightly["cycle"] == "nightly-0123456789" and nightly["html"] == "file:///n/report.html"
    assert stages.names() == ["report", "nightly_report"]


def test_the_operator_refuses_a_stage_result_that_is_not_the_report_s(stages):
    from mass_ops_airflow.cycle import StageResultError
    from mass_ops_airflow.operators.report import ReportOperator

    from tests.support.airflow import task_context

    stages.results["report"] = ["not", "a", "mapping"]
    with pytest.raises(StageResultError, match="stage report returned list"):
        ReportOperator(task_id="report").execute(task_context({"preset": "demo"}))


def test_the_plugin_module_does_not_build_the_app_until_asked():
    """Workers load plugins too: importing the plugin must not import FastAPI's app or Airflow's API security."""
    import subprocess
    import sys

    probe = (
        "import sys, mass_ops_airflow.plugin; "
        "print(int('mass_ops_airflow.report_app' in sys.modules), "
        "int('airflow.api_fastapi.core_api.security' in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    assert result.stdout.split() == ["0", "0"]


API_SERVER_PROBE = """
import json
from airflow.utils.db import initdb
from fastapi.testclient import TestClient

initdb()
from airflow.api_fastapi.app import create_app

client = TestClient(create_app())
token = client.post("/auth/token", json={"username": "reader", "password": "pw"}).json()["access_token"]
page = "/mass-ops/reports/demo-L0/"
seen = {
    "anonymous": client.get(page).status_code,
    "bearer": client.get(page, headers={"Authorization": f"Bearer {token}"}).text,
    "invalid token": client.get(page, headers={"Authorization": "Bearer not-a-jwt"}).status_code,
}
client.cookies.set("_token", token)  # what the UI's session carries when the link is clicked
seen["session, no slash"] = client.get("/mass-ops/reports/demo-L0").text
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_real_api_server_serves_a_report_only_to_signed_in_users(tmp_path):
    """Airflow's whole API server app (its plugin loading, auth manager and JWTs) in a process of its own."""
    import subprocess
    import sys

    home = tmp_path / "airflow"
    home.mkdir()
    (home / "passwords.json").write_text(json.dumps({"reader": "pw"}))
    artifacts = tmp_path / "artifacts"
    open_artifact_store(str(artifacts)).put_bytes(f"{report_prefix(CYCLE)}/report.html", b"<html>the page</html>")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__AUTH_MANAGER": (
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "reader:viewer",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API_AUTH__JWT_SECRET": "test-only-" + "x" * 32,
        "MASS_ARTIFACT_URL": str(artifacts),  # no mass_artifacts connection: the environment's store
    }
    env = {k: v for k, v in env.items() if k not in ("AIRFLOW_CONN_MASS_ARTIFACTS", "MASS_SETTINGS_DIR")}
    result = subprocess.run(
        [sys.executable, "-c", API_SERVER_PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {
        "anonymous": 401,
        "bearer": "<html>the page</html>",
        "invalid token": 403,
        "session, no slash": "<html>the page</html>",
    }


def test_the_estimate_page_shows_plan_json_s_estimate_for_the_form_s_values(tmp_path, store, monkeypatch):
    """The trigger form links to /mass-ops/estimate: the same figures as `mass-ops plan --json` for the same values."""
    monkeypatch.setenv("MASS_METADATA_URL", f"sqlite:///{tmp_path / 'absent.db'}")  # nothing recorded: defaults
    client = client_for(lambda: store)
    overrides = ["collection.candidates=5", "budgets.cycle_cost_usd=1"]
    query = "preset=demo&search_iterations=2&allow_over_budget=true&" + "&".join(f"set={quote(o)}" for o in overrides)

    shown = client.get(f"/mass-ops/estimate?{query}&format=json")
    assert shown.status_code == 200, shown.text
    planned = CliRunner().invoke(
        cli_app,
        [
            "plan",
            "--config",
            "demo",
            "--json",
            "--set",
            "search.iterations=2",
            *[part for o in overrides for part in ("--set", o)],
        ],
    )
    assert planned.exit_code == 0, planned.output
    assert shown.json()["estimate"] == json.loads(planned.stdout)["estimate"]
    collect = next(s for s in shown.json()["estimate"]["stages"] if s["stage"] == "collect")
    assert collect["episodes"] == 5 * 2, "5 candidates for each of the demo's 2 training tasks"
    assert shown.json()["budget"]["over_budget"] is (shown.json()["estimate"]["total"]["cost_usd"] > 1)

    page = client.get(f"/mass-ops/estimate?{query}")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<td>collect</td>" in page.text and "default-src 'none'" in page.headers["content-security-policy"]


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("preset=demo&no_such_knob=1", "unknown ['no_such_knob']"),
        ("preset=demo&set=search.iterations%3D-4", "iterations"),
    ],
)
def test_the_estimate_page_refuses_values_that_do_not_describe_a_cycle(store, query, words):
    response = client_for(lambda: store).get(f"/mass-ops/estimate?{query}")
    assert response.status_code == 400 and words in response.text and response.text.count("\n") == 1


# -- the estimate page reads no server file and opens no connection for its caller -----------------------------------


def test_the_estimate_page_does_not_read_a_config_file_the_caller_names(tmp_path, store):
    # A file on the server (here one the caller managed to leave there) named as the preset.
    planted = tmp_path / "planted.yaml"
    planted.write_text((Path(__file__).parents[2] / "mass_ops/presets/demo.yaml").read_text() + "name: planted\n")
    client = client_for(lambda: store, raise_server_exceptions=False)
    for preset in (str(planted), "/etc/passwd", "../../../etc/passwd"):
        response = client.get(f"/mass-ops/estimate?preset={quote(preset)}&format=json")
        assert response.status_code == 400, (preset, response.text)
        assert "is not a preset name" in response.text and response.text.count("\n") == 1


@pytest.mark.parametrize(
    "override",
    [
        "storage.metadata_url=sqlite:////etc/mass-ops/secret.db",
        "storage.artifact_url=/etc",
        "tasks.catalogue=/etc",
        "prompts.dir=/etc",
        "inference.endpoint=http://169.254.169.254/v1",
    ],
)
def test_the_estimate_page_refuses_storage_endpoints_and_server_folders(store, override):
    client = client_for(lambda: store, raise_server_exceptions=False)
    response = client.get(f"/mass-ops/estimate?preset=demo&set={quote(override)}")
    assert response.status_code == 400 and response.text.count("\n") == 1, response.text
    assert response.text.startswith(f"estimate: params: {override.partition('=')[0]}")


def test_the_estimate_page_opens_no_connection_to_a_host_the_caller_names(store):
    """A listener stands in for the caller's host: the page must answer without ever connecting to it."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        client = client_for(lambda: store, raise_server_exceptions=False)
        response = client.get(
            f"/mass-ops/estimate?preset=demo&set={quote(f'storage.metadata_url=postgresql://u@127.0.0.1:{port}/db')}"
        )
        assert response.status_code == 400, response.text
        # Any connection attempt made while answering sits in the backlog by now: accept() would return it.
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize(
    "query",
    [
        "preset=demo&train_tasks=" + "[" * 8_000 + "]" * 8_000,
        "preset=demo&train_tasks=" + "[" * 40 + "]" * 40,
        "preset=demo&train_tasks=" + quote('{"a":' * 2_000 + "1" + "}" * 2_000),
        "preset=demo&train_tasks=[51," + "1," * 20_000 + "52]",
    ],
    ids=["deep list", "too deep for a config", "deep object", "too long"],
)
def test_deeply_nested_or_huge_input_is_a_400_not_a_500(store, query):
    response = client_for(lambda: store, raise_server_exceptions=False).get(f"/mass-ops/estimate?{query}")
    assert response.status_code == 400 and response.text.count("\n") == 1, response.text[:300]
    assert response.text.startswith("estimate: query value train_tasks: "), response.text[:300]
