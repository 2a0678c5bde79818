"""Rank and select stages, and the whole inner loop search → collect → rank → select against the scripted policy
server and the fake executor (MASS_SPEC §1, §5, §6)."""

from __future__ import annotations

from collections import Counter

import pytest
import sqlalchemy as sa

from mass_ops.errors import InputError
from mass_ops.judge.invalid_verdicts import TooManyInvalidVerdictsError
from mass_ops.layout import teacher_prompt_key, workflow_version_key
from mass_ops.llm.calls import CallLedger, CallUnit
from mass_ops.ranking import tournament_pairs
from mass_ops.seeds import judge_retry_seed, match_seed, schedule_seed
from mass_ops.stages.collect import collect_batch, run_collect
from mass_ops.stages.rank import (
    RankStageError,
    match_key,
    rank_tasks,
    ranking_candidates,
    run_rank,
    run_select,
    select,
)
from mass_ops.stages.search import run_search
from mass_ops.store.schema import CallStatus, Comparison, LLMCall, Ranking
from tests.fixtures.postgres import postgres_url  # noqa: F401
from tests.fixtures.s3 import moto_s3_server, s3_artifact_url, s3_environment  # noqa: F401
from tests.inner_loop_fakes import (  # noqa: F401
    FailurePlan,
    InnerLoopEnv,
    OpenCycle,
    inner_loop_fixture,
)
from tests.judge.scripted import break_judge, open_judged_cycle
from tests.policy_server import ChatRequest, Fault, FaultRule, RequestKind, ResearchTeamPolicy
from tests.stages.test_collect import retain

TASKS = (51, 202)


def _versions_beat_the_reference(request: ChatRequest) -> str:
    """Every version wins against the bare reference; arbitration and ranking verdicts vary with seed and prompt."""
    text = request.user_text()
    if "- Workspace A: no-harness-single-agent-baseline" in text:
        return "B"
    return ResearchTeamPolicy.seeded_judge_winner(request.seed, text)


def _whole_loop(inner_loop: InnerLoopEnv, iterations: int) -> OpenCycle:
    inner_loop.policy.judge_winner = _versions_beat_the_reference
    opened = inner_loop.open(tasks=TASKS, iterations=iterations, candidates=4, train_ranks=2, opponents=2)
    config, executor, client = opened.config, opened.executor, opened.client
    search_rows = run_search(config, executor=executor, client=client)
    collect_rows = run_collect(config, executor=executor)
    rank_rows = run_rank(config, client=client)
    select_rows = run_select(config)
    assert [row["task"] for row in search_rows] == list(TASKS)
    assert all(row["error"] is None and row["last_evaluated_version"] == iterations for row in search_rows)
    assert [(row["task_id"], row["succeeded"]) for row in collect_rows] == [(51, 4), (202, 4)]
    assert [(row["task"], row["candidates"], row["matches"]) for row in rank_rows] == [(51, 4, 4), (202, 4, 4)]
    assert select_rows == [{"task_id": 51, "train": 2, "val": 1}, {"task_id": 202, "train": 2, "val": 1}]
    return opened


def _check_records(opened: OpenCycle) -> None:
    ctx, repo, cycle = opened.ctx, opened.ctx.repo, opened.ctx.cycle_id
    versions = range(opened.config.search.iterations + 1)
    episodes = repo.episodes(cycle)
    assert Counter(e.kind for e in episodes) == {"reference": 2, "search": 2 * len(versions), "collection": 8}
    assert all(e.attempt == 1 and e.status == "succeeded" for e in episodes)
    for task in TASKS:
        assert sorted(r.key for r in repo.comparisons(cycle, "rhi", task_id=task)) == [
            f"v{v}_vs_no_harness" for v in versions
        ]
        assert [v.version for v in repo.workflow_versions(cycle, task)] == list(versions)
        for version in versions:
            assert ctx.artifacts.exists(workflow_version_key(ctx.cycle_name, task, version))
        assert ctx.artifacts.exists(teacher_prompt_key(ctx.cycle_name, task))

        # The ring tournament with the reference seeds, one self-judge call per pair.
        names = [c.name for c in ranking_candidates(ctx, task)]
        assert names == sorted(f"t{task}_L0_s{710000 + 100 * task + i}" for i in range(4))
        pairs = tournament_pairs(names, 2, seed=schedule_seed(1234, task))
        matches = {r.key: r for r in repo.comparisons(cycle, "ranking", task_id=task)}
        assert sorted(matches) == sorted(match_key(a, b) for a, b in pairs)
        for index, (a, b) in enumerate(pairs):
            row = matches[match_key(a, b)]
            assert (row.side_a, row.side_b, row.seed) == (a, b, match_seed(1234, task, index))
            assert row.verdict in ("A", "B", "tie") and row.llm_call_id is not None

        rankings = repo.rankings(cycle, task)
        assert [r.rank for r in rankings] == [1, 2, 3, 4]
        assert [r.score for r in rankings] == sorted((r.score for r in rankings), reverse=True)
        assert all(r.ci_low <= r.score <= r.ci_high for r in rankings)
        by_rank = {r.rank: r.episode_id for r in rankings}
        selected = {
            s.episode_id: (s.split, s.rank) for s in repo.selections(cycle, "train") + repo.selections(cycle, "val")
        }
        assert {by_rank[1]: ("train", 1), by_rank[2]: ("train", 2), by_rank[3]: ("val", 3)}.items() <= selected.items()
        assert by_rank[4] not in selected

    calls = repo.llm_calls(cycle)
    assert all(call.status == CallStatus.SUCCEEDED for call in calls)
    assert Counter(call.purpose for call in calls)["optimizer"] == 2 * (len(versions) - 1)
    assert Counter(call.purpose for call in calls)["self_judge"] == 8
    for call in calls:
        assert ctx.artifacts.exists(f"cycles/{ctx.cycle_name}/calls/{call.unit_key}/prompt.json")
        assert ctx.artifacts.exists(f"cycles/{ctx.cycle_name}/calls/{call.unit_key}/result.json")


