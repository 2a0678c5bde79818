"""The demo's Airflow UI in a real browser, all on one `mass-ops demo --ui` (slow: a cold start of Airflow, then a
whole small cycle on CPU), in the order of the tests below:

1. the trigger form's link opens the estimate page, which shows the labels, units and values applied and links back;
2. `mass_cycle` triggered from the form with a changed knob runs to `success`, and its report opens;
3. Ctrl-C stops everything it started (Airflow's four components, task processes, model servers), SIGTERM first.

`mass-ops demo --ui` runs as the user runs it, in a temporary working folder (its `runs/demo/` and model servers stay
there), with the scripted policy stand-in serving the "model" (`stand_in_serving`). Chromium is the system one,
driven by Playwright. The form shrinks the demo cycle to one training task, two candidates (the knob changed in the
form; the preset says 3), one test task and one training step, and moves the model servers to free ports.
Artifacts (screenshots, a JSON summary of the run, the logs of failed tasks) go to `runs/test-artifacts/browser/`.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urljoin

import pytest
from mass_ops_airflow.demo import ui as demo_ui
from mass_ops_airflow.demo.airflow_home import CYCLE_DAG_ID
from mass_ops_airflow.demo.ui import AirflowApi

from mass_ops.config import load_config
from tests.deploy.demo_ui_process import (
    REPO_ROOT,
    STOP_TIMEOUT_S,
    DemoUiProcess,
    chromium_executable,
    free_port,
)

ARTIFACTS = REPO_ROOT / "runs" / "test-artifacts" / "browser"
READY_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 3600.0
UI_TIMEOUT_MS = 60_000
CANDIDATES = 2  # the knob changed in the form (the demo preset says 3; ranks 1 + validation rank 2 need 2)
TRAIN_TASK = 51
TEST_TASK = 60
TERMINAL = {"success", "failed"}
VIEWPORT = {"width": 1600, "height": 1000}
# The estimate page's stage table and units (report_app.STAGE_HEADERS, TIME_COST_HEADERS) and its way back.
ESTIMATE_LABELS = ("Per stage", "episodes", "LLM calls", "prompt tokens", "completion tokens", "wall-clock h", "USD")
BACK_LINK = f"Back to the {CYCLE_DAG_ID} DAG"
READY_LINE = "Airflow is ready"  # standalone prints it once scheduler, DAG processor and triggerer heartbeat
COMPONENTS = ("airflow scheduler", "airflow dag-processor", "airflow triggerer", "airflow api_server")
STOP_LIMIT_S = 10.0  # Ctrl-C to the command's "stopped" (ui.STOP_GRACE_S + ui.KILL_WAIT_S, and its own lines)


def cycle_overrides(model_port: int) -> list[str]:
    """Override lines typed into the form: the smallest cycle the demo preset allows (one ZeRO-3 step, a forward and
    backward over a ~15 K-token window on CPU, validated once at its end), servers on free ports."""
    return [
        "training.steps=1",
        "training.warmup_steps=0",
        "training.save_every=1",
        "training.val_every=1",
        "training.val_at_start=false",
        f"tasks.train=[{TRAIN_TASK}]",
        f"tasks.train_candidates=[{TRAIN_TASK}]",
        f"tasks.test=[{TEST_TASK}]",
        f"evaluation.tasks=[{TEST_TASK}]",
    ]


def deployment_overrides(model_port: int) -> list[str]:
    """What only the deployment may set (a trigger is refused it): the demo UI's own config gets them by `--set`."""
    return [f"inference.endpoint=http://127.0.0.1:{model_port}/v1", f"inference.server.port={model_port}"]


@pytest.fixture
def chromium() -> str:
    pytest.importorskip("playwright.sync_api", reason="BROWSER TEST NOT RUN: install the dev extra (playwright)")
    return chromium_executable()


@dataclass(frozen=True)
class DemoUiSession:
    """The one `mass-ops demo --ui` of this module, and the first of the two free ports its model servers get."""

    demo: DemoUiProcess
    model_port: int


