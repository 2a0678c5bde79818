"""`mass-ops episode run` of a benchmark episode (#18.2), what a benchmark's episode pod runs: the unit is named by
its benchmark task and keeps its trial as candidate; the stage's run options — the generation's server and the task's
time limit — apply to the run while the config stays the cycle's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.runtime import MODEL, PolicyHost, cli_process, open_episode_cycle, write_config

UNIT = ["--kind", "benchmark", "--task", "tb2_hello-world", "--candidate", "0", "--generation", "L1"]


def benchmark_args(config: Path, prompt: Path, scratch: Path) -> list[str]:
    return ["run", "--config", str(config), *UNIT, "--seed", "3100000", "--condition", "tb2_L1_t0",
            "--prompt-file", str(prompt), "--scratch-dir", str(scratch), "--log-format", "json"]  # fmt: skip


def test_a_benchmark_unit_runs_on_the_given_server_under_the_given_limit(policy_host: PolicyHost, tmp_path: Path):
    with policy_host.serve() as server:
        # The config's own endpoint serves nothing: the run can only succeed on the server it is given.
        ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
        config = write_config(ctx, tmp_path)
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("Create hello.txt.\n@agent requests=1 sleep=60")
        args = benchmark_args(config, prompt, tmp_path / "scratch")
        args += ["--endpoint", f"{server.base_url}/v1", "--served-name", MODEL, "--wall-clock-s", "2"]
        process = cli_process(args, tmp_path)
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    [line] = [json.loads(text) for text in stdout.splitlines()]
    assert line["unit"] == f"{ctx.cycle_name}/benchmark-ttb2_hello-world-c0-s3100000-gL1"
    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert (row.task_id, row.kind, row.candidate, row.generation, row.condition) == (
        "tb2_hello-world", "benchmark", 0, "L1", "tb2_L1_t0",
    )  # fmt: skip
    # The agent slept past the task's 2 s limit (the config's is 600 s): the runner stopped it there.
    assert row.status == "model_failure" and row.failure["subtype"] == "wall_clock_limit"
    assert "2 s" in row.failure["message"]


@pytest.mark.parametrize(
    ("extra", "drop", "message"),
    [
        ([], "--condition", "--condition: a benchmark episode needs its trial's condition"),
        ([], "--generation", "--candidate, --generation: a benchmark episode needs its trial and generation"),
        (["--endpoint", "http://x.svc/v1"], None, "--endpoint: give --endpoint and --served-name together"),
        (["--wall-clock-s", "0"], None, "--wall-clock-s: 0 is not a number of seconds ≥ 1"),
    ],
)
def test_bad_benchmark_input_is_one_line_and_exit_2(tmp_path: Path, extra, drop, message) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    args = benchmark_args(write_config(ctx, tmp_path), prompt, tmp_path / "scratch")
    if drop:
        at = args.index(drop)
        del args[at : at + 2]
    process = cli_process([*args, *extra], tmp_path)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2, stderr
    assert message in stderr and len(stderr.strip().splitlines()) == 1
    assert ctx.repo.episodes(ctx.cycle_id) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kind", "reference", "--task", "51", "--wall-clock-s", "60"], "--wall-clock-s: only benchmark episodes"),
        (["--kind", "reference", "--task", "tb2_x"], "--task: 'tb2_x' is not a task id"),
        (["--kind", "benchmark", "--task", "../x", "--candidate", "0", "--generation", "L1"], "not a benchmark task"),
    ],
)
def test_run_options_and_task_names_belong_to_their_kind(tmp_path: Path, args, message) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    command = ["run", "--config", str(write_config(ctx, tmp_path)), *args, "--seed", "1", "--condition", "c"]
    process = cli_process([*command, "--prompt-file", str(prompt)], tmp_path)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and message in stderr and len(stderr.strip().splitlines()) == 1


def test_the_command_line_seeds_a_benchmark_workspace(policy_host: PolicyHost, tmp_path: Path) -> None:
    """What a benchmark pod's sandbox container is given: the seed's URI and hash; the run starts from its files and
    the episode's status document names it (the workspace it publishes holds them)."""
    from tests.runtime.test_runner import _seed_archive, _stored_seed

    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        seed = _stored_seed(ctx, _seed_archive({"repo/calc.py": b"def add(a, b): return a + b\n"}))
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("Fix it.\n@agent requests=1")
        args = benchmark_args(write_config(ctx, tmp_path), prompt, tmp_path / "scratch")
        args += ["--workspace-seed-uri", seed.uri, "--workspace-seed-sha256", seed.sha256]
        process = cli_process(args, tmp_path)
        _stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    [row] = ctx.repo.episodes(ctx.cycle_id)
    status = json.loads(ctx.artifacts.get_bytes(ctx.artifacts.key_of(row.artifacts["status"])))
    assert status["workspace_seed"] == {"uri": seed.uri, "sha256": seed.sha256}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--workspace-seed-uri", "file:///x.tar.gz"],
            "give --workspace-seed-uri and --workspace-seed-sha256 together",
        ),
        (["--workspace-seed-uri", "file:///x", "--workspace-seed-sha256", "XYZ"], "is not a lowercase hex SHA-256"),
    ],
)
def test_a_bad_workspace_seed_is_one_line_and_exit_2(tmp_path: Path, extra, message) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    process = cli_process([*benchmark_args(write_config(ctx, tmp_path), prompt, tmp_path / "s"), *extra], tmp_path)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert ctx.repo.episodes(ctx.cycle_id) == []


def test_a_seed_belongs_to_benchmark_episodes_only(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    command = ["run", "--config", str(write_config(ctx, tmp_path)), "--kind", "reference", "--task", "51",
               "--seed", "1", "--prompt-file", str(prompt),
               "--workspace-seed-uri", "file:///x", "--workspace-seed-sha256", "0" * 64]  # fmt: skip
    process = cli_process(command, tmp_path)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and "--workspace-seed-uri: only benchmark episodes" in stderr, stderr
