"""`mass-ops status`: per stage units planned / done / failed / budget-stopped / pending, tokens and cost from the
episode and LLM-call rows, budgets from the ledger, read from the metadata store only."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from typer.testing import CliRunner

from mass_ops.cli import app
from mass_ops.context import CycleContext
from mass_ops.ops.status import cycle_status
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest
from mass_ops.seeds import collection_seed
from mass_ops.stages.collect import collect_batch
from mass_ops.stages.evaluate import rollout_units
from tests.inner_loop_fakes import FailurePlan, InnerLoopEnv, OpenCycle, inner_loop_fixture  # noqa: F401
from tests.stages import test_collect

runner = CliRunner()
TASK = 51


def config_file(opened: OpenCycle, tmp: Path) -> str:
    """The cycle's config as a JSON file, as an operator passes it with --config."""
    path = tmp / "cycle.json"
    path.write_text(json.dumps(opened.config.model_dump(mode="json")))
    return str(path)


def collected_with_one_failure(
    inner_loop: InnerLoopEnv, failing: tuple[int, ...] = (1,), **overrides: object
) -> OpenCycle:
    """Task 51 searched (recorded directly), 3 teacher candidates collected, c1 failing on infrastructure on every
    attempt: one failed collection unit."""
    options = {"tasks": (TASK,), "candidates": 3, "train_ranks": 1, **overrides}
    base = inner_loop.config(**options).collection.seed_base
    failures = {
        f"collection-t{TASK}-c{c}-s{collection_seed(base, TASK, c)}": FailurePlan(infra_attempts=9) for c in failing
    }
    opened = inner_loop.open(executor_options={"failures": failures}, **options)
    test_collect.retain(opened.ctx, TASK, 1)
    collect_batch(opened.ctx, opened.executor)
    return opened


def budget_stop(ctx: CycleContext, candidate: int, attempt: int) -> None:
    """Record a budget-stopped attempt of a candidate (what the pool records when its proxy refused a request)."""
    ctx.repo.record_episode(
        ctx.cycle_id, task_id=TASK, kind="collection", candidate=candidate, attempt=attempt, status="budget_exhausted",
        seed=collection_seed(ctx.config.collection.seed_base, TASK, candidate), prompt_tokens=5_000,
        completion_tokens=300, model=ctx.config.models.served_name,
    )  # fmt: skip