@pytest.fixture(scope="module")
def demo_ui_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoUiSession]:
    """`mass-ops demo --ui`, started once for every test here (a cold start of Airflow is the slow part), always
    cleaned up at the end; the artifacts folder is emptied first."""
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    model_port = free_port(2)  # the cycle's server, then L(k) and L(k+1) side by side for the evaluation
    deployment = [arg for line in deployment_overrides(model_port) for arg in ("--set", line)]
    with DemoUiProcess(tmp_path_factory.mktemp("demo-ui"), free_port(), args=deployment) as demo:
        demo.wait_ready(READY_TIMEOUT_S)
        yield DemoUiSession(demo, model_port)


@contextlib.contextmanager
def signed_in_page(chromium: str, demo: DemoUiProcess, failure_shot: str) -> Iterator[Any]:
    """A Chromium page signed in to the demo UI, on the DAG's page; a screenshot `failure_shot` when the block fails."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=UI_TIMEOUT_MS)  # a loaded 2-core machine answers slowly
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(UI_TIMEOUT_MS)
        try:
            # The UI sends an anonymous visitor to the simple auth manager's form.
            page.goto(f"{demo.ui.url}/dags/{CYCLE_DAG_ID}")
            page.get_by_label("Username").fill(demo.ui.user)
            page.get_by_label("Password").fill(demo.password())
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url(f"**/dags/{CYCLE_DAG_ID}")
            yield page
        except Exception:
            page.screenshot(path=str(ARTIFACTS / failure_shot), full_page=True)
            raise
        finally:
            browser.close()


def visible_text(page: Any) -> str:
    """The page's rendered text, whitespace folded (what a reader sees, not the markup)."""
    return " ".join(page.inner_text("body").split())


def check_screenshot(path: Path, viewport: dict[str, int] = VIEWPORT) -> None:
    """The screenshot is a PNG at least the viewport's size with something drawn on it: not one colour, and more
    than 1% of its pixels differ from the most common (background) colour."""
    from PIL import Image

    with Image.open(path) as shot:
        assert shot.format == "PNG", shot.format
        assert shot.width == viewport["width"] and shot.height >= viewport["height"], shot.size
        pixels = shot.convert("RGB")
        colours = pixels.getcolors(maxcolors=pixels.width * pixels.height) or []
        assert len(colours) > 1, f"{path.name} is one colour"
        background = max(count for count, _ in colours)
        drawn = pixels.width * pixels.height - background
        assert drawn > 0.01 * pixels.width * pixels.height, f"{path.name}: only {drawn} pixels differ from the page"


@pytest.fixture
def qwen_code() -> None:
    """The pinned qwen-code the episodes run (installed once into the shared runtime folder, before any task
    needs it: two episodes installing it at the same time would race)."""
    from mass_ops.runtime.qwen_install import default_runtime_dir, ensure_qwen_code

    if shutil.which("npm") is None and not (default_runtime_dir() / "qwen").exists():
        pytest.skip("npm is not installed and no qwen-code runtime is cached")
    ensure_qwen_code()


def task_instances(api: AirflowApi, run_id: str) -> list[dict[str, Any]]:
    """Every task instance of the run (the API pages by 100 at most)."""
    out: list[dict[str, Any]] = []
    while True:
        page = api.get(
            f"/api/v2/dags/{CYCLE_DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances", limit=100, offset=len(out)
        )
        out += page["task_instances"]
        if not page["task_instances"] or len(out) >= page["total_entries"]:
            return out


def label(ti: dict[str, Any]) -> str:
    index = ti.get("map_index", -1)
    return ti["task_id"] if index in (None, -1) else f"{ti['task_id']}[{ti.get('rendered_map_index') or index}]"


