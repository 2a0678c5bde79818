"""A whole MASS cycle through Airflow's own `dag.test()` on the local backend, with the demo preset, then a repair.

The scripted OpenAI-compatible server in tests/policy_server is the named stand-in for the policy: it plays the
model for search, collection and ranking (real qwen-code episodes through the logging proxy, real judge and
optimizer calls) and the external judge. Everything after runs for real on CPU: render with the Qwen3 tokenizer,
LoRA training under DeepSpeed ZeRO-3 on a tiny random Qwen3, checkpoint selection, BF16 merge, FP8 export,
registration of L1, `transformers serve` of L0 and L1 for the rollouts and the in-loop judges, evaluation, report.

Two tasks are searched; task 51 is trained, task 202 is searched only. The pipelined order is shown by making 202's
search slow: its step v1 waits (rescheduling itself, so the in-process run goes on) until 51's teacher collection is
recorded, which the DAG allows only if 51's collection does not wait for every task's search. One of 51's teacher
candidates fails on infrastructure (a 503 in its proxy log, as a dropped upstream would leave), so the task's
collection unit fails and its ranking waits. Clearing the failed instance and its downstream (what "Clear" does in
the UI) and letting the same run continue reruns that one instance, which runs only the failed candidate again, and
completes the cycle with no duplicated episode: the instances that had succeeded are not run again.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mass_ops.config import load_config
from mass_ops.context import attach_cycle
from mass_ops.layout import report_prefix
from tests.dags.run_repair import clear_failed, finish_run
from tests.inner_loop_fakes import serve_policy
from tests.plugins.airflow_env import DAGS_FOLDER

pytestmark = [pytest.mark.slow(seconds=210), pytest.mark.timeout(1800)]

MODEL = "policy-stand-in"
JUDGE_KEY_ENV = "MASS_TEST_JUDGE_KEY"
FAST, SLOW = 51, 202  # the trained task; the task searched only, whose search is held back
FAILING_CANDIDATE = 1  # the candidate of task FAST whose first attempt fails on infrastructure
MAX_WAITS = 60  # reschedules of the slow step before it gives up waiting (a barrier DAG would never let it through)


def _deployment(tmp: Path, endpoint: str) -> list[str]:
    """What only the deployment sets (a trigger is refused these): stores, the model endpoint, the judge."""
    judge = (
        f"[{{name: stand-in-judge, provider: openai-compatible, model: {MODEL}, base_url: '{endpoint}', "
        f"api_key_env: {JUDGE_KEY_ENV}}}]"
    )
    return [
        f"storage.metadata_url=sqlite:///{tmp / 'mass-ops.db'}",
        f"storage.artifact_url={tmp / 'artifacts'}",
        f"inference.endpoint={endpoint}",
        "compute.local_inference=external",
        f"evaluation.judges={judge}",
    ]


def _overrides() -> list[str]:
    """The trigger's own overrides: experiment knobs only."""
    return [
        f"models.served_name={MODEL}",
        # Smaller than the demo preset where the demo's size adds nothing to what is shown: two RHI tasks, one of
        # them trained, two candidates (train rank 1, validation rank 2), one ZeRO-3 step validated once (each pass
        # over a ~15 K-token window costs tens of seconds on 2 cores).
        f"tasks.train_candidates=[{FAST}, {SLOW}]",
        f"tasks.train=[{FAST}]",
        f"tasks.excluded=[{SLOW}]",  # searched, never trained
        "collection.candidates=2",
        "runtime.max_infra_attempts=1",  # the injected failure ends the unit's first try at once
        "training.steps=1",
        "training.warmup_steps=0",
        "training.save_every=1",
        "training.val_every=1",
        "training.val_at_start=false",
    ]


