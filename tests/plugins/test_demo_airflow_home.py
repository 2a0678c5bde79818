"""The demo's Airflow helpers that need no Airflow run: the note `dag.test()` logs while nothing can run, and where
the demo finds the DAG files (a clone, or what an installed wheel carries)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from mass_ops_airflow.demo import airflow_home as demo_airflow


def test_the_nothing_to_run_warning_becomes_one_short_info_line(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger(demo_airflow.DAG_TEST_LOGGER)
    demo_airflow.quiet_waiting_notes()
    demo_airflow.quiet_waiting_notes()  # idempotent: one filter
    try:
        assert sum(isinstance(f, demo_airflow.WaitingNote) for f in logger.filters) == 1
        waiting = {f"<TaskInstance: mass_cycle.rhi.step_v{i} map_index=0 [None] ti_id=...>" for i in range(40)}
        with caplog.at_level(logging.INFO, logger=demo_airflow.DAG_TEST_LOGGER):
            # The two calls dag.test() makes (Airflow 3.3, airflow/sdk/definitions/dag.py), as it makes them.
            logger.warning("No tasks to run. unrunnable tasks: %s", waiting)
            logger.info("[DAG TEST] starting task_id=%s map_index=%s", "report", -1)
        first, second = caplog.records
        assert first.levelno == logging.INFO
        assert first.getMessage() == demo_airflow.WAITING_NOTE % 40 and len(first.getMessage()) < 100
        assert second.getMessage() == "[DAG TEST] starting task_id=report map_index=-1"  # others pass unchanged
    finally:
        for f in [f for f in logger.filters if isinstance(f, demo_airflow.WaitingNote)]:
            logger.removeFilter(f)


# --- where the demo finds the DAG files -------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]
CYCLE_DAG_FILE = f"{demo_airflow.CYCLE_DAG_ID}.py"


def fake_installed_layout(prefix: Path) -> tuple[Path, Path]:
    """What `pip install` of the mass-ops wheel leaves under `prefix`: its dist-info in site-packages, whose RECORD
    lists the DAG files it put under `prefix/share/mass-ops/dags`. Returns (site-packages, the DAG folder)."""
    site = prefix / "lib" / "python3.11" / "site-packages"
    info = site / "mass_ops-0.1.0.dist-info"
    dags = prefix.joinpath(*demo_airflow.INSTALLED_DAGS)
    info.mkdir(parents=True)
    dags.mkdir(parents=True)
    (dags / CYCLE_DAG_FILE).write_text("dag = None\n")
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: mass-ops\nVersion: 0.1.0\n")
    record = [f"../../../share/mass-ops/dags/{CYCLE_DAG_FILE},,", "mass_ops-0.1.0.dist-info/METADATA,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return site, dags


def test_an_installed_wheels_dag_files_are_found_through_its_record(tmp_path: Path) -> None:
    site, dags = fake_installed_layout(tmp_path / "venv")
    assert demo_airflow.installed_dags([str(site)]) == dags.resolve()
    # Without the cycle DAG in the RECORD (an older wheel), nothing is claimed.
    (site / "mass_ops-0.1.0.dist-info" / "RECORD").write_text("mass_ops-0.1.0.dist-info/METADATA,,\n")
    assert demo_airflow.installed_dags([str(site)]) is None
    assert demo_airflow.installed_dags([str(tmp_path / "nothing-here")]) is None


def test_outside_a_clone_the_demo_uses_the_installed_dag_files(tmp_path: Path, monkeypatch) -> None:
    site, dags = fake_installed_layout(tmp_path / "venv")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(demo_airflow, "CHECKOUT_DAGS", tmp_path / "no-clone" / "dags")  # a non-editable install
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    assert demo_airflow.dags_folder({}) == dags.resolve()
    # The variable wins; a clone's dags/ in the working directory comes before the installed files.
    assert demo_airflow.dags_folder({demo_airflow.DAGS_DIR_ENV: str(work)}) == work.resolve()
    (work / "dags").mkdir()
    (work / "dags" / CYCLE_DAG_FILE).write_text("dag = None\n")
    assert demo_airflow.dags_folder({}) == (work / "dags").resolve()


def test_no_dag_files_anywhere_is_one_line_naming_the_variable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo_airflow, "CHECKOUT_DAGS", tmp_path / "no-clone" / "dags")
    monkeypatch.setattr(demo_airflow, "installed_dags", lambda: None)
    monkeypatch.delenv(demo_airflow.DAGS_DIR_ENV, raising=False)
    assert demo_airflow.dags_folder() == (tmp_path / "dags").resolve()
    with pytest.raises(demo_airflow.DemoAirflowError) as raised:
        demo_airflow.use_demo_airflow(tmp_path / "home", environ={})
    (line,) = str(raised.value).splitlines()
    assert demo_airflow.DAGS_DIR_ENV in line and not (tmp_path / "home").exists()


def _build_wheel(source: Path, out: Path) -> Path:
    """`pip wheel --no-deps` of the project in `source` (this environment's setuptools, no index)."""
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    done = subprocess.run([*argv, str(source), "-w", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_non_editable_install_carries_the_dag_files_and_the_demo_finds_them(tmp_path: Path) -> None:
    # Build from copies: a build in the checkout would leave build/ and egg-info folders behind.
    core, plugin = tmp_path / "src" / "core", tmp_path / "src" / "plugin"
    for name in ("pyproject.toml", "README.md"):
        core.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, core / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("mass_ops", "dags"):
        shutil.copytree(REPO_ROOT / name, core / name, ignore=ignore)
    shutil.copytree(REPO_ROOT / "plugins", plugin, ignore=ignore)
    wheels = [_build_wheel(core, tmp_path / "core-wheel"), _build_wheel(plugin, tmp_path / "plugin-wheel")]

    listed = zipfile.ZipFile(wheels[0]).namelist()
    shipped = sorted(Path(n).name for n in listed if "/data/share/mass-ops/dags/" in n)
    assert shipped == sorted(p.name for p in (REPO_ROOT / "dags").glob("*.py")), listed

    prefix = tmp_path / "installed"
    argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q"]
    done = subprocess.run([*argv, "--prefix", str(prefix), *map(str, wheels)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (site,) = prefix.glob("lib/python*/site-packages")

    # A fresh interpreter outside any clone, importing both packages from the installed layout (first on the path).
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", demo_airflow.DAGS_DIR_ENV)}
    env["PYTHONPATH"] = str(site)
    probe = (
        "import mass_ops, mass_ops_airflow.demo.airflow_home as h; "
        "print(mass_ops.__file__); print(h.__file__); print(h.dags_folder())"
    )
    shown = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr[-2000:]
    core_file, plugin_file, folder = shown.stdout.split()
    assert Path(core_file).is_relative_to(site) and Path(plugin_file).is_relative_to(site), shown.stdout
    assert Path(folder) == (prefix / "share" / "mass-ops" / "dags").resolve()
    assert (Path(folder) / CYCLE_DAG_FILE).read_bytes() == (REPO_ROOT / "dags" / CYCLE_DAG_FILE).read_bytes()
    helped = subprocess.run(
        [sys.executable, "-m", "mass_ops.cli", "demo", "--help"], cwd=work, env=env, capture_output=True, text=True
    )
    assert helped.returncode == 0 and "--ui" in helped.stdout, helped.stdout + helped.stderr