def test_status_counts_units_tokens_and_budgets_from_the_rows(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    opened = collected_with_one_failure(inner_loop)
    ctx = opened.ctx
    budgets = {"budgets": {"task_tokens": 1_000, "cycle_tokens": 100_000}}
    data = opened.config.model_dump(mode="json") | budgets
    (tmp_path / "cycle.json").write_text(json.dumps(data))
    ctx.repo.record_llm_call(
        ctx.cycle_id, f"task{TASK}/rhi/v1_vs_no_harness", purpose="judge", model="policy-stand-in",
        task_id=TASK, prompt_tokens=1_000, completion_tokens=200, cost_usd=0.25,
    )  # fmt: skip
    ctx.repo.add_budget_spend(ctx.cycle_id, ["cycle", f"task:{TASK}"], tokens=1_200, cost_usd=0.25)

    result = runner.invoke(app, ["status", ctx.cycle_name, "--config", str(tmp_path / "cycle.json"), "--json"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    stages = {s["stage"]: s for s in status["stages"]}
    collect = stages["collect"]
    rows = ctx.repo.episodes(ctx.cycle_id, kind="collection")
    assert (collect["planned"], collect["done"], collect["failed"], collect["budget_exhausted"]) == (3, 2, 1, 0)
    assert collect["pending"] == 0 and collect["in_flight"] == 0
    assert collect["tokens"] == sum((e.prompt_tokens or 0) + (e.completion_tokens or 0) for e in rows)
    search = stages["search"]
    assert (search["planned"], search["done"]) == (2, 2)  # steps v0 and v1, recorded by the retained workflow
    assert (search["prompt_tokens"], search["completion_tokens"], search["cost_usd"]) == (1_000, 200, 0.25)
    assert stages["rank"]["started"] is False and stages["rank"]["planned"] == 1
    (failed,) = [u for u in status["units"] if u["state"] != "pending"]
    assert failed["key"] == f"collection-t{TASK}-c1" and failed["state"] == "failed"
    assert failed["detail"] == "attempt 2 infra_failure"  # max_infra_attempts = 2
    budgets_rows = {b["scope"]: b for b in status["budgets"]}
    assert (budgets_rows["cycle"]["tokens"], budgets_rows["cycle"]["token_limit"]) == (1_200, 100_000)
    assert budgets_rows["cycle"]["exhausted"] is False
    assert (budgets_rows[f"task:{TASK}"]["tokens"], budgets_rows[f"task:{TASK}"]["exhausted"]) == (1_200, True)
    assert status["budgets_from"] == "the given config"
    assert status["tokens"] == sum(s["tokens"] for s in status["stages"])

    text = runner.invoke(app, ["status", ctx.cycle_name, "--config", str(tmp_path / "cycle.json")])
    assert text.exit_code == 0, text.output
    assert f"collect: collection-t{TASK}-c1 failed (attempt 2 infra_failure)" in text.stdout
    assert "an agent episode whose attempt has started and is not recorded yet (its lease)" in " ".join(
        text.stdout.split()
    )


def test_a_budget_stopped_unit_is_counted_apart_and_its_tokens_reach_the_stage(inner_loop: InnerLoopEnv) -> None:
    opened = collected_with_one_failure(inner_loop, failing=(1, 3), candidates=4)
    budget_stop(opened.ctx, 3, attempt=3)  # after its two infrastructure failures
    status = cycle_status(opened.config, opened.ctx.cycle_name)
    collect = status.stage("collect")
    assert (collect.planned, collect.done, collect.failed, collect.budget_exhausted) == (4, 2, 1, 1)
    assert (collect.prompt_tokens, collect.completion_tokens) == (5_000, 300)
    stopped = [u for u in status.units if u.state == "budget_exhausted"]
    assert [u.key for u in stopped] == [f"collection-t{TASK}-c3"]


def test_watch_refreshes_until_its_count(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    opened = collected_with_one_failure(inner_loop)
    args = ["status", opened.ctx.cycle_name, "--config", config_file(opened, tmp_path), "--json"]
    result = runner.invoke(app, [*args, "--watch", "--interval", "0.5", "--watch-count", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["cycle"] == opened.ctx.cycle_name for line in lines)


def test_an_unknown_cycle_is_one_line_and_exit_2(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    opened = collected_with_one_failure(inner_loop)
    result = runner.invoke(app, ["status", "no-such-cycle", "--config", config_file(opened, tmp_path)])
    assert result.exit_code == 2
    assert "cycle 'no-such-cycle': not in the metadata store" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


class LatestAttempts:
    """An executor that runs nothing and answers each request with its latest recorded attempt (what a pool
    reports when a budget stopped an episode's proxy)."""

    def __init__(self, ctx: CycleContext) -> None:
        self.ctx = ctx

    def run(self, requests: list[EpisodeRequest]) -> list[EpisodeOutcome]:
        outcomes = []
        for request in requests:
            unit = request.unit
            (*_, row) = self.ctx.repo.episode_attempts(
                self.ctx.cycle_id, task_id=unit.task_id, kind=unit.kind, seed=unit.seed, candidate=unit.candidate
            )
            outcomes.append(EpisodeOutcome(request, row.id, row.attempt, row.status, {}, {}, reused=True))
        return outcomes


def test_the_collection_summary_counts_budget_stopped_candidates(inner_loop: InnerLoopEnv) -> None:
    opened = collected_with_one_failure(inner_loop, failing=(1, 3), candidates=4)
    budget_stop(opened.ctx, 3, attempt=3)
    (row,) = [result.as_row() for result in collect_batch(opened.ctx, LatestAttempts(opened.ctx))]
    assert (row["succeeded"], row["infra_failures"], row["budget_exhausted"]) == (2, 1, 1)


def test_units_in_flight_are_told_from_units_not_started(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    """Task 51 collected and being ranked (matches recorded, no ranks); task 202 in step 0 of its search (its
    reference and v0 episodes recorded, v1 not proposed); the evaluation judging (calls, no summary); the train split
    rendered, not the val split."""
    opened = inner_loop.open(tasks=(TASK, 202), candidates=2, train_ranks=1)
    ctx = opened.ctx
    test_collect.retain(ctx, TASK, 1)
    for kind, version in (("reference", None), ("search", 0)):
        ctx.repo.record_episode(ctx.cycle_id, task_id=202, kind=kind, version=version, seed=9, status="succeeded")
    for c in range(2):
        ctx.repo.record_episode(ctx.cycle_id, task_id=TASK, kind="collection", candidate=c, seed=c, status="succeeded")
    calls = [(f"task{TASK}/ranking/m0", "judge", TASK), (f"task{TASK}/ranking/m1", "judge", TASK),
             ("eval/L1_vs_L0/t60/judge-a", "external_judge", 60)]  # fmt: skip
    for key, purpose, task in calls:
        ctx.repo.record_llm_call(ctx.cycle_id, key, purpose=purpose, model="m", task_id=task)
    ctx.repo.record_dataset(
        ctx.cycle_id, "train", "datasets/train", episodes=1, windows=1, loss_tokens=5, total_tokens=9
    )

    result = runner.invoke(app, ["status", ctx.cycle_name, "--config", config_file(opened, tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    stages = {s["stage"]: s for s in status["stages"]}
    counts = {name: (stages[name]["in_flight"], stages[name]["pending"]) for name in stages}
    assert counts["search"] == (1, 2), "202's step 0 in flight; its step 1 not started"
    assert counts["rank"] == (1, 1) and counts["render"] == (1, 1) and counts["evaluate"] == (1, 1)
    assert counts["collect"] == (0, 0) and counts["select"] == (0, 1) and counts["train"] == (0, 1)
    running = {u["key"]: u["detail"] for u in status["units"] if u["state"] == "running"}
    assert running == {
        "search-t202-v0": "episodes recorded; v1 not yet",
        f"rank-t{TASK}": "2 ranking calls recorded; no ranks yet",
        "render-val": "",
        "evaluate-pairwise": "1 judge calls recorded; no summary",
    }
    assert [u["key"] for u in status["units"] if u["state"] == "pending" and u["stage"] == "search"] == [
        "search-t202-v1"
    ]

    table = runner.invoke(app, ["status", ctx.cycle_name, "--config", config_file(opened, tmp_path)])
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    units_table = lines[: next(i for i, line in enumerate(lines) if line.startswith("└"))]  # the first table
    headers = [line.split("┃")[1:-1] for line in units_table if line.startswith("┃")]
    names = [" ".join(part.strip() for part in column).strip() for column in zip(*headers, strict=True)]
    assert names[6].startswith("in flig"), names  # the column after pending (narrow terminals abbreviate names)
    (rank_row,) = [line for line in units_table if line.startswith("│ rank ")]
    cells = [cell.strip() for cell in rank_row.split("│")[1:-1]]
    assert (cells[5], cells[6]) == ("1", "1"), "pending 1, of which in flight 1"


def test_a_running_episode_is_in_flight_by_its_lease_and_a_stale_lease_is_not(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    """An episode's row comes when its attempt ends; until then its lease says it runs. c1 failed twice on
    infrastructure and its third attempt runs; c0's first attempt is recorded and its lease outlived the row; one
    rollout runs, another's lease was left by a crash hours ago (the demo's wall clock is 600 s)."""
    opened = collected_with_one_failure(inner_loop)
    ctx = opened.ctx
    now = datetime.now(UTC)
    base = ctx.config.collection.seed_base

    def lease(attempt: int, started: datetime, **unit: object) -> None:
        ctx.repo.start_episode_lease(ctx.cycle_id, attempt=attempt, started_at=started, host="node-a pid 7", **unit)

    lease(3, now - timedelta(minutes=3), task_id=TASK, kind="collection", candidate=1,
          seed=collection_seed(base, TASK, 1))  # fmt: skip
    lease(1, now - timedelta(minutes=1), task_id=TASK, kind="collection", candidate=0,
          seed=collection_seed(base, TASK, 0))  # fmt: skip
    (generation, task, replicate), (generation2, task2, replicate2), *_ = rollout_units(opened.config)
    lease(1, now - timedelta(seconds=20), task_id=task, kind="rollout", candidate=replicate, generation=generation,
          seed=1)  # fmt: skip
    lease(1, now - timedelta(hours=3), task_id=task2, kind="rollout", candidate=replicate2, generation=generation2,
          seed=2)  # fmt: skip

    status = cycle_status(opened.config, ctx.cycle_name, now=now)
    collect, rollout = status.stage("collect"), status.stage("rollout")
    assert (collect.done, collect.failed, collect.pending, collect.in_flight) == (2, 0, 1, 1)
    assert rollout.in_flight == 1 and rollout.pending == rollout.planned
    states = {u.key: (u.state, u.detail) for u in status.units}
    assert states[f"collection-t{TASK}-c1"] == ("running", "attempt 3 started 3m ago on node-a pid 7")
    assert states[f"collection-t{TASK}-c0"][0] == "done", "a lease of a recorded attempt is a lost end, not a run"
    assert states[f"rollout-{generation}-t{task}-r{replicate}"] == (
        "running",
        "attempt 1 started 20s ago on node-a pid 7",
    )
    assert states[f"rollout-{generation2}-t{task2}-r{replicate2}"] == ("pending", ""), "a stale lease: a crash"
    running = [u for u in status.as_dict()["units"] if u["state"] == "running"]
    assert [u["key"] for u in running] == [f"collection-t{TASK}-c1", f"rollout-{generation}-t{task}-r{replicate}"]

    # The CLI reads the same leases (the clock is the real one: only the counts are asserted).
    result = runner.invoke(app, ["status", ctx.cycle_name, "--config", config_file(opened, tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    table = runner.invoke(app, ["status", ctx.cycle_name, "--config", config_file(opened, tmp_path)])
    assert any(line.startswith(f"collect: collection-t{TASK}-c1 running (attempt 3 started") for line in
               table.stdout.splitlines()), table.stdout  # fmt: skip
    stages = {s["stage"]: s for s in json.loads(result.stdout)["stages"]}
    assert (stages["collect"]["failed"], stages["collect"]["in_flight"], stages["rollout"]["in_flight"]) == (0, 1, 1)

    # A local runner renews its lease while it lives: one whose renewals stopped names a runner that died, even
    # under a config without an episode time limit (the paper presets).
    from mass_ops.store.schema import LEASE_LAPSE_S

    ctx.repo.start_episode_lease(ctx.cycle_id, attempt=3, started_at=now - timedelta(hours=5), renewed=True,
                                 host="node-a pid 7", task_id=TASK, kind="collection", candidate=1,
                                 seed=collection_seed(base, TASK, 1))  # fmt: skip
    unlimited = opened.config.model_copy(
        update={"runtime": opened.config.runtime.model_copy(update={"episode_wall_clock_s": None})}
    )
    soon = now - timedelta(hours=5) + timedelta(seconds=LEASE_LAPSE_S - 1)  # just before its first renewal is due
    assert cycle_status(unlimited, ctx.cycle_name, now=soon).stage("collect").in_flight == 1, "renewed recently"
    later = now + timedelta(seconds=1)  # five hours after its last renewal
    assert cycle_status(unlimited, ctx.cycle_name, now=later).stage("collect").in_flight == 0, "its runner died"

    # Once the attempt's row is recorded and its lease ended, the unit is what its row says.
    ctx.repo.end_episode_lease(ctx.cycle_id, task_id=TASK, kind="collection", candidate=1, attempt=3,
                               seed=collection_seed(base, TASK, 1))  # fmt: skip
    assert cycle_status(opened.config, ctx.cycle_name, now=now).stage("collect").failed == 1
