"""RHI search: the champion rule, the optimizer prompt, proposal parsing, resumable steps, malformed model output
and crash-resume, against the scripted policy server and the fake executor (MASS_SPEC §3)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mass_ops.judge.evidence import EvidenceCaps, build_bundle, results_json_appendix
from mass_ops.judge.invalid_verdicts import TooManyInvalidVerdictsError
from mass_ops.llm.calls import CallLedger, CallUnit
from mass_ops.search import (
    ProposalError,
    SearchEpisodeError,
    SearchError,
    SearchFailedError,
    derive_champion,
    parse_proposal,
    search_step,
    search_task,
    search_tasks,
)
from mass_ops.search.driver import _TaskSearch
from mass_ops.search.prompt import (
    BestDesign,
    HistoryEntry,
    OptimizerInputs,
    delta_checklist,
    failure_notice,
    optimizer_user_prompt,
    scoreboard_line,
    takeaways,
)
from mass_ops.seeds import judge_retry_seed
from mass_ops.store.schema import CallStatus
from mass_ops.workflow import END_MARKER, START_MARKER, parse_prompt
from tests.inner_loop_fakes import (  # noqa: F401
    FailurePlan,
    InnerLoopEnv,
    inner_loop_fixture,
    kill_when,
    spawn_stage,
)
from tests.judge.scripted import break_judge, open_judged_cycle
from tests.policy_server import ChatRequest, Fault, FaultRule, PolicyReply, RequestKind

# -- the champion rule ---------------------------------------------------------------------------------------------


def test_no_version_beating_the_reference_retains_nothing() -> None:
    state = derive_champion({0: "A", 1: "tie", 2: "invalid"}, {}, 2)
    assert (state.champion, state.has_win, state.retained, state.arbitration_needed) == (0, False, None, False)


def test_first_winner_becomes_champion_outright() -> None:
    state = derive_champion({0: "A", 1: "A", 2: "B"}, {}, 2)
    assert (state.champion, state.retained, state.arbitration_needed) == (2, 2, False)


def test_a_second_winner_needs_arbitration_at_the_current_version() -> None:
    state = derive_champion({0: "B", 1: "B"}, {}, 1)
    assert (state.champion, state.arbitration_needed) == (0, True)
    assert derive_champion({0: "B", 1: "B"}, {(0, 1): "B"}, 1).champion == 1


@pytest.mark.parametrize("verdict", ["A", "tie", "invalid"])
def test_ties_and_losses_in_arbitration_never_advance_the_champion(verdict: str) -> None:
    state = derive_champion({0: "B", 1: "B", 2: "A"}, {(0, 1): verdict}, 2)
    assert (state.champion, state.retained, state.arbitration_needed) == (0, 0, False)


def test_unresolved_older_rounds_leave_the_champion_unchanged() -> None:
    state = derive_champion({0: "B", 1: "B", 2: "tie"}, {}, 2)
    assert (state.champion, state.arbitration_needed) == (0, False)
    # The next winner is arbitrated against the unchanged champion v0, not against v1.
    state = derive_champion({0: "B", 1: "B", 2: "tie", 3: "B"}, {}, 3)
    assert (state.champion, state.arbitration_needed) == (0, True)


def test_arbitration_chain_follows_the_current_champion() -> None:
    verdicts = {0: "B", 1: "B", 2: "B"}
    assert derive_champion(verdicts, {(0, 1): "B"}, 2).arbitration_needed
    assert derive_champion(verdicts, {(0, 1): "B", (1, 2): "B"}, 2).champion == 2
    assert derive_champion(verdicts, {(0, 1): "B", (0, 2): "B"}, 2).champion == 1  # (0,2) is not the live pairing


# -- proposals -----------------------------------------------------------------------------------------------------

TEMPLATE = parse_prompt(f"Task text.\\nMore.\n\n{START_MARKER}\n[]\n\n{END_MARKER}: uv run everything.")


def test_proposal_design_must_start_with_the_marker_and_loses_an_echoed_suffix() -> None:
    design = f'{START_MARKER}\n[{{"agent_id": "a"}}]\n\n{END_MARKER}: uv run everything.'
    proposal = parse_proposal({"improved_multi_agent_design": design, "evidence_used": "report"}, TEMPLATE)
    assert proposal.design == f'{START_MARKER}\n[{{"agent_id": "a"}}]'
    assert proposal.notes["evidence_used"] == ["report"] and proposal.notes["expected_impact"] == []
    with pytest.raises(ProposalError, match="does not start with the start marker"):
        parse_proposal({"improved_multi_agent_design": "Team: [...]"}, TEMPLATE)
    with pytest.raises(ProposalError, match="non-empty string"):
        parse_proposal({"changes_from_previous": []}, TEMPLATE)
    with pytest.raises(ProposalError, match="JSON object"):
        parse_proposal([design], TEMPLATE)  # type: ignore[arg-type]


def test_optional_guardrails_reject_numeric_caps_and_oversized_designs() -> None:
    capped = {"improved_multi_agent_design": f"{START_MARKER} use at most 3 subagents"}
    assert parse_proposal(capped, TEMPLATE).design.endswith("subagents")
    with pytest.raises(ProposalError, match="at most 3 subagents"):
        parse_proposal(capped, TEMPLATE, reject_numeric_caps=True)
    with pytest.raises(ProposalError, match="more than the limit of 20"):
        parse_proposal(capped, TEMPLATE, max_design_chars=20)


# -- the optimizer prompt ------------------------------------------------------------------------------------------


def _entry(version: int, winner: str, rationale: str, diff: str | None = None) -> HistoryEntry:
    key = f"v{version}_vs_no_harness"
    return HistoryEntry(
        key, version, winner, "judge-model", "2026-11-30T00:00:00", "ref", f"v{version}", rationale, diff
    )


def _evidence(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A small workspace's evidence and results/ appendix, as the optimizer template receives them."""
    (root / "results").mkdir(parents=True)
    (root / "research_report.md").write_text("# Report\nSharpe 1.2\n", encoding="utf-8")
    (root / "results" / "metrics.json").write_text('{"sharpe": 1.2}', encoding="utf-8")
    bundle = build_bundle(root, task_id=51, task_text="Study SPY.", location="x", caps=EvidenceCaps.local("m"))
    return bundle.variables(), results_json_appendix(root, 51).variables()


