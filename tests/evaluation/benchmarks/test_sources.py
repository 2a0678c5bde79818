"""Which adapter a named benchmark gets, and the stage's refusals before any agent time."""

from __future__ import annotations

import json

import pytest

from mass_ops.config import load_config
from mass_ops.errors import InputError
from mass_ops.evaluation.benchmarks.dsbench import DSBench
from mass_ops.evaluation.benchmarks.grading import ContainerEngineMissingError
from mass_ops.evaluation.benchmarks.scoring import BenchmarkError
from mass_ops.evaluation.benchmarks.sources import benchmark_adapter
from mass_ops.evaluation.benchmarks.swe import SWEBench
from mass_ops.stages import api
from tests.evaluation.benchmarks.test_adapters import SWE_INSTANCE


def test_adapters_come_from_the_user_folder_one_subfolder_per_benchmark(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "swe").mkdir()
    monkeypatch.setenv("MASS_BENCHMARK_DATA", str(tmp_path))
    assert benchmark_adapter("ds") == DSBench(tmp_path / "ds")
    assert benchmark_adapter("swe", tmp_path) == SWEBench(tmp_path / "swe")
    for name, message in (("mmlu", "is not one of"), ("tb2", "is not a folder"), ("asta", "is not a folder")):
        with pytest.raises(BenchmarkError, match=message) as caught:
            benchmark_adapter(name)
        assert "\n" not in str(caught.value)
    (tmp_path / "asta").mkdir()
    with pytest.raises(BenchmarkError, match="MASS_ASTA_IMAGE"):
        benchmark_adapter("asta")
    monkeypatch.delenv("MASS_BENCHMARK_DATA")
    with pytest.raises(BenchmarkError, match="no dataset folder"):
        benchmark_adapter("ds")


def test_benchmark_units_and_bad_choices_are_one_line():
    config = load_config("demo")
    assert api.benchmark_units(config, ["swe", "ds", "swe"], 2) == [["swe", 0], ["swe", 1], ["ds", 0], ["ds", 1]]
    for benchmarks, trials in ((["nope"], 1), ([], 1), (["ds"], 0), (["ds"], True)):
        with pytest.raises(InputError):
            api.benchmark_units(config, benchmarks, trials)


def test_a_container_graded_benchmark_stops_before_any_episode_without_an_engine(tmp_path, monkeypatch):
    (tmp_path / "swe").mkdir()
    (tmp_path / "swe" / "SWE-bench_Verified.jsonl").write_text(json.dumps(SWE_INSTANCE) + "\n")
    monkeypatch.setenv("MASS_CONTAINER_ENGINE", "no-such-engine-here")
    # The stage refuses before attaching the cycle or reaching the server: a config whose store does not exist.
    config = load_config("demo", ["storage.metadata_url=sqlite:////nonexistent/dir/meta.db"])
    with pytest.raises(ContainerEngineMissingError, match="no episode was started") as caught:
        api.benchmark_trial(config, "swe", "L1", 0, data_dir=str(tmp_path))
    assert "\n" not in str(caught.value)
    with pytest.raises(InputError, match="limit must be"):
        api.benchmark_trial(config, "swe", "L1", 0, limit=0, data_dir=str(tmp_path))