def wait_for_run(api: AirflowApi, timeout_s: float) -> str:
    """The id of the run the form created (exactly one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = api.get(f"/api/v2/dags/{CYCLE_DAG_ID}/dagRuns")["dag_runs"]
        if runs:
            assert len(runs) == 1, [r["dag_run_id"] for r in runs]
            return str(runs[0]["dag_run_id"])
        time.sleep(1)
    pytest.fail("no mass_cycle run appeared after Trigger")


def follow_run(api: AirflowApi, run_id: str, timeout_s: float) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """Poll the run until it ends (or time runs out): the run, its task instances and the seconds it took."""
    started = time.monotonic()
    seen: dict[str, str] = {}
    path = f"/api/v2/dags/{CYCLE_DAG_ID}/dagRuns/{quote(run_id, safe='')}"
    while True:
        run = api.get(path)
        tis = task_instances(api, run_id)
        for ti in tis:  # progress in the test's output: each task's state changes
            state = str(ti.get("state"))
            if seen.get(label(ti)) != state:
                seen[label(ti)] = state
                print(f"[{time.monotonic() - started:7.1f} s] {label(ti)}: {state}", flush=True)
        if run["state"] in TERMINAL or time.monotonic() - started > timeout_s:
            return run, tis, time.monotonic() - started
        time.sleep(5)


def failed_task_logs(home: Path, run_id: str, tis: list[dict[str, Any]]) -> dict[str, str]:
    """The last lines of the log of each failed task instance (from the UI's Airflow home)."""
    logs = {}
    for ti in tis:
        if ti.get("state") != "failed":
            continue
        folder = home / "logs" / f"dag_id={CYCLE_DAG_ID}" / f"run_id={run_id}" / f"task_id={ti['task_id']}"
        if ti.get("map_index", -1) not in (None, -1):
            folder = folder / f"map_index={ti['map_index']}"
        files = sorted(folder.glob("attempt=*.log"))
        logs[label(ti)] = "\n".join(files[-1].read_text(errors="replace").splitlines()[-40:]) if files else "(no log)"
    return logs


def total_episodes(text: str) -> int:
    found = re.search(r"Total: ([\d,]+) episodes", text)
    assert found, text[:2000]
    return int(found.group(1).replace(",", ""))


@pytest.mark.slow(seconds=60)
@pytest.mark.timeout(READY_TIMEOUT_S + 600)
def test_the_trigger_forms_link_opens_the_estimate_page_which_links_back(
    demo_ui_session: DemoUiSession, chromium: str
) -> None:
    from playwright.sync_api import expect

    ui = demo_ui_session.demo.ui
    cycle = load_config(str(ui.cycle_config_file)).cycle_name
    with signed_in_page(chromium, demo_ui_session.demo, "estimate-failure.png") as page:
        page.get_by_role("button", name="Trigger").first.click()
        form = page.get_by_role("dialog")
        form.get_by_role("button", name="Advanced", exact=True).click()
        # The form's link (Allow over budget's help) opens the page in a new tab, for the form's default preset.
        with page.expect_popup() as opened:
            form.get_by_role("link", name="Open the estimate per stage").click()
        estimate = opened.value
        estimate.wait_for_load_state()
        expect(estimate.get_by_text(f"Cost estimate: cycle {cycle}")).to_be_visible()
        shot = ARTIFACTS / "estimate-page.png"
        estimate.screenshot(path=str(shot), full_page=True)
        check_screenshot(shot)
        text = visible_text(estimate)
        for label_text in ESTIMATE_LABELS:
            assert label_text in text, (label_text, text[:3000])
        assert f"Values applied: preset={ui.cycle_config_file} (no knob or override changed)." in text, text[:3000]
        assert "wall-clock hours" in text and "GPU-hours: none estimated" in text, text[:3000]
        preset_episodes = total_episodes(text)

        # A knob and an override added to the address, as the form's help says: echoed, and in the figures.
        query = urlencode([("candidates", CANDIDATES), ("set", "budgets.cycle_tokens=1000")])
        estimate.goto(f"{estimate.url}&{query}")
        expect(estimate.get_by_text(f"Cost estimate: cycle {cycle}")).to_be_visible()
        shot = ARTIFACTS / "estimate-page-knobs.png"
        estimate.screenshot(path=str(shot), full_page=True)
        check_screenshot(shot)
        text = visible_text(estimate)
        assert f"candidates={CANDIDATES}; set budgets.cycle_tokens=1000." in text, text[:3000]
        assert total_episodes(text) < preset_episodes  # fewer teacher candidates: fewer collection episodes
        assert "Over the cycle budget:" in text and "(budget 1,000)" in text, text[:3000]

        # The way back: the DAG's page, whose Trigger button opens the form again.
        estimate.get_by_role("link", name=BACK_LINK).click()
        estimate.wait_for_url(f"**/dags/{CYCLE_DAG_ID}")
        expect(estimate.get_by_role("button", name="Trigger").first).to_be_visible()


@pytest.mark.slow(seconds=220)
@pytest.mark.timeout(READY_TIMEOUT_S + RUN_TIMEOUT_S + 600)
def test_cycle_triggered_from_the_browser_runs_to_success(
    demo_ui_session: DemoUiSession, chromium: str, qwen_code: None
) -> None:
    from playwright.sync_api import expect

    demo = demo_ui_session.demo
    ui = demo.ui
    overrides = cycle_overrides(demo_ui_session.model_port)
    with signed_in_page(chromium, demo, "failure.png") as page:
        # The trigger form: the demo config is the default preset; change a knob, add overrides.
        page.get_by_role("button", name="Trigger").first.click()
        form = page.get_by_role("dialog")
        expect(form.get_by_role("checkbox", name=f"Unpause {CYCLE_DAG_ID} on trigger")).to_be_checked()
        form.get_by_role("button", name="Cycle", exact=True).click()
        expect(form.locator("input[name='element_preset']")).to_have_value(str(ui.cycle_config_file))
        form.get_by_role("button", name="Search and collection").click()
        candidates = form.get_by_role("spinbutton", name="Candidates")
        # The form shows the default preset's own value (the demo cycle's), not a blank field.
        expect(candidates).to_have_value(str(load_config(str(ui.cycle_config_file)).collection.candidates))
        candidates.fill(str(CANDIDATES))
        form.get_by_role("button", name="Advanced", exact=True).click()
        form.get_by_placeholder("Enter each string on a new line").fill("\n".join(overrides))
        page.screenshot(path=str(ARTIFACTS / "trigger-form.png"))
        form.get_by_role("button", name="Trigger", exact=True).click()
        expect(form).to_be_hidden()

        with demo.api() as api:
            run_id = wait_for_run(api, 60)
            run_path = f"/api/v2/dags/{CYCLE_DAG_ID}/dagRuns/{quote(run_id, safe='')}"
            conf = api.get(run_path)["conf"]
            assert conf["candidates"] == CANDIDATES, conf
            assert conf["overrides"] == overrides and conf["preset"] == str(ui.cycle_config_file), conf
            run, tis, seconds = follow_run(api, run_id, RUN_TIMEOUT_S)
            success = run["state"] == "success"
            links = api.get(f"{run_path}/taskInstances/report/links")["extra_links"] if success else {}

        # The run's grid, as the operator sees it; the page shows the state the API reports.
        page.goto(f"{ui.url}/dags/{CYCLE_DAG_ID}/runs/{quote(run_id, safe='')}")
        expect(page.get_by_text("report", exact=True).first).to_be_visible()
        expect(page.get_by_text(str(run["state"]).capitalize(), exact=True).first).to_be_visible()
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(ARTIFACTS / "mass_cycle-grid.png"), full_page=True)

        # The run's report task links the cycle report (its "Cycle report" extra link): the plugin's view serves it.
        if run["state"] == "success":
            cycle = load_config(str(ui.cycle_config_file)).cycle_name
            assert links.get("Cycle report"), links
            page.goto(urljoin(f"{ui.url}/", links["Cycle report"]))  # absolute under [api] base_url
            expect(page.get_by_text(f"MASS cycle report: {cycle}")).to_be_visible()
            shot = ARTIFACTS / "cycle-report.png"
            page.screenshot(path=str(shot), full_page=True)
            check_screenshot(shot)

    states = {label(ti): ti.get("state") for ti in tis}
    failures = failed_task_logs(ui.home, run_id, tis)
    durations = {label(ti): round(ti["duration"], 1) for ti in tis if ti.get("duration")}
    summary = {"run_id": run_id, "state": run["state"], "seconds": round(seconds), "tasks": states}
    summary["task_seconds"] = durations
    shutil.copytree(ui.home / "logs", ARTIFACTS / "airflow-logs", dirs_exist_ok=True)
    shutil.copy(ui.log_file, ARTIFACTS / "standalone.log")
    (ARTIFACTS / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    for name, text in failures.items():
        (ARTIFACTS / f"failed-{name.replace('/', '_')}.log").write_text(text)
    print(f"mass_cycle {run_id}: {run['state']} after {seconds:.0f} s", flush=True)
    assert run["state"] == "success", (run["state"], {k: v for k, v in states.items() if v != "success"}, failures)

    # The knob reached the cycle: the training task's collection unit ran its candidates (its label says how many).
    collected = [ti for ti in tis if ti["task_id"] == "inner_loop.collect_task"]
    assert [(ti["state"], ti.get("rendered_map_index")) for ti in collected] == [
        ("success", f"collection-t{TRAIN_TASK} ({CANDIDATES} candidates)")
    ]
    # The "model" was the stand-in: the cycle's server log says so.
    server_logs = "".join(p.read_text(errors="replace") for p in (demo.workdir / "runs" / "servers").rglob("*.log"))
    assert "policy stand-in serving" in server_logs


def standalone_leader(demo: DemoUiProcess) -> int:
    """The pid of the UI's `airflow standalone`, which leads its own process group (so do model servers)."""
    leaders = [
        pid
        for pid in demo.leftovers()
        if pid in demo_ui.group_members(pid) and "standalone" in demo_ui.describe_process(pid)
    ]
    assert len(leaders) == 1, [demo_ui.describe_process(pid) for pid in demo.leftovers()]
    return leaders[0]


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for its reaper has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# Last in this module: it stops the UI the tests above share.
@pytest.mark.slow(seconds=7)
@pytest.mark.timeout(READY_TIMEOUT_S + 300)
def test_ctrl_c_stops_airflow_and_everything_it_started_sigterm_first(demo_ui_session: DemoUiSession) -> None:
    demo = demo_ui_session.demo
    deadline = time.monotonic() + 120
    while READY_LINE not in demo.ui.log_file.read_text(errors="replace"):  # every component heartbeats
        assert time.monotonic() < deadline, f"no {READY_LINE!r}:\n{demo_ui._log_tail(demo.ui.log_file)}"
        time.sleep(1)
    leader = standalone_leader(demo)
    members = demo_ui.group_members(leader)
    described = " ".join(demo_ui.describe_process(pid) for pid in members)
    assert all(name in described for name in COMPONENTS), described
    logged = len(demo.log_file.read_text(errors="replace"))

    # Ctrl-C; timed to the command's "stopped" line (its stop is bounded), then its exit (an interpreter's teardown).
    assert demo.process is not None
    started = time.monotonic()
    demo.process.send_signal(signal.SIGINT)
    said = ""
    while "stopped" not in [line.strip() for line in said.splitlines()] and demo.process.poll() is None:
        assert time.monotonic() - started < STOP_TIMEOUT_S, said
        time.sleep(0.1)
        said = demo.log_file.read_text(errors="replace")[logged:]
    stop_s = time.monotonic() - started
    code = demo.process.wait(timeout=STOP_TIMEOUT_S)
    said = demo.log_file.read_text(errors="replace")[logged:]
    print(f"Ctrl-C: stopped after {stop_s:.1f} s, exit {code} after {time.monotonic() - started:.1f} s:\n{said}")

    assert code == 0, demo.log_tail()
    assert stop_s < STOP_LIMIT_S, said
    assert demo_ui.group_members(leader) == [] and demo.leftovers() == []
    assert not [pid for pid in members if running(pid)], "a component outlived the stop"
    # stop_group sends SIGTERM (twice at most) and SIGKILL only to what outlived them, which the command then names:
    # no such line, or one naming processes, and nothing else was sent.
    killed = [line for line in said.splitlines() if line.startswith("killed (SIGKILL)")]
    assert all("(pid " in line for line in killed), killed
    assert "stopping Airflow" in said and "stopped" in [line.strip() for line in said.splitlines()], said
