"""Parse time of each DAG file, each in a fresh process, against a 300 ms target and an empty DAG's baseline.

Airflow's DAG processor parses a file in a process that has Airflow itself loaded but not what the file imports;
this harness reproduces that: a fresh interpreter imports `airflow.sdk` first (not timed), then the file is executed
as a module (timed) and must define a DAG. The same is done for an empty DAG file, the baseline of what any DAG
file costs. Each file is parsed in `--runs` fresh processes; the verdict uses the best run (the file's own cost:
slower runs measure whatever else the machine was doing) and the median is printed beside it.

    .venv/bin/python benchmarks/dag_parse.py [--runs 5] [--files mass_cycle.py,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DAGS = ROOT / "dags"
TARGET_MS = 300.0

EMPTY_DAG = textwrap.dedent(
    """
    import datetime as dt

    from airflow.sdk import DAG

    with DAG(dag_id="empty", schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC)) as dag:
        pass
    """
)

# Runs in the fresh process: load Airflow like the DAG processor has, then time executing the file.
PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys, time
    import airflow.sdk
    from airflow.sdk import DAG
    path = sys.argv[1]
    spec = importlib.util.spec_from_file_location("parsed_dag", path)
    module = importlib.util.module_from_spec(spec)
    start = time.perf_counter()
    spec.loader.exec_module(module)
    elapsed = time.perf_counter() - start
    dags = [v.dag_id for v in vars(module).values() if isinstance(v, DAG)]
    print(json.dumps({"ms": elapsed * 1000, "dags": dags}))
    """
)


def parse_once(path: Path) -> tuple[float, list[str]]:
    """Parse `path` in a fresh interpreter; returns (milliseconds, DAG ids it defined)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"parsing {path} failed:\n{result.stderr[-2000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["ms"], report["dags"]


def parse_runs(path: Path, runs: int) -> tuple[float, float, list[str]]:
    """(best ms, median ms, DAG ids) over `runs` fresh processes."""
    timings, dags = [], []
    for _ in range(runs):
        ms, dags = parse_once(path)
        timings.append(ms)
    return min(timings), statistics.median(timings), dags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per file")
    parser.add_argument("--files", help="comma-separated DAG file names to parse (default: every file in dags/)")
    args = parser.parse_args(argv)
    files = sorted(DAGS.glob("*.py"))
    if args.files:
        wanted = {name.strip() for name in args.files.split(",") if name.strip()}
        unknown = sorted(wanted - {path.name for path in files})
        if unknown or not wanted:
            parser.error(f"--files: no such DAG file(s) {unknown} in {DAGS}")
        files = [path for path in files if path.name in wanted]

    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty_dag.py"
        empty.write_text(EMPTY_DAG)
        baseline, baseline_median, _ = parse_runs(empty, args.runs)
    print(f"baseline (empty DAG file): best {baseline:.1f} ms, median {baseline_median:.1f} ms ({args.runs} processes)")
    print(f"{'file':<24}{'dags':<20}{'best ms':>9}{'median ms':>11}{'× target':>10}{'× baseline':>12}  verdict")
    worst = 0.0
    for path in files:
        best, median, dags = parse_runs(path, args.runs)
        worst = max(worst, best / TARGET_MS)
        verdict = "ok" if best < TARGET_MS else "OVER TARGET"
        print(
            f"{path.name:<24}{','.join(dags):<20}{best:>9.1f}{median:>11.1f}{best / TARGET_MS:>10.2f}"
            f"{best / baseline:>12.1f}  {verdict}"
        )
    print(f"target: < {TARGET_MS:.0f} ms per file; worst file at {worst:.2f}× the target")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