def test_prompt_sections_come_in_the_reference_order(tmp_path: Path) -> None:
    evidence, appendix = _evidence(tmp_path / "w")
    inputs = OptimizerInputs(
        version=2,
        task_text="Study SPY.",
        current_design=f"{START_MARKER} current",
        evidence=evidence,
        results_appendix=appendix,
        run_status={"exit_code": 0, "trace_has_success_result": True},
        history=[
            _entry(0, "B", "Fine."),
            _entry(1, "B", "Good.", "-a\n+b"),
            _entry(2, "A", "The report is missing Limitations.", "-b\n+c"),
        ],
        scoreboard=[(0, "B"), (1, "B"), (2, "A")],
        retained=1,
        best=BestDesign(1, f"{START_MARKER} best", "v1 beat the baseline and v2 did not.", "champion_only_win"),
        v0_design=f"{START_MARKER} root",
    )
    text = optimizer_user_prompt(inputs)
    markers = [
        "1. Query executed by the coding agent",
        "# Task\nStudy SPY.",
        "# Current multi agent design (v2)",
        "# Previous best multi agent design (v1)",
        "# Original design (v0)",
        "# Save rules",
        "2. Current submission code repo for multi-agent-design-v2 (evidence only)",
        "# Workspace for current iteration (multi-agent-design-v2) (evidence only)\nPath: `x`",
        "# Full JSON artifacts under results/",
        "## `results/metrics.json`",
        "2b. Execution metadata",
        "3. Pairwise history summary vs the no-harness baseline",
        "Record vs no_harness: v0 W · v1 W★ · v2 L",
        "3b. Pairwise history delta checklist",
        "4. Instructions",
        "decisively outperform the no-harness single-agent baseline",
        '"improved_multi_agent_design"',
    ]
    positions = [text.find(marker) for marker in markers]
    assert -1 not in positions, [m for m, p in zip(markers, positions, strict=True) if p < 0]
    assert positions == sorted(positions)
    assert "FAILURE NOTICE" not in text
    assert "design diff v1 -> v2: -b +c" in text  # the reference shortener puts each diff on one line
    assert "# Original design (v0)" in text  # v1 is the best shown, so the v0 root is shown as well
    assert "    * The report is missing Limitations." in text


