"""The demo's live view without an Airflow run: rendering from scripted task-instance states, the non-TTY line mode,
the output redirection, and the whole `mass-ops demo` terminal output with a stand-in DAG run that logs noisily."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

from mass_ops_airflow.demo.live import (
    DemoProgress,
    RunWatcher,
    TaskSnapshot,
    clock,
    finished_line,
    print_summary,
    stage_line,
)
from rich.console import Console

T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
REPO = Path(__file__).resolve().parents[2]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def render(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=200, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


# A scripted run: validate done, two of four collection episodes done, the third running for 41 s.
SCRIPT = [
    TaskSnapshot("validate_config", state="success", started=at(0), ended=at(2)),
    TaskSnapshot("rhi.reference_episode", 0, "success", at(2), at(32), label="t51"),
    TaskSnapshot("rhi.step_v1", 0, "skipped", at(32), at(32), label="t51"),
    TaskSnapshot("collect_candidate", 0, "success", at(40), at(100), label="t51 c0"),
    TaskSnapshot("collect_candidate", 1, "success", at(100), at(160), label="t51 c1"),
    TaskSnapshot("collect_candidate", 2, "running", at(160), label="t51 c2"),
    TaskSnapshot("collect_candidate", 3, "scheduled", label="t51 c3"),
    TaskSnapshot("train", state=None),
]


def test_clock():
    assert [clock(None), clock(5.4), clock(61), clock(3725)] == ["—", "00:05", "01:01", "1:02:05"]


def test_a_stage_line_counts_states_and_estimates_the_rest():
    line = stage_line("collect_candidate", [s for s in SCRIPT if s.stage == "collect_candidate"], at(201))
    assert dict(line.counts) == {"queued": 1, "running": 1, "success": 2, "failed": 0, "skipped": 0}
    assert line.current == "collect_candidate[t51 c2] 00:41"
    assert line.elapsed_s == 161  # since the first episode started
    assert line.eta_s == 120  # 60 s per finished episode × 2 unfinished ÷ 1 running
    done = stage_line("rhi", [s for s in SCRIPT if s.stage == "rhi"], at(201))
    assert done.done and done.eta_s == 0 and done.elapsed_s == 30


def test_the_view_renders_one_line_per_stage_in_dag_order():
    progress = DemoProgress(
        order=["validate_config", "rhi.reference_episode", "collect_candidate", "train"],
        started=T0,
        log_path=Path("runs/demo/logs/demo-x.log"),
        now=lambda: at(201),
    )
    progress.update(SCRIPT)
    text = render(progress)
    rows = [line for line in text.splitlines() if line.count("│") > 5]  # body rows (the header uses ┃)
    assert [r.split("│")[1].strip() for r in rows] == ["validate_config", "rhi", "collect_candidate", "train"]
    assert "collect_candidate[t51 c2] 00:41" in text and "02:00" in text  # the running unit; its stage's ETA
    assert "elapsed 03:21 · 5/8 task instances finished · ETA ~02:01" in text  # skipped counts as finished
    assert "Airflow logs: runs/demo/logs/demo-x.log" in text


def test_newly_finished_instances_are_reported_once_each():
    progress = DemoProgress(started=T0, now=lambda: at(300))
    first = progress.update(SCRIPT)
    assert [ti.name for ti in first] == [
        "validate_config",
        "rhi.reference_episode[t51]",
        "rhi.step_v1[t51]",
        "collect_candidate[t51 c0]",
        "collect_candidate[t51 c1]",
    ]
    later = [s for s in SCRIPT if s.key != ("collect_candidate", 2)]
    later.append(TaskSnapshot("collect_candidate", 2, "failed", at(160), at(205), label="t51 c2"))
    assert [ti.name for ti in progress.update(later)] == ["collect_candidate[t51 c2]"]
    assert progress.update(later) == []


def test_the_line_mode_prints_one_plain_line_per_finished_instance_and_survives_a_busy_database():
    answers: list[object] = [None, RuntimeError("database is locked"), SCRIPT[:2], SCRIPT]
    printed: list[str] = []

    def fetch():
        answer = answers.pop(0) if answers else SCRIPT
        if isinstance(answer, Exception):
            raise answer
        return answer

    watcher = RunWatcher(fetch, DemoProgress(started=T0), on_finished=lambda ti: printed.append(finished_line(ti)))
    for _ in range(5):
        watcher.poll()
    assert len(printed) == 5  # the five finished instances, each once
    assert printed[0].split()[1:] == ["success", "validate_config", "(2.0", "s)"]
    assert "skipped" in printed[2] and "rhi.step_v1[t51]" in printed[2]


def test_the_closing_lines_hold_no_python_reprs_and_fit_80_columns():
    """Labels and words, not field names and Python values; every location and command whole and copyable."""
    report = "/home/someone/projects/mass-ops-clone/runs/demo/artifacts/cycles/demo-L0/report/report.html"
    result = {
        "report": report,
        "report_markdown": "runs/demo/artifacts/report.md",
        "log": "runs/demo/logs/demo-x.log",
        "generation": {"generation": "L1", "generation_id": 7, "parent": "L0", "bf16_uri": "file:///x"},
        "evaluation": {"win_rate": None, "pairs": 4, "judges": ["a", "b"], "stand_in_judge": True},
        "run_id": "manual__1",
        "task_states": {"success": 40, "skipped": 12},
        "timings_s": {"train": 61.23, "export": 5.0},
        "total_s": 300.0,
        "inspect": [
            ["mass-ops", "repair", "demo-L0", "--config", "demo", "--set", "models.served_name=a/b", "--dry-run"]
        ],
    }
    console = Console(file=io.StringIO(), width=80, record=True, color_system=None)
    print_summary(console, result)
    text = console.export_text()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines if line.strip() != report), text
    assert report in [line.strip() for line in lines], "the report path whole on its own line"
    assert "{" not in text and "'" not in text and "True" not in text and "None" not in text
    for fragment in ("BF16 model: file:///x", "stand-in judge: yes", "win rate: n/a", "a, b", "40 success", "61.2"):
        assert fragment in text
    assert "bf16_uri" not in text and "generation id" not in text
    assert "  mass-ops repair demo-L0 --config demo --set models.served_name=a/b --dry-run" in lines


def test_inner_loop_instances_are_named_by_their_task_also_when_skipped():
    """Airflow renders a label only for an instance that ran: a skipped step takes its task from its siblings."""
    progress = DemoProgress(started=T0, now=lambda: at(60))
    finished = progress.update(
        [
            TaskSnapshot("inner_loop.step_v0", 0, "success", at(2), at(30), label="search-t51-v0"),
            TaskSnapshot("inner_loop.step_v1", 0, "skipped", at(30), at(30)),
            TaskSnapshot(
                "inner_loop.collect_task", 1, "success", at(2), at(30), label="collection-t202 (3 candidates)"
            ),
            TaskSnapshot("inner_loop.step_v1", 1, "skipped", at(30), at(30)),
        ]
    )
    assert sorted(ti.name for ti in finished) == [
        "inner_loop.collect_task[t202]",
        "inner_loop.step_v0[t51]",
        "inner_loop.step_v1[t202]",
        "inner_loop.step_v1[t51]",
    ]


STAND_IN_DEMO = textwrap.dedent(
    """
    import logging, subprocess, sys, types
    from datetime import UTC, datetime

    import mass_ops_airflow.demo as demo
    from mass_ops_airflow.demo import airflow_home, live
    from mass_ops.cli import app

    TASKS = [("validate_config", -1)] + [("collect_candidate", i) for i in range(6)] + [("train", -1), ("report", -1)]
    states = {key: None for key in TASKS}

    class Run:
        run_id, state, dag_id = "manual__stand-in", "success", "mass_cycle"
        def get_task_instances(self):
            return []

    class Dag:
        dag_id, task_ids = "mass_cycle", ["validate_config", "collect_candidate", "train", "report"]
        def test(self, run_conf=None):
            noisy = logging.getLogger("airflow.task")
            for key in TASKS:
                states[key] = "running"
                for i in range(200):  # what Airflow's task runner says about one task instance
                    noisy.warning("structured record %d of %s", i, key)
                    print("XCom push", key, i)
                child = "import sys; print('child says hi'); print('child err', file=sys.stderr)"
                subprocess.run([sys.executable, "-c", child])
                states[key] = "success"
            return Run()

    def snapshots(dag_id, after):
        now = datetime.now(UTC)
        return [live.TaskSnapshot(t, m, s, now, now if s == "success" else None) for (t, m), s in states.items()]

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    demo.prepare_parent = lambda config: None
    airflow_home.use_demo_airflow = lambda: {}
    airflow_home.prepare_database = lambda: None
    airflow_home.load_dag = lambda: Dag()
    airflow_home.task_states = lambda run: {"success": len(TASKS)}
    airflow_home.xcom_result = lambda run, task: {"report": {"html": "report.html"}, "register": {"generation": "L1"},
                                                 "evaluate": {"win_rate": 0.5}}.get(task)
    live.newest_run_id = lambda dag_id: 0
    live.airflow_snapshots = snapshots
    app(["demo"] + sys.argv[1:], standalone_mode=False)
    """
)


def run_stand_in_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "stand_in_demo.py"
    script.write_text(STAND_IN_DEMO)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        capture_output=True,  # a pipe: not a TTY, so the line mode
        text=True,
        timeout=120,
    )


def test_the_demo_prints_a_short_summary_and_sends_airflow_records_to_the_log_file(tmp_path: Path):
    done = run_stand_in_demo(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    # 1 planned line + the log path + 9 finished task instances + the closing rule and tables (about 40 lines).
    assert len(out) < 60, done.stdout
    assert not any("structured record" in line or "XCom push" in line or "child" in line for line in out)
    assert done.stderr == ""
    (log,) = (tmp_path / "runs" / "demo" / "logs").glob("demo-*.log")
    assert any(line.startswith("Airflow logs: ") and line.endswith(log.name) for line in out)
    logged = log.read_text()
    assert logged.count("structured record") == 9 * 200 and logged.count("XCom push") == 9 * 200
    assert logged.count("child says hi") == 9 and logged.count("child err") == 9  # child processes too
    assert sum(" success " in line and "collect_candidate[" in line for line in out) == 6
    assert "{" not in done.stdout


def test_verbose_restores_the_logs_on_the_terminal(tmp_path: Path):
    done = run_stand_in_demo(tmp_path, "--verbose")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("XCom push") == 9 * 200 and done.stderr.count("structured record") == 9 * 200
    assert not (tmp_path / "runs" / "demo" / "logs").exists()


def test_the_inner_loop_group_shows_its_phases_as_three_lines_in_dag_order():
    """`mass_cycle`'s per-task group: search steps on one line, collection and ranking on their own, so a watcher sees
    one task collecting while another still searches (the pipelined order)."""
    order = ["validate_config", "inner_loop.reference_episode", "inner_loop.step_v0", "inner_loop.collect_task",
             "inner_loop.rank_task", "select"]  # fmt: skip
    script = [
        TaskSnapshot("validate_config", state="success", started=at(0), ended=at(2)),
        TaskSnapshot("inner_loop.step_v0", 0, "success", at(2), at(30), label="search-t51-v0"),
        TaskSnapshot("inner_loop.step_v0", 1, "running", at(2), label="search-t202-v0"),
        TaskSnapshot("inner_loop.collect_task", 0, "running", at(30), label="collection-t51 (3 candidates)"),
        TaskSnapshot("inner_loop.collect_task", 1, None, label="collection-t202 (3 candidates)"),
        TaskSnapshot("inner_loop.rank_task", 0, None),
        TaskSnapshot("select", state=None),
    ]
    progress = DemoProgress(order=order, started=T0, now=lambda: at(60))
    progress.update(script)
    rows = [line for line in render(progress).splitlines() if line.count("│") > 5]
    names = [r.split("│")[1].strip() for r in rows]
    assert names == [
        "validate_config",
        "inner_loop.search",
        "inner_loop.collect_task",
        "inner_loop.rank_task",
        "select",
    ]
    collecting = next(r for r in rows if "inner_loop.collect_task" in r.split("│")[1])
    assert "inner_loop.collect_task[t51]" in collecting, "the running unit of the collection line"