def test_search_collect_rank_select_on_sqlite_and_a_local_folder(inner_loop: InnerLoopEnv) -> None:
    opened = _whole_loop(inner_loop, iterations=2)
    _check_records(opened)
    # Every stage again: nothing is executed or judged twice.
    requests = len(inner_loop.server.requests)
    executed = list(opened.executor.executed)
    assert [row["judged_now"] for row in run_rank(opened.config, client=opened.client)] == [0, 0]
    run_collect(opened.config, executor=opened.executor)
    run_select(opened.config)
    assert len(inner_loop.server.requests) == requests and opened.executor.executed == executed
    _check_records(opened)


@pytest.mark.postgres
def test_search_collect_rank_select_on_postgres_and_s3(
    inner_loop: InnerLoopEnv,
    postgres_url: str,  # noqa: F811
    s3_artifact_url: str,  # noqa: F811
) -> None:
    inner_loop.metadata_url = postgres_url
    inner_loop.artifact_url = s3_artifact_url
    _check_records(_whole_loop(inner_loop, iterations=1))


def test_too_few_completed_candidates_is_a_clear_error(inner_loop: InnerLoopEnv) -> None:
    failures = {f"collection-t51-c{i}-s{715100 + i}": FailurePlan(model_failure=True) for i in (0, 3)}
    opened = inner_loop.open(tasks=(51,), candidates=4, train_ranks=2, executor_options={"failures": failures})
    retain(opened.ctx, 51, 1)
    collect_batch(opened.ctx, opened.executor)
    with pytest.raises(
        RankStageError, match="task 51: 2 completed collection episodes, need at least validation_rank = 3"
    ):
        rank_tasks(opened.ctx, client=opened.client)


def test_select_needs_a_ranking_first(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51,), candidates=3, train_ranks=2)
    retain(opened.ctx, 51, 1)
    with pytest.raises(RankStageError, match="task 51: no ranking recorded"):
        select(opened.ctx)


def test_invalid_self_judge_verdicts_count_as_ties_and_are_visible(inner_loop: InnerLoopEnv) -> None:
    inner_loop.server.config.faults.append(FaultRule(Fault.WRONG_SCHEMA, kind=RequestKind.JUDGE))
    # The demo's tolerance: every verdict may stay invalid (a random model's verdicts are noise).
    opened = open_judged_cycle(
        inner_loop, {"invalid_retries": 0, "max_invalid_fraction": 1.0}, tasks=(51,), candidates=4, train_ranks=2
    )
    retain(opened.ctx, 51, 1)
    collect_batch(opened.ctx, opened.executor)
    (result,) = rank_tasks(opened.ctx, client=opened.client)
    assert (result.matches, result.invalid, result.as_row()["invalid_verdicts"]) == (4, 4, 4)
    assert {r.verdict for r in opened.ctx.repo.comparisons(opened.ctx.cycle_id, "ranking")} == {"invalid"}
    scores = [r.score for r in opened.ctx.repo.rankings(opened.ctx.cycle_id, 51)]
    assert max(scores) - min(scores) < 1e-9  # all ties: equal strengths, order by name
    names = [c.name for c in ranking_candidates(opened.ctx, 51)]
    ranked_names = [e.name for e in result.ranked]
    assert ranked_names == sorted(names)