def test_failure_notice_fires_on_force_quit_or_missing_success() -> None:
    assert failure_notice({"exit_code": 0, "trace_has_success_result": True}) is None
    # Only a trace marked false counts as a failure; an absent or null mark does not (the reference's rule).
    assert failure_notice({"exit_code": 0}) is None and failure_notice({"trace_has_success_result": None}) is None
    assert "FAILURE NOTICE" in (failure_notice({"exit_code": 137, "trace_has_success_result": True}) or "")
    notice = failure_notice({"exit_code": 0, "trace_has_success_result": False}) or ""
    assert "Do not add numerical caps" in notice and "single agent" in notice
    assert "RECURRENT FAILURE" in (failure_notice({"exit_code": 1, "prior_failures": [1]}) or "")
    resolved = failure_notice({"exit_code": 0, "trace_has_success_result": True, "prior_failures": [1]})
    assert resolved is not None and resolved.startswith("RESOLVED FAILURE HISTORY")


def test_scoreboard_takeaways_and_checklist() -> None:
    line = scoreboard_line([(0, "B"), (1, "A"), (2, "tie"), (3, None), (4, "invalid")], retained=0)
    assert line == "Record vs no_harness: v0 W★ · v1 L · v2 T · v3 ? · v4 T!"
    rationale = "A is complete. B is missing the ablation log. B's metrics are NaN. B fails tests. " * 3
    found = takeaways(rationale)
    # Repeated sentences count once (the reference de-duplicates its takeaways).
    assert found == ["B is missing the ablation log.", "B's metrics are NaN.", "B fails tests."]
    checklist = delta_checklist(
        ["The Sharpe in the report is inconsistent with metrics.json.", "Ablation log missing.", "Plot missing."]
    )
    assert checklist.splitlines()[0] == '- deliverables or sections absent: 2 verdict(s); e.g. "Ablation log missing."'
    assert "- report and metrics disagree: 1 verdict(s); e.g." in checklist
    assert delta_checklist([]).startswith("(no recurring defect")


# -- steps against the policy server -------------------------------------------------------------------------------


def _judge_for(rule: dict[str, str]) -> Any:
    """A judge policy by comparison kind: 'baseline' (reference vs version) or 'arbitration' (version vs version)."""

    def winner(request: ChatRequest) -> str:
        text = request.user_text()
        return rule["baseline" if "- Workspace A: no-harness-single-agent-baseline" in text else "arbitration"]

    return winner


def _keys(opened: Any, ledger: str, task: int) -> list[str]:
    return sorted(row.key for row in opened.ctx.repo.comparisons(opened.ctx.cycle_id, ledger, task_id=task))


def test_version_one_in_baseline_and_arbitration_mode_makes_exactly_three_judge_calls(
    inner_loop: InnerLoopEnv,
) -> None:
    inner_loop.policy.judge_winner = lambda request: "B"
    opened = inner_loop.open(tasks=(51,), iterations=1)
    first = search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
    assert (first.proposed_version, first.judge_calls) == (1, 0)
    assert len(inner_loop.judge_requests()) == 0 and len(inner_loop.optimizer_requests()) == 1

    final = search_step(opened.ctx, opened.executor, 51, 1, client=opened.client)
    assert final.final and final.arbitrated and final.proposed_version is None
    assert len(inner_loop.judge_requests()) == 3
    assert len(inner_loop.optimizer_requests()) == 1  # the final step only evaluates
    assert _keys(opened, "rhi", 51) == ["v0_vs_no_harness", "v1_vs_no_harness"]
    assert _keys(opened, "champion", 51) == ["champion_v0_vs_v1"]
    retained = opened.ctx.repo.retained_workflows(opened.ctx.cycle_id)
    assert [(r.task_id, r.version, r.beats_reference, r.last_evaluated_version) for r in retained] == [
        ("51", 1, True, 1)
    ]
    assert [v.version for v in opened.ctx.repo.workflow_versions(opened.ctx.cycle_id, 51)] == [0, 1]
    seeds = {body["seed"] for body in inner_loop.server.requests}
    assert seeds == {450000 + 51}
    episodes = opened.ctx.repo.episodes(opened.ctx.cycle_id)
    assert sorted((e.kind, e.version, e.seed, e.condition) for e in episodes) == [
        ("reference", None, 450051, "t51_bare"),
        ("search", 0, 450051, "t51_v0"),
        ("search", 1, 451051, "t51_v1"),
    ]
    # Arbitration shows the champion as A and the challenger as B.
    arbitration = inner_loop.judge_requests()[-1]["messages"][1]["content"]
    assert "- Workspace A: multi-agent-design-v0\n- Workspace B: multi-agent-design-v1" in arbitration

    # Rerunning any step repeats nothing.
    requests_before = len(inner_loop.server.requests)
    executed_before = list(opened.executor.executed)
    search_task(opened.ctx, opened.executor, 51, client=opened.client)
    assert len(inner_loop.server.requests) == requests_before
    assert opened.executor.executed == executed_before


