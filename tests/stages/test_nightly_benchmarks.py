"""The nightly benchmark slice as its stages run it: the units are the params' benchmarks × tonight's served
generations under the night's own trial index; each unit runs on tonight's servers and is recorded in the nightly
cycle (never in a full benchmark run's trials); a rerun of the night repeats nothing, the next night is a new trial.
DSBench fixtures: its grader needs no container, so both the in-process trial and the per-instance stages run."""

from __future__ import annotations

from contextlib import contextmanager
from datetime import date
from pathlib import Path

import pytest

from mass_ops.errors import InputError
from mass_ops.evaluation.benchmarks.scoring import BENCHMARK_KIND, recorded_trials
from mass_ops.stages import benchmarks as benchmark_stages
from mass_ops.stages.nightly import (
    NIGHTLY_SCOPE,
    NIGHTLY_TRIAL_BASE,
    NightlyError,
    benchmark_slice_units,
    check_benchmark_slice,
    nightly_benchmark_instance,
    nightly_benchmark_trial,
    nightly_benchmark_trial_record,
    nightly_benchmark_trial_tasks,
    nightly_benchmark_units,
    nightly_config,
    nightly_trial,
)
from tests.evaluation.benchmarks.test_adapters import write_dsbench
from tests.evaluation.fakes import BenchmarkExecutor, eval_env_fixture, record_local_server  # noqa: F401  (fixture)
from tests.inner_loop_fakes import open_test_cycle

NIGHT_1 = "2026-11-30T03:00:00+00:00"
NIGHT_2 = "2026-12-01T03:00:00+00:00"
QUESTIONS = ["ds_00000001_question1", "ds_00000001_question2"]


@pytest.fixture
def data_dir(tmp_path: Path) -> str:
    write_dsbench(tmp_path / "benchmarks" / "ds")
    return str(tmp_path / "benchmarks")


def test_a_night_has_its_own_trial_index_above_every_full_run_trial():
    first = nightly_trial(NIGHT_1)
    assert first == NIGHTLY_TRIAL_BASE + (date(2026, 11, 30) - date(2000, 1, 1)).days
    assert nightly_trial(NIGHT_2) == first + 1
    assert nightly_trial("2026-11-30T23:30:00-02:00") == first + 1  # the night's UTC day (01:30 on Dec 1st)
    assert nightly_trial("2026-11-30T00:00:00") == first  # a date without offset is UTC
    # Episode seeds are 3,100,000 + b·10,000 + trial·1,000 + task: still below 2**31 for centuries of nights.
    assert 3_100_000 + 3 * 10_000 + nightly_trial("2500-01-01T00:00:00+00:00") * 1_000 + 999 < 2**31


def test_the_units_are_the_params_benchmarks_for_every_served_generation(eval_env, data_dir):
    ctx = open_test_cycle(nightly_config(eval_env.config))
    trial = nightly_trial(NIGHT_1)
    units = benchmark_slice_units(ctx, ["L1"], ["ds", "ds"], 3, NIGHT_1, data_dir)
    # L1 and its parent L0, the servers tonight serves; one trial each, the first 3 instances; duplicates once.
    assert units == [
        {"benchmark": "ds", "generation": "L1", "trial": trial, "limit": 3, "data_dir": data_dir},
        {"benchmark": "ds", "generation": "L0", "trial": trial, "limit": 3, "data_dir": data_dir},
    ]
    assert benchmark_slice_units(ctx, ["L1"], [], 5, NIGHT_1, data_dir) == []  # no slice: nothing to map
    assert benchmark_slice_units(ctx, ["L1"], None, 5, NIGHT_1) == []


@pytest.mark.parametrize(
    ("benchmarks", "instances", "message"),
    [
        (["ds", "mmlu"], 5, r"benchmark_slice \['mmlu'\] unknown; choose from \['tb2', 'swe', 'ds', 'asta'\]"),
        (["ds"], 0, "benchmark_slice_instances must be a whole number ≥ 1, got 0"),
        (["ds"], True, "benchmark_slice_instances must be a whole number ≥ 1, got True"),
        (["swe"], 5, "benchmark swe: .* is not a folder"),  # its dataset is not there
    ],
)
def test_an_invalid_slice_is_refused_in_one_line(data_dir, benchmarks, instances, message):
    with pytest.raises(InputError, match=message) as refused:
        check_benchmark_slice(benchmarks, instances, data_dir)
    assert "\n" not in str(refused.value)
    if "mmlu" in str(benchmarks):
        assert isinstance(refused.value, NightlyError)


class SliceRun:
    """Tonight's servers (local state files in scope `nightly`) and the episodes the slice ran on them."""

    def __init__(self, eval_env, monkeypatch, tmp_path: Path) -> None:
        monkeypatch.chdir(tmp_path)  # the servers' state files live under runs/ of the cwd
        self.endpoints = {name: f"http://127.0.0.1:{port}/v1" for name, port in (("L1", 18001), ("L0", 18000))}
        for name, endpoint in self.endpoints.items():
            record_local_server(NIGHTLY_SCOPE, name, endpoint=endpoint, served_name=f"served-{name}")
        self.executed: list[tuple[str, str]] = []  # (endpoint the episode was pointed at, episode unit)
        answers = {QUESTIONS[0]: b"42", QUESTIONS[1]: b"B"}

        @contextmanager
        def executor(ctx):
            fake = BenchmarkExecutor(ctx, lambda request: {"answer.txt": answers[str(request.unit.task_id)]})
            yield fake
            self.executed.extend((ctx.config.inference.endpoint, unit) for unit in fake.executed)

        monkeypatch.setattr(benchmark_stages, "episode_executor", executor)


