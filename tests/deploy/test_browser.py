"""The demo's Airflow UI in a real browser: log in, trigger `mass_cycle` from its form with a changed knob, and
follow the run to `success` (slow: a whole small cycle on CPU).

`mass-ops demo --ui` runs as the user runs it, in a temporary working folder (its `runs/demo/` and model servers stay
there), with the scripted policy stand-in serving the "model" (`stand_in_serving`). Chromium is the system one,
driven by Playwright. The form shrinks the demo cycle to one training task, two candidates (the knob changed in the
form; the preset says 3), one test task and one training step, and moves the model servers to free ports.

Artifacts (screenshots, a JSON summary of the run, the logs of failed tasks) are kept in
`runs/test-artifacts/browser/` of the repository.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from mass_ops_airflow.demo.airflow_home import CYCLE_DAG_ID
from mass_ops_airflow.demo.ui import AirflowApi

from mass_ops.config import load_config
from tests.deploy.demo_ui_process import REPO_ROOT, DemoUiProcess, chromium_executable, free_port

ARTIFACTS = REPO_ROOT / "runs" / "test-artifacts" / "browser"
READY_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 3600.0
UI_TIMEOUT_MS = 60_000
CANDIDATES = 2  # the knob changed in the form (the demo preset says 3; ranks 1 + validation rank 2 need 2)
TRAIN_TASK = 51
TEST_TASK = 60
TERMINAL = {"success", "failed"}


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


@pytest.mark.slow
@pytest.mark.timeout(READY_TIMEOUT_S + RUN_TIMEOUT_S + 600)
def test_cycle_triggered_from_the_browser_runs_to_success(tmp_path: Path, chromium: str, qwen_code: None) -> None:
    from playwright.sync_api import expect, sync_playwright

    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    expect.set_options(timeout=UI_TIMEOUT_MS)  # a loaded 2-core machine answers slowly
    model_port = free_port(2)  # the cycle's server, then L(k) and L(k+1) side by side for the evaluation
    overrides = cycle_overrides(model_port)
    deployment = [arg for line in deployment_overrides(model_port) for arg in ("--set", line)]
    with DemoUiProcess(tmp_path, free_port(), args=deployment) as demo:
        demo.wait_ready(READY_TIMEOUT_S)
        ui = demo.ui
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(UI_TIMEOUT_MS)
            try:
                # Log in: the UI sends an anonymous visitor to the simple auth manager's form.
                page.goto(f"{ui.url}/dags/{CYCLE_DAG_ID}")
                page.get_by_label("Username").fill(ui.user)
                page.get_by_label("Password").fill(demo.password())
                page.get_by_role("button", name="Sign in").click()
                page.wait_for_url(f"**/dags/{CYCLE_DAG_ID}")

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
                    conf = api.get(f"/api/v2/dags/{CYCLE_DAG_ID}/dagRuns/{quote(run_id, safe='')}")["conf"]
                    assert conf["candidates"] == CANDIDATES, conf
                    assert conf["overrides"] == overrides and conf["preset"] == str(ui.cycle_config_file), conf
                    run, tis, seconds = follow_run(api, run_id, RUN_TIMEOUT_S)

                # The run's grid, as the operator sees it; the page shows the state the API reports.
                page.goto(f"{ui.url}/dags/{CYCLE_DAG_ID}/runs/{quote(run_id, safe='')}")
                expect(page.get_by_text("report", exact=True).first).to_be_visible()
                expect(page.get_by_text(str(run["state"]).capitalize(), exact=True).first).to_be_visible()
                page.wait_for_load_state("networkidle")
                page.screenshot(path=str(ARTIFACTS / "mass_cycle-grid.png"), full_page=True)
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
                raise
            finally:
                browser.close()

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
        server_logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "runs" / "servers").rglob("*.log"))
        assert "policy stand-in serving" in server_logs

        # Ctrl-C stops everything: Airflow's components, task processes, model servers.
        assert demo.interrupt() == 0, demo.log_tail()
        assert demo.leftovers() == []