def test_a_chain_asks_for_each_episode_once_and_its_history_matches_the_episode_rows(
    inner_loop: InnerLoopEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner_loop.policy.judge_winner = _judge_for({"baseline": "B", "arbitration": "B"})
    opened = inner_loop.open(tasks=(51,), iterations=2)
    asked: Counter[str] = Counter()
    run = opened.executor.run

    def counting(requests: Any) -> Any:
        asked.update(request.unit.slug for request in requests)
        return run(requests)

    monkeypatch.setattr(opened.executor, "run", counting)
    result = search_task(opened.ctx, opened.executor, 51, client=opened.client)
    # The reference is judged at every step and v1 is arbitrated again as champion at step 2: still asked for once.
    assert result.retained_version == 2 and _keys(opened, "champion", 51) == ["champion_v0_vs_v1", "champion_v1_vs_v2"]
    assert sorted(asked) == ["reference-t51-s450051", "search-t51-v0-s450051", "search-t51-v1-s451051",
                             "search-t51-v2-s452051"] and set(asked.values()) == {1}  # fmt: skip

    ledger = CallLedger(opened.ctx.repo, opened.ctx.artifacts, opened.ctx.cycle_id, opened.ctx.cycle_name)
    fresh = _TaskSearch(opened.ctx, opened.executor, 51, opened.client, ledger)  # a new process: holds no outcome
    versions, verdicts = fresh.versions(), fresh.verdicts()
    from_rows = fresh.history(versions, verdicts)
    assert [(entry.side_b, entry.episode_b) for entry in from_rows] == [
        (f"v{v}", f"search-t51-v{v}-s45{v}051/a1") for v in range(3)
    ]
    held = _TaskSearch(opened.ctx, opened.executor, 51, opened.client, ledger)
    held.run([held.reference_request()] + [held.version_request(v, held.prompt_of(v, versions)) for v in range(3)])
    monkeypatch.setattr(opened.ctx.repo, "episodes", lambda *a, **k: pytest.fail("held outcomes name every episode"))
    assert held.history(versions, verdicts) == from_rows


def test_tied_arbitration_keeps_the_older_champion_and_shows_it_to_the_optimizer(inner_loop: InnerLoopEnv) -> None:
    inner_loop.policy.judge_winner = _judge_for({"baseline": "B", "arbitration": "tie"})
    opened = inner_loop.open(tasks=(202,), iterations=2)
    result = search_task(opened.ctx, opened.executor, 202, client=opened.client)
    assert (result.retained_version, result.beats_reference) == (0, True)
    assert _keys(opened, "champion", 202) == ["champion_v0_vs_v1", "champion_v0_vs_v2"]
    assert result.scoreboard == "v0:W v1:W v2:W"
    step1_prompt = inner_loop.optimizer_requests()[1]["messages"][1]["content"]
    assert "# Previous best multi agent design (v0)" in step1_prompt
    assert "in direct arbitration the judge preferred v0" in step1_prompt
    assert "Record vs no_harness: v0 W★ · v1 W" in step1_prompt
    assert "# Original design (v0)" not in step1_prompt  # v0 is the best shown above: not repeated as the root
    assert "senior researcher in pharmacy" in inner_loop.judge_requests()[0]["messages"][0]["content"]


def test_the_v0_root_is_shown_while_no_version_has_beaten_the_reference(inner_loop: InnerLoopEnv) -> None:
    # The champion is v0 by default without a win: no previous best is shown, so the v0 root is (MASS_SPEC §3.3).
    inner_loop.policy.judge_winner = lambda request: "A"
    opened = inner_loop.open(tasks=(51,), iterations=2)
    result = search_task(opened.ctx, opened.executor, 51, client=opened.client)
    assert result.retained_version is None
    step1_prompt = inner_loop.optimizer_requests()[1]["messages"][1]["content"]
    assert "# Original design (v0)" in step1_prompt and "# Previous best" not in step1_prompt
    assert "★" not in step1_prompt  # no retained champion: neither a star nor its explanation


def test_a_failed_episode_is_data_for_the_optimizer(inner_loop: InnerLoopEnv) -> None:
    failures = {"search-t51-v0-s450051": FailurePlan(model_failure=True)}
    opened = inner_loop.open(tasks=(51,), iterations=1, executor_options={"failures": failures})
    step = search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
    assert step.episode_status == "model_failure" and step.proposed_version == 1
    prompt = inner_loop.optimizer_requests()[0]["messages"][1]["content"]
    assert "FAILURE NOTICE" in prompt and '"trace_has_success_result": false' in prompt


def test_infrastructure_failures_are_retried_as_new_attempts_then_fail_the_step(inner_loop: InnerLoopEnv) -> None:
    failures = {
        "reference-t51-s450051": FailurePlan(infra_attempts=1),
        "reference-t202-s450202": FailurePlan(infra_attempts=5),
    }
    opened = inner_loop.open(tasks=(51, 202), iterations=1, executor_options={"failures": failures})
    search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
    attempts = opened.ctx.repo.episode_attempts(opened.ctx.cycle_id, task_id=51, kind="reference", seed=450051)
    assert [(a.attempt, a.status) for a in attempts] == [(1, "infra_failure"), (2, "succeeded")]
    assert attempts[1].retry_of_id == attempts[0].id
    with pytest.raises(SearchEpisodeError, match=r"reference-t202-s450202 ended in an infrastructure failure"):
        search_step(opened.ctx, opened.executor, 202, 0, client=opened.client)
    assert opened.ctx.repo.workflow_versions(opened.ctx.cycle_id, 202)[-1].version == 0


def test_steps_out_of_order_or_range_are_refused(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51,), iterations=2)
    with pytest.raises(SearchError, match="v2 does not exist yet; run step 1 first"):
        search_step(opened.ctx, opened.executor, 51, 2, client=opened.client)
    with pytest.raises(SearchError, match=r"outside 0\.\.2"):
        search_step(opened.ctx, opened.executor, 51, 3, client=opened.client)
    with pytest.raises(SearchError, match=r"tasks \[53\] are neither"):
        search_step(opened.ctx, opened.executor, 53, 0, client=opened.client)