def test_the_slice_runs_on_tonights_servers_in_the_nightly_cycle_and_a_rerun_is_a_no_op(
    eval_env, data_dir, monkeypatch, tmp_path
):
    run = SliceRun(eval_env, monkeypatch, tmp_path)
    config = eval_env.config
    units = nightly_benchmark_units(config, ["L1"], ["ds"], 1, NIGHT_1, data_dir)
    trial = nightly_trial(NIGHT_1)
    results = [
        nightly_benchmark_trial(config, u["benchmark"], u["generation"], u["trial"], u["limit"], u["data_dir"])
        for u in units
    ]
    assert [(r["generation"], r["trial"], r["attempted"], r["mean"]) for r in results] == [
        ("L1", trial, 1, 1.0),
        ("L0", trial, 1, 1.0),
    ]
    # One instance per generation (the first), each on that generation's nightly server.
    assert [endpoint for endpoint, _ in run.executed] == [run.endpoints["L1"], run.endpoints["L0"]]
    night = open_test_cycle(nightly_config(config))
    assert {(t.benchmark, t.generation, t.trial) for t in recorded_trials(night)} == {
        ("ds", "L1", trial),
        ("ds", "L0", trial),
    }
    assert recorded_trials(eval_env.ctx) == []  # nothing in the run's own cycle, where a full run's trials go
    rows = len(eval_env.ctx.repo.evaluations(kind=BENCHMARK_KIND))
    episodes = len(night.repo.episodes(night.cycle_id, kind="benchmark"))
    assert episodes == 2

    # A rerun of the same night (a cleared task, a backfill): every instance is recorded, nothing runs again.
    again = [
        nightly_benchmark_trial(config, u["benchmark"], u["generation"], u["trial"], u["limit"], u["data_dir"])
        for u in nightly_benchmark_units(config, ["L1"], ["ds"], 1, NIGHT_1, data_dir)
    ]
    assert again == results and len(run.executed) == 2
    assert len(eval_env.ctx.repo.evaluations(kind=BENCHMARK_KIND)) == rows
    assert len(night.repo.episodes(night.cycle_id, kind="benchmark")) == episodes


def test_the_per_instance_stages_record_the_night_once(eval_env, data_dir, monkeypatch, tmp_path):
    """The stages BenchmarkTrialOperator drives one instance at a time (its Kubernetes path), for the next night."""
    run = SliceRun(eval_env, monkeypatch, tmp_path)
    config = eval_env.config
    trial = nightly_trial(NIGHT_2)
    tasks = nightly_benchmark_trial_tasks(config, "ds", 2, data_dir)["tasks"]
    assert tasks == QUESTIONS
    scored = [nightly_benchmark_instance(config, "ds", "L1", trial, task, data_dir) for task in tasks]
    assert [(s["status"], s["score"]) for s in scored] == [("recorded", 1.0), ("recorded", 1.0)]
    recorded = nightly_benchmark_trial_record(config, "ds", "L1", trial, 2, data_dir)
    assert (recorded["trial"], recorded["attempted"], recorded["scored"], recorded["mean"]) == (trial, 2, 2, 1.0)
    assert len(run.executed) == 2
    # Retried: the instances are found recorded (no episode), the trial row is the same one.
    assert [nightly_benchmark_instance(config, "ds", "L1", trial, task, data_dir) for task in tasks] == scored
    assert nightly_benchmark_trial_record(config, "ds", "L1", trial, 2, data_dir) == recorded
    assert len(run.executed) == 2
    night = open_test_cycle(nightly_config(config))
    assert [(t.generation, t.trial) for t in recorded_trials(night)] == [("L1", trial)]


def test_a_full_run_trial_index_is_refused_by_the_slice_stages(eval_env, data_dir):
    with pytest.raises(NightlyError, match="trial 0 is not a nightly trial"):
        nightly_benchmark_trial_record(eval_env.config, "ds", "L1", 0, 1, data_dir)


def test_the_nightly_report_shows_the_slices_scores(eval_env, data_dir, monkeypatch, tmp_path):
    from mass_ops.stages.api import nightly_report

    SliceRun(eval_env, monkeypatch, tmp_path)
    config = eval_env.config
    for u in nightly_benchmark_units(config, ["L1"], ["ds"], 2, NIGHT_1, data_dir):
        nightly_benchmark_trial(config, u["benchmark"], u["generation"], u["trial"], u["limit"], u["data_dir"])
    written = nightly_report(config)
    night = open_test_cycle(nightly_config(config))
    assert written["cycle"] == night.cycle_name
    lines = night.artifacts.get_bytes(night.artifacts.key_of(written["markdown"])).decode().splitlines()
    # The paper's table of the nightly cycle: tonight's trial of each served generation, both tasks scored.
    assert "| ds | L0 | 1 | 1.000 ± n/a | 2/2 | 1000 | 1.0000 | 1.00× |" in lines
    assert "| ds | L1 | 1 | 1.000 ± n/a | 2/2 | 1000 | 1.0000 | 1.00× |" in lines
