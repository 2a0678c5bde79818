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
    # The stage module api.benchmark_trial delegates to (per-task time limits) stops the same way.
    from mass_ops.stages import benchmarks

    with pytest.raises(ContainerEngineMissingError, match="no episode was started") as caught:
        benchmarks.benchmark_trial(config, "swe", "L1", 0, data_dir=str(tmp_path))
    assert "\n" not in str(caught.value)


def test_cli_benchmark_run_stops_in_one_line_and_grader_files_checks_the_hash(tmp_path, monkeypatch):
    import hashlib

    from typer.testing import CliRunner

    from mass_ops.cli import app
    from mass_ops.evaluation.benchmarks.grading import GraderJob, grader_bundle
    from mass_ops.store.artifact_backends import open_artifact_store

    (tmp_path / "swe").mkdir()
    (tmp_path / "swe" / "SWE-bench_Verified.jsonl").write_text(json.dumps(SWE_INSTANCE) + "\n")
    monkeypatch.setenv("MASS_CONTAINER_ENGINE", "no-such-engine-here")
    runner = CliRunner()
    args = ["benchmark", "run", "--benchmark", "swe", "--generation", "L1", "--trial", "0", "--config", "demo"]
    result = runner.invoke(app, [*args, "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "no episode was started" in result.output

    store = open_artifact_store(str(tmp_path / "artifacts"))
    bundle = grader_bundle(GraderJob("swe", "x", "img", "true", {"/tmp/p": b"diff"}))
    info = store.put_bytes("grader/x.tar", bundle)
    out = tmp_path / "in" / "bundle.tar"
    fetch = ["benchmark", "grader-files", "--uri", info.uri, "--out", str(out), "--config", "demo"]
    fetch += ["--set", f"storage.artifact_url={tmp_path / 'artifacts'}"]
    bad = runner.invoke(app, [*fetch, "--sha256", "0" * 64])
    assert bad.exit_code == 2 and "is not the expected" in bad.output and not out.exists()
    good = runner.invoke(app, [*fetch, "--sha256", hashlib.sha256(bundle).hexdigest()])
    assert good.exit_code == 0, good.output
    assert out.read_bytes() == bundle