def _register_preset(tmp: Path, monkeypatch, deployment: list[str]) -> str:
    """Register the demo preset with the deployment's settings as the deployment's own preset; returns its name."""
    import yaml

    from mass_ops.config import apply_overrides, read_config_source

    folder = tmp / "presets"
    folder.mkdir(exist_ok=True)
    data = apply_overrides(read_config_source("demo"), deployment)
    (folder / "e2e.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("MASS_PRESETS_DIR", str(folder))
    return "e2e"


def _episode_identities(ctx) -> Counter:
    """How many final episodes each unit has (a duplicated unit would count 2)."""
    rows = [e for e in ctx.repo.episodes(ctx.cycle_id) if e.status != "infra_failure"]
    return Counter((e.kind, e.task_id, e.seed, e.version, e.candidate, e.generation) for e in rows)


@pytest.fixture(autouse=True)
def _dags_folder(monkeypatch):
    """The demo driver loads DAG files from MASS_DAGS_DIR (default ./dags); these tests run in a temporary folder."""
    monkeypatch.setenv("MASS_DAGS_DIR", str(DAGS_FOLDER))


def _collection_attempts(ctx) -> dict[int, list[tuple[int, str]]]:
    """(attempt, status) of every recorded attempt of task FAST's teacher candidates, per candidate."""
    attempts: dict[int, list[tuple[int, str]]] = {}
    for row in ctx.repo.episodes(ctx.cycle_id, task_id=FAST, kind="collection"):
        attempts.setdefault(row.candidate, []).append((row.attempt, row.status))
    return {candidate: sorted(rows) for candidate, rows in sorted(attempts.items())}


def _fail_first_attempt_of(monkeypatch, slug: str) -> list[str]:
    """The first attempt of the unit `slug` reads a 503 in its proxy log (an infrastructure failure, MASS_SPEC §4
    rule 4); returns the attempt folders it was injected into."""
    from mass_ops.runtime import runner

    real = runner._read_proxy_log
    injected: list[str] = []

    def with_a_dropped_request(path: Path) -> list[dict[str, Any]]:
        records = real(path)
        if f"/{slug}-s" in str(path) and not injected:
            injected.append(str(path.parent))
            records.append({"seq": 0, "path": "/v1/chat/completions", "status": 503, "proxy_error": "injected"})
        return records

    monkeypatch.setattr(runner, "_read_proxy_log", with_a_dropped_request)
    return injected


def _hold_back_search_step(monkeypatch, stages, task: int, version: int, until: Any) -> list[int]:
    """Step `version` of `task` waits until `until(config)` holds: it reschedules itself (the in-process test run
    then runs everything else that is ready), at most MAX_WAITS times; returns one entry per wait."""
    from airflow.sdk.exceptions import AirflowRescheduleException

    real = stages.search_step
    waits: list[int] = []

    def held_back(config, task_id, step_version):
        if (task_id, step_version) == (task, version) and len(waits) < MAX_WAITS and not until(config):
            waits.append(1)
            raise AirflowRescheduleException(reschedule_date=dt.datetime.now(dt.UTC))
        return real(config, task_id, step_version)

    monkeypatch.setattr(stages, "search_step", held_back)
    return waits


def _collection_recorded(config) -> bool:
    """Every teacher candidate of task FAST has a recorded attempt."""
    ctx = attach_cycle(config)
    rows = ctx.repo.episodes(ctx.cycle_id, task_id=FAST, kind="collection")
    return {row.candidate for row in rows} == set(range(config.collection.candidates))


def test_a_cycle_runs_end_to_end_pipelined_and_a_cleared_failure_reruns_only_what_is_missing(
    airflow_db, tmp_path, monkeypatch
):
    from mass_ops_airflow.demo import prepare_parent
    from mass_ops_airflow.demo.airflow_home import failed_tasks, load_dag

    from mass_ops.stages import api as stages

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(JUDGE_KEY_ENV, "test-judge-key")
    injected = _fail_first_attempt_of(monkeypatch, f"collection-t{FAST}-c{FAILING_CANDIDATE}")
    waits = _hold_back_search_step(monkeypatch, stages, SLOW, 1, until=_collection_recorded)
    with serve_policy(models=(MODEL,)) as policy:
        endpoint = f"{policy.base_url}/v1"
        deployment, overrides = _deployment(tmp_path, endpoint), _overrides()
        preset = _register_preset(tmp_path, monkeypatch, deployment)
        config = load_config("demo", [*deployment, *overrides])
        prepare_parent(config)  # the tiny random Qwen3 L0, published where models.parent_bf16 points
        dag = load_dag()
        for task in dag.tasks:  # fail now, not after Airflow's retry back-off
            task.retries = 0

        first = dag.test(run_conf={"preset": preset, "overrides": overrides})

        assert str(first.state) == "failed"
        assert failed_tasks(first) == ["inner_loop.collect_task[0]"], "task 51 (map index 0) lost a candidate"
        assert len(injected) == 1
        tis = {(ti.task_id, ti.map_index): ti for ti in first.get_task_instances()}
        states = {key: str(ti.state) for key, ti in tis.items()}
        assert states[("inference_down", -1)] == "success", "the teardown stops the server even when work fails"
        assert states[("render", -1)] == "upstream_failed"
        assert states[("inner_loop.rank_task", 0)] == "upstream_failed", "an incomplete task is not ranked"
        assert states[("inner_loop.collect_task", 1)] == states[("inner_loop.rank_task", 1)] == "skipped"
        assert states[("inner_loop.step_v1", 1)] == "success"
        # Pipelined: task 51's collection ended while task 202's search was still held back at step v1, and that
        # step was let through by the recorded collection, not by running out of waits.
        assert 0 < len(waits) < MAX_WAITS
        fast_collection, slow_search = tis[("inner_loop.collect_task", 0)], tis[("inner_loop.step_v1", 1)]
        assert fast_collection.end_date < slow_search.end_date
        assert tis[("inner_loop.step_v1", 0)].end_date <= fast_collection.start_date
        ctx = attach_cycle(config)
        before = _episode_identities(ctx)
        assert sum(n for (kind, *_), n in before.items() if kind == "collection") == 1
        assert _collection_attempts(ctx) == {0: [(1, "succeeded")], 1: [(1, "infra_failure")]}
        recorded = {row.id for row in ctx.repo.episodes(ctx.cycle_id)}

        cleared = clear_failed(dag.dag_id, first.run_id)
        assert "inner_loop.collect_task[0]" in cleared and "register[-1]" in cleared
        assert "inner_loop.collect_task[1]" not in cleared
        assert not any(name.startswith("inner_loop.step_") for name in cleared), "succeeded instances are not cleared"
        run = finish_run(dag, first.run_id)
        assert str(run.state) == "success", failed_tasks(run)
        nightly_rows, nightly_work = _nights(preset, deployment, overrides, policy)

    assert str(run.state) == "success", failed_tasks(run)
    tries = {(ti.task_id, ti.map_index): ti.try_number for ti in run.get_task_instances()}
    assert tries[("inner_loop.collect_task", 0)] == 2
    assert tries[("inner_loop.collect_task", 1)] == 1 and tries[("inner_loop.step_v1", 0)] == 1
    assert tries[("inner_loop.step_v1", 1)] == 1, "only the cleared ones reran"
    # The rerun of the collection unit ran only the failed candidate, as its next attempt.
    assert _collection_attempts(ctx) == {0: [(1, "succeeded")], 1: [(1, "infra_failure"), (2, "succeeded")]}
    new = [row for row in ctx.repo.episodes(ctx.cycle_id) if row.id not in recorded and row.kind != "rollout"]
    assert [(row.kind, row.candidate, row.attempt) for row in new] == [("collection", FAILING_CANDIDATE, 2)]

    after = _episode_identities(ctx)
    assert max(after.values()) == 1, "no unit has two final episodes"
    assert {k: n for k, n in after.items() if k in before} == before, "what existed before the repair is untouched"
    kinds = Counter(kind for kind, *_ in after.elements())
    # 2 tasks × (reference + v0 + v1), 2 candidates of task 51, 2 generations × 2 rollout tasks (51, 60) × 1 replicate
    assert kinds == {"reference": 2, "search": 4, "collection": 2, "rollout": 4}

    child = ctx.repo.get_generation("L1")
    assert child is not None and child.parent_id == ctx.repo.get_generation("L0").id
    assert child.lineage["cycle"] == ctx.cycle_name and child.lineage["checkpoint"]["step"] > 0
    for uri in (child.bf16_uri, child.fp8_uri):
        folder = Path(uri.removeprefix("file://"))
        assert (folder / "manifest.json").is_file() and list(folder.glob("*.safetensors")), uri
    (evaluation,) = [e for e in ctx.repo.evaluations(kind="pairwise") if e.cycle_id == ctx.cycle_id]
    assert evaluation.results["pairs"] == 2 and evaluation.results["judges"] == ["stand-in-judge"]
    assert evaluation.results["self_judgments"] == 2, "L1's in-loop judge judged the same pairs"
    report = ctx.artifacts.get_bytes(f"{report_prefix(ctx.cycle_name)}/report.html")
    assert b"L1" in report and b"<img" in report

    # The nightly DAG for a logical date, then the same date again (as `airflow backfill create` over a range that
    # includes a finished date would): the night samples its rollouts once; the rerun does no work. (That every
    # night samples its own rollouts is shown by tests/evaluation/test_nightly.py.)
    (night,) = nightly_rows
    assert night["nightly_date"] == "20261128T030000"
    assert (night["generation_a"], night["generation_b"], night["pairs"]) == ("L1", "L0", 1)
    (calls_1, episodes_1), (calls_2, episodes_2) = nightly_work
    assert episodes_1 == 2, "one test-split rollout of L1 and one of L0"
    assert (calls_2, episodes_2) == (calls_1, episodes_1), "rerunning a finished night ran and asked nothing"


def _nights(
    preset: str, deployment: list[str], overrides: list[str], policy
) -> tuple[list[dict], list[tuple[int, int]]]:
    """Run the nightly DAG for 28 November twice; returns its evaluation results and, after each run,
    the judge stand-in's chat-call count and the number of nightly episodes."""
    from mass_ops_airflow.demo.airflow_home import failed_tasks, load_dag

    from mass_ops.stages.nightly import nightly_config

    nightly = load_dag("mass_nightly_eval")
    for task in nightly.tasks:
        task.retries = 0
    conf = {"preset": preset, "overrides": overrides}
    work = []
    for day in (28, 28):
        night = nightly.test(logical_date=dt.datetime(2026, 11, day, 3, tzinfo=dt.UTC), run_conf=conf)
        assert str(night.state) == "success", failed_tasks(night)
        ctx = attach_cycle(nightly_config(load_config("demo", [*deployment, *overrides])))
        work.append((policy.stats.chat_requests, len(ctx.repo.episodes(ctx.cycle_id))))
    rows = [e.results for e in ctx.repo.evaluations(kind="pairwise") if e.cycle_id == ctx.cycle_id]
    return sorted(rows, key=lambda r: r["nightly_date"]), work