MALFORMED = {
    "no start marker": (PolicyReply(content=json.dumps({"improved_multi_agent_design": "A team of agents."})), None),
    "invalid JSON": (None, FaultRule(Fault.INVALID_JSON, kind=RequestKind.OPTIMIZER, times=1)),
    "a JSON list": (PolicyReply(content=json.dumps([{"improved_multi_agent_design": START_MARKER}])), None),
    "empty content": (PolicyReply(content=""), None),
    "reasoning eats the output": (None, FaultRule(Fault.EMPTY_CONTENT, kind=RequestKind.OPTIMIZER, times=1)),
}
MESSAGES = {
    "no start marker": "does not start with the start marker",
    "invalid JSON": "contains no JSON object",
    "a JSON list": "must be a JSON object, got list",
    "empty content": "empty final content",
    "reasoning eats the output": "output ceiling consumed by reasoning",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_optimizer_output_fails_the_step_and_the_rerun_retries_it(
    inner_loop: InnerLoopEnv, case: str
) -> None:
    reply, fault = MALFORMED[case]
    if reply is not None:
        inner_loop.policy.optimizer_replies.append(reply)
    if fault is not None:
        inner_loop.server.config.faults.append(fault)
    opened = inner_loop.open(tasks=(51,), iterations=1)
    with pytest.raises(ProposalError) as failure:
        search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
    message = str(failure.value)
    assert MESSAGES[case] in message and "task 51, step v0->v1" in message and "no version written" in message
    assert "\n" not in message
    assert [v.version for v in opened.ctx.repo.workflow_versions(opened.ctx.cycle_id, 51)] == [0]

    step = search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
    assert step.proposed_version == 1
    ledger = CallLedger(opened.ctx.repo, opened.ctx.artifacts, opened.ctx.cycle_id, opened.ctx.cycle_name)
    attempts = ledger.attempts(CallUnit("task51/optimizer/v0_to_v1", "optimizer", 51))
    assert [a.status for a in attempts] == [CallStatus.INVALID, CallStatus.SUCCEEDED]
    assert len(opened.executor.executed) == 2  # reference and v0 ran once; the rerun reused them


def _judges_v1_against_the_reference(request: ChatRequest) -> bool:
    text = request.user_text()
    return "- Workspace A: no-harness-single-agent-baseline\n- Workspace B: multi-agent-design-v1" in text


def test_an_invalid_verdict_at_fraction_zero_fails_the_step_and_the_rerun_judges_only_that_pair(
    inner_loop: InnerLoopEnv,
) -> None:
    inner_loop.policy.judge_winner = lambda request: "B"
    opened = open_judged_cycle(inner_loop, {"invalid_retries": 2, "max_invalid_fraction": 0.0}, tasks=(51,))
    search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
    fix = break_judge(inner_loop, _judges_v1_against_the_reference)
    with pytest.raises(TooManyInvalidVerdictsError) as failure:
        search_step(opened.ctx, opened.executor, 51, 1, client=opened.client)
    message = str(failure.value)
    assert "\n" not in message and message.startswith("search task 51: verdict task51/rhi/v1_vs_no_harness is invalid")
    assert "1 invalid of 2 planned verdicts exceeds judge.max_invalid_fraction = 0" in message
    # v0's verdict finished and stays; v1's is not recorded, nor is anything that depends on it.
    assert _keys(opened, "rhi", 51) == ["v0_vs_no_harness"] and _keys(opened, "champion", 51) == []
    assert opened.ctx.repo.retained_workflows(opened.ctx.cycle_id) == []
    ledger = CallLedger(opened.ctx.repo, opened.ctx.artifacts, opened.ctx.cycle_id, opened.ctx.cycle_name)
    unit = CallUnit("task51/rhi/v1_vs_no_harness", "judge", 51)
    seeds = [judge_retry_seed(450051, retry) for retry in range(4)]
    assert [(a.status, a.seed) for a in ledger.attempts(unit)] == [(CallStatus.INVALID, s) for s in seeds[:3]]

    fix()
    judged_before = len(inner_loop.judge_requests())
    step = search_step(opened.ctx, opened.executor, 51, 1, client=opened.client)
    assert step.final and step.retained == 1 and step.invalid_verdicts == 0
    # One call for v1 (with the next derived seed) and the arbitration it makes necessary; v0 is not judged again.
    assert len(inner_loop.judge_requests()) == judged_before + 2
    assert [(a.status, a.seed) for a in ledger.attempts(unit)][3:] == [(CallStatus.SUCCEEDED, seeds[3])]
    assert _keys(opened, "rhi", 51) == ["v0_vs_no_harness", "v1_vs_no_harness"]


def test_tolerated_invalid_verdicts_are_recorded_as_ties_and_counted_in_the_summary(inner_loop: InnerLoopEnv) -> None:
    inner_loop.policy.judge_winner = lambda request: "B"
    break_judge(inner_loop, _judges_v1_against_the_reference)
    opened = open_judged_cycle(inner_loop, {"invalid_retries": 1, "max_invalid_fraction": 0.5}, tasks=(51,))
    (result,) = search_tasks(opened.ctx, opened.executor, client=opened.client)
    row = result.as_row()
    assert (row["invalid_verdicts"], row["scoreboard"], row["retained_version"]) == (1, "v0:W v1:T!", 0)
    assert result.steps[-1].invalid_verdicts == 1


def test_one_failing_task_does_not_stop_the_others(inner_loop: InnerLoopEnv) -> None:
    failures = {"search-t202-v0-s450202": FailurePlan(infra_attempts=9)}
    opened = inner_loop.open(tasks=(51, 202), iterations=1, executor_options={"failures": failures})
    with pytest.raises(SearchFailedError) as failure:
        search_tasks(opened.ctx, opened.executor, client=opened.client)
    results = {r.task_id: r for r in failure.value.results}
    assert results[51].error is None and results[51].last_evaluated_version == 1
    assert "infrastructure failure" in (results[202].error or "")
    assert "task 202:" in str(failure.value)


# -- crash and resume ----------------------------------------------------------------------------------------------


def test_a_search_killed_mid_run_resumes_without_duplicates_or_losses(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    inner_loop.server.config.latency_s = 0.05
    opened = inner_loop.open(tasks=(51, 202), iterations=2)
    repo, cycle = opened.ctx.repo, opened.ctx.cycle_id
    child = spawn_stage("search", opened, tmp_path, latency=0.1)
    kill_when(child, lambda: len(repo.comparisons(cycle, "rhi")) >= 2)
    killed_at = len(repo.comparisons(cycle, "rhi")) + len(repo.comparisons(cycle, "champion"))
    assert killed_at < 6  # mid-run: 2 tasks x 3 baseline verdicts when done

    results = search_tasks(opened.ctx, opened.executor, client=opened.client)
    assert [r.last_evaluated_version for r in results] == [2, 2]

    episodes = repo.episodes(cycle)
    assert all(e.attempt == 1 for e in episodes)
    assert Counter((e.task_id, e.kind, e.version) for e in episodes) == Counter(
        [(t, "reference", None) for t in ("51", "202")] + [(t, "search", v) for t in ("51", "202") for v in range(3)]
    )
    ledger = CallLedger(repo, opened.ctx.artifacts, cycle, opened.ctx.cycle_name)
    for task in (51, 202):
        assert _keys(opened, "rhi", task) == [f"v{v}_vs_no_harness" for v in range(3)]
        verdicts = {int(r.key[1]): r.verdict for r in repo.comparisons(cycle, "rhi", task_id=task)}
        arbitrations = {
            (int(k[0]), int(k[1])): r.verdict
            for r in repo.comparisons(cycle, "champion", task_id=task)
            for k in [r.key.removeprefix("champion_v").split("_vs_v")]
        }
        for current in (1, 2):  # every needed arbitration was made, and nothing else
            past = {v: verdicts[v] for v in range(current + 1)}
            assert not derive_champion(past, arbitrations, current).arbitration_needed
        assert [v.version for v in repo.workflow_versions(cycle, task)] == [0, 1, 2]
        for comparison in repo.comparisons(cycle, "rhi", task_id=task) + repo.comparisons(
            cycle, "champion", task_id=task
        ):
            unit = CallUnit(f"task{task}/{comparison.ledger}/{comparison.key}", "judge", task)
            statuses = [row.status for row in ledger.attempts(unit)]
            assert statuses.count(CallStatus.SUCCEEDED) == 1, (comparison.key, statuses)
        for current in (0, 1):
            unit = CallUnit(f"task{task}/optimizer/v{current}_to_v{current + 1}", "optimizer", task)
            assert [row.status for row in ledger.attempts(unit)].count(CallStatus.SUCCEEDED) == 1
    assert len(repo.retained_workflows(cycle)) == 2


def test_keep_design_carries_the_current_design_forward_visibly(inner_loop: InnerLoopEnv) -> None:
    inner_loop.policy.optimizer_replies.append(PolicyReply(content="not json at all"))
    opened = inner_loop.open(tasks=(51,), iterations=1, on_invalid_proposal="keep_design")
    step = search_step(opened.ctx, opened.executor, 51, 0, client=opened.client)
    assert step.proposed_version == 1
    versions = opened.ctx.repo.workflow_versions(opened.ctx.cycle_id, 51)
    assert [v.version for v in versions] == [0, 1]
    assert versions[1].design == versions[0].design
    assert versions[1].diff == "(designs are identical)"
    ledger = CallLedger(opened.ctx.repo, opened.ctx.artifacts, opened.ctx.cycle_id, opened.ctx.cycle_name)
    (attempt,) = ledger.attempts(CallUnit("task51/optimizer/v0_to_v1", "optimizer", 51))
    assert attempt.status == CallStatus.INVALID
    assert versions[1].proposal_call_id == attempt.id
    from mass_ops.evaluation.report.data import _carried_design_notes

    (note,) = _carried_design_notes(opened.ctx)
    assert "Task 51: v1 repeat" in note and "keep_design" in note