def test_invalid_verdicts_beyond_the_limit_fail_the_task_and_a_rerun_after_the_fix_finishes_it(
    inner_loop: InnerLoopEnv,
) -> None:
    opened = open_judged_cycle(
        inner_loop, {"invalid_retries": 1, "max_invalid_fraction": 0.0}, tasks=(51,), candidates=4, train_ranks=2
    )
    ctx = opened.ctx
    retain(ctx, 51, 1)
    collect_batch(ctx, opened.executor)
    # The judge writes prose instead of a verdict for match 0, whatever seed it samples with.
    broken_seed = match_seed(1234, 51, 0)
    fix = break_judge(inner_loop, lambda request: request.seed in {judge_retry_seed(broken_seed, r) for r in range(9)})
    with pytest.raises(TooManyInvalidVerdictsError) as failure:
        rank_tasks(ctx, client=opened.client)
    message = str(failure.value)
    names = [c.name for c in ranking_candidates(ctx, 51)]
    broken_key = match_key(*tournament_pairs(names, 2, seed=schedule_seed(1234, 51))[0])
    assert isinstance(failure.value, InputError) and "\n" not in message
    assert message.startswith(f"rank task 51: verdict task51/ranking/{broken_key} is invalid (judge output invalid")
    assert "1 invalid of 4 planned verdicts exceeds judge.max_invalid_fraction = 0" in message
    # The other matches finished and stay recorded; the broken one is not recorded, the task is not ranked.
    recorded = {row.key: row.verdict for row in ctx.repo.comparisons(ctx.cycle_id, "ranking")}
    assert len(recorded) == 3 and broken_key not in recorded and "invalid" not in recorded.values()
    assert ctx.repo.rankings(ctx.cycle_id, 51) == []
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    unit = CallUnit(f"task51/ranking/{broken_key}", "self_judge", 51)
    assert [(a.status, a.seed) for a in ledger.attempts(unit)] == [
        (CallStatus.INVALID, broken_seed),
        (CallStatus.INVALID, judge_retry_seed(broken_seed, 1)),
    ]

    fix()
    requests = len(inner_loop.judge_requests())
    (result,) = rank_tasks(ctx, client=opened.client)
    assert (result.judged_now, result.invalid, len(inner_loop.judge_requests())) == (1, 0, requests + 1)
    assert [(a.status, a.seed) for a in ledger.attempts(unit)][2:] == [
        (CallStatus.SUCCEEDED, judge_retry_seed(broken_seed, 2))
    ]
    assert len(ctx.repo.rankings(ctx.cycle_id, 51)) == 4


def test_an_interrupted_ranking_judges_only_the_missing_matches(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51,), candidates=4, train_ranks=2)
    retain(opened.ctx, 51, 1)
    collect_batch(opened.ctx, opened.executor)
    ctx = opened.ctx
    (first,) = rank_tasks(ctx, client=opened.client)
    assert first.judged_now == 4
    requests = len(inner_loop.judge_requests())

    # Recreate two crash points: match 1's call finished but its comparison row was never written; match 2 was
    # never judged at all (no call, no row).
    names = [c.name for c in ranking_candidates(ctx, 51)]
    pairs = tournament_pairs(names, 2, seed=schedule_seed(1234, 51))
    lost_row, never_judged = match_key(*pairs[1]), match_key(*pairs[2])
    with ctx.repo.store.write() as session:
        session.execute(sa.delete(Ranking).where(Ranking.cycle_id == ctx.cycle_id))
        session.execute(sa.delete(Comparison).where(Comparison.key.in_([lost_row, never_judged])))
        session.execute(sa.delete(LLMCall).where(LLMCall.unit_key == f"task51/ranking/{never_judged}/a1"))

    (again,) = rank_tasks(ctx, client=opened.client)
    assert again.judged_now == 2
    assert len(inner_loop.judge_requests()) == requests + 1  # the finished call was reused, not repeated
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    for key in (lost_row, never_judged):
        attempts = ledger.attempts(CallUnit(f"task51/ranking/{key}", "self_judge", 51))
        assert [a.status for a in attempts] == [CallStatus.SUCCEEDED]
    assert [(e.name, e.rank) for e in again.ranked] == [(e.name, e.rank) for e in first.ranked]


def test_skipped_tasks_are_not_ranked_or_selected(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=TASKS, candidates=3, train_ranks=2)
    retain(opened.ctx, 51, None)
    retain(opened.ctx, 202, 1)
    collect_batch(opened.ctx, opened.executor)
    assert [r.task_id for r in rank_tasks(opened.ctx, client=opened.client)] == [202]
    selection = select(opened.ctx)
    assert selection.counts_by_task() == {202: (2, 1)}
