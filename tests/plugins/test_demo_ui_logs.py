"""The demo's task logs in the Airflow UI's Logs tab: after a `dag.test()` run whose output goes to a file, as
`mass-ops demo` runs it, the API server's log reader (`TaskLogReader`) returns each finished task's own lines.

The run happens in a child interpreter with its own Airflow home, exactly as the demo's process: Airflow imported
and its logging configured after the output is redirected (pytest's capture would otherwise hold the streams).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

DAG_FILE = textwrap.dedent(
    """
    from datetime import datetime

    from airflow.providers.standard.operators.python import PythonOperator
    from airflow.sdk import DAG


    def say(word):
        print(f"the task says {word}", flush=True)
        return word


    with DAG("demo_task_logs", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:
        first = PythonOperator(task_id="first", python_callable=say, op_args=["alpha"])
        second = PythonOperator(task_id="second", python_callable=say, op_args=["bravo"])
        first >> second
    """
)

# The demo's sequence: redirect, prepare the database, run with the listener, then read as the API server reads.
RUN_AND_READ = textwrap.dedent(
    """
    import importlib.util, json, sys
    from pathlib import Path
    from mass_ops_airflow.demo import live
    from mass_ops_airflow.demo.task_logs import TaskLogFiles

    demo_log, dag_file, result = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    with live.redirected_output(demo_log):
        from airflow.utils.db import initdb
        from airflow.utils.log.log_reader import TaskLogReader

        initdb()
        spec = importlib.util.spec_from_file_location("demo_task_logs_dag", dag_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        copier = TaskLogFiles(demo_log).install()
        try:
            run = module.dag.test()
        finally:
            written = copier.finish()
        shown = {}
        for ti in run.get_task_instances():
            stream, _ = TaskLogReader().read_log_chunks(ti, ti.try_number, {})
            shown[ti.task_id] = "\\n".join(str(getattr(m, "event", m)) for m in stream)
    result.write_text(json.dumps({"state": str(run.state), "written": [str(p) for p in written], "shown": shown}))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_finished_tasks_logs_reach_the_api_servers_log_reader(tmp_path: Path) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "demo_task_logs.py").write_text(DAG_FILE)
    home = tmp_path / "airflow"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        }
    )
    demo_log, result = tmp_path / "demo.log", tmp_path / "result.json"
    argv = [sys.executable, "-c", RUN_AND_READ, str(demo_log), str(dags / "demo_task_logs.py"), str(result)]
    done = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=540, check=False)
    tail = demo_log.read_text(errors="replace")[-3000:] if demo_log.exists() else ""
    assert done.returncode == 0 and result.exists(), f"{done.stderr[-2000:]}\n{tail}"

    outcome = json.loads(result.read_text())
    assert outcome["state"] == "success", tail
    assert len(outcome["written"]) == 2
    assert all(Path(path).is_relative_to(home / "logs") for path in outcome["written"]), outcome["written"]
    first, second = outcome["shown"]["first"], outcome["shown"]["second"]
    assert "the task says alpha" in first and "the task says bravo" not in first
    assert "the task says bravo" in second and "the task says alpha" not in second
    # The demo's own log keeps everything.
    assert "the task says alpha" in demo_log.read_text() and "the task says bravo" in demo_log.read_text()
