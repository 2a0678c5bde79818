"""The report: Markdown + HTML with every figure as a real PNG, built from a cycle holding RHI ledgers, a let-through
task, a pairwise evaluation with self-judge agreement, benchmark trials, a training run and usage records."""

from __future__ import annotations

import base64
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mass_ops.config import validate_config
from mass_ops.context import CycleContext
from mass_ops.evaluation.benchmarks import TaskScore, TrialResult, record_trial, run_trial
from mass_ops.evaluation.external import open_external_judge, self_judge
from mass_ops.evaluation.report import FIGURES, collect_report_data
from mass_ops.evaluation.stats import Judgment, summarize_judgments
from mass_ops.layout import training_prefix
from mass_ops.llm import RetryPolicy
from mass_ops.llm.calls import CallLedger
from mass_ops.stages.evaluate import (
    judge_pairs,
    pair_rollouts,
    run_rollouts,
    summarize,
    workspace_alias,
    write_report,
)
from tests.evaluation.fakes import GPT_JUDGE, BenchmarkExecutor, EvalEnv, alias_judge, aliases_of, preferring
from tests.inner_loop_fakes import FakeExecutor, open_test_cycle

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = datetime(2026, 10, 1, 8, 0, tzinfo=UTC)


def report_cycle(env: EvalEnv) -> CycleContext:
    """A second cycle in the same stores whose config lets tasks through without beating the reference."""
    data = env.config.model_dump(mode="json")
    data["name"] = "report-test"
    data["collection"]["require_beats_reference"] = False
    data["search"]["iterations"] = 2
    return open_test_cycle(validate_config(data))


def populate_search(ctx: CycleContext) -> None:
    repo, cycle = ctx.repo, ctx.cycle_id
    verdicts = {51: ("A", "B", "tie"), 202: ("A", "A")}
    for task, results in verdicts.items():
        for version, verdict in enumerate(results):
            episode = repo.record_episode(
                cycle, task_id=task, kind="search", seed=450000 + task + 1000 * version, version=version,
                status="succeeded", prompt_tokens=90_000, completion_tokens=12_000,
                started_at=T0 + timedelta(hours=version), finished_at=T0 + timedelta(hours=version, minutes=50),
            )  # fmt: skip
            repo.record_comparison(cycle, task, "rhi", f"v{version}_vs_no_harness", side_a="reference",
                                   side_b=f"v{version}", judge_model="m", verdict=verdict,
                                   episode_b_id=episode.id)  # fmt: skip
            repo.record_llm_call(cycle, f"task{task}/rhi/v{version}/a1", purpose="judge", model="m",
                                 task_id=task, prompt_tokens=40_000, completion_tokens=3_000, latency_s=120.0,
                                 cost_usd=0.0)  # fmt: skip
        repo.record_llm_call(cycle, f"task{task}/optimizer/a1", purpose="optimizer", model="m", task_id=task,
                             prompt_tokens=60_000, completion_tokens=9_000, latency_s=300.0)  # fmt: skip
    repo.record_retained_workflow(cycle, 51, version=1, beats_reference=True, last_evaluated_version=2)
    repo.record_retained_workflow(cycle, 202, version=None, beats_reference=False, last_evaluated_version=1)
    for candidate in range(2):  # the demo-style let-through: task 202 was collected anyway
        repo.record_episode(cycle, task_id=202, kind="collection", seed=710000 + 20200 + candidate,
                            candidate=candidate, status="succeeded", completion_tokens=20_000,
                            started_at=T0 + timedelta(hours=4), finished_at=T0 + timedelta(hours=5))  # fmt: skip


def populate_training(ctx: CycleContext) -> None:
    repo = ctx.repo
    run = repo.ensure_training_run(ctx.cycle_id, "sft", {"steps": 6})
    rows = [{"step": 0, "val_loss": 2.4, "val_tokens": 500}]
    rows += [
        {"step": s, "loss": 2.5 - 0.2 * s, "lr": 1e-3, "tokens_per_s": 900.0 + 20 * s, "step_s": 2.0, "windows": 3,
         "supervised_tokens_per_s": 300.0 + 10 * s, "mfu": 0.30 + 0.01 * s, "peak_mem_gib": 1.25 + 0.05 * s}
        for s in range(1, 7)
    ]  # fmt: skip
    rows += [{"step": 3, "val_loss": 1.9, "val_tokens": 500}, {"step": 6, "val_loss": 2.0, "val_tokens": 500}]
    log = ctx.artifacts.put_bytes(f"{training_prefix(ctx.cycle_name)}/sft/train_log.jsonl",
                                  "".join(json.dumps(r) + "\n" for r in rows).encode())  # fmt: skip
    repo.set_training_run_status(run.id, "running", log_uri=log.uri)
    repo.set_training_run_status(run.id, "succeeded")
    repo.record_checkpoint(run.id, 0, val_loss=2.4, val_tokens=500)
    for step, val in ((3, 1.9), (6, 2.0)):
        repo.record_checkpoint(run.id, step, uri=f"file:///ckpt/{step}", train_loss=2.5 - 0.2 * step, val_loss=val,
                               val_tokens=500)  # fmt: skip


def record_answer(
    ctx: CycleContext, key: str, winner: str | None, *, purpose: str = "self_judge", usage: dict | None = None
) -> None:
    """One judge attempt as the call ledger records it: the answer document, then the row (invalid: no answer)."""
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    parsed = None if winner is None else {"winner": winner, "rationale": "because"}
    ctx.artifacts.put_json(ledger.result_key(key), {"unit_key": key, "parsed": parsed})
    ctx.repo.record_llm_call(ctx.cycle_id, key, purpose=purpose, model="m", task_id=51,
                             status="invalid" if winner is None else "succeeded", usage=usage,
                             prompt_tokens=(usage or {}).get("prompt_tokens"))  # fmt: skip


def populate_position_bias(ctx: CycleContext) -> None:
    """Ranking pairs judged in both orders (raw answers of the swapped call, before mapping back), and one
    external judgment: 2 flips in 3 usable rank checks (one reversal that favoured the first-shown workspace, one
    tie against a winner), one check with an invalid swapped answer; the external one is consistent."""
    for pair, forward, swapped in (("p1", "A", "A"), ("p2", "B", "A"), ("p3", "tie", "B"), ("p4", "A", None)):
        record_answer(ctx, f"task51/ranking/{pair}/a1", forward)
        record_answer(ctx, f"task51/ranking/{pair}/swapped/a1", swapped)
    record_answer(ctx, "task51/ranking/p5/a1", "A")  # not in the sample: no swapped call
    record_answer(ctx, "eval/external/x1/gpt-judge/42/a1", "B", purpose="external_judge")
    record_answer(ctx, "eval/external/x1/gpt-judge/42/swapped/a1", "A", purpose="external_judge")


def populate_ranking(ctx: CycleContext) -> None:
    """Task 51's four teacher trajectories with Bradley–Terry scores and bootstrap intervals."""
    for candidate, (score, low, high) in enumerate(((0.9, 0.2, 1.6), (0.3, -0.4, 1.0), (-0.2, -0.9, 0.5),
                                                    (-1.0, -1.8, -0.3))):  # fmt: skip
        episode = ctx.repo.record_episode(ctx.cycle_id, task_id=51, kind="collection", seed=715100 + candidate,
                                          candidate=candidate, status="succeeded")  # fmt: skip
        ctx.repo.record_ranking(ctx.cycle_id, episode.id, score=score, rank=candidate + 1, ci_low=low, ci_high=high)


def populate_evaluation(env: EvalEnv, ctx: CycleContext) -> None:
    executor = FakeExecutor(ctx)
    run_rollouts(ctx, executor, "L1", count=2, label="l1")
    run_rollouts(ctx, executor, "L0", count=2, label="l0")
    pairs = pair_rollouts(ctx, "l1", "l0")
    winners = aliases_of(pairs, "a")
    env.policy.judge_winner = lambda request: alias_judge(preferring(winners))(request.user_text())
    gpt = open_external_judge(env.config.evaluation.judges[0], retry=RetryPolicy(max_attempts=1))
    judge_pairs(ctx, pairs, [gpt])
    # The self-judge agrees on task 51 and prefers L0 on task 60.
    self_winners = {workspace_alias(p.a if p.task == 51 else p.b) for p in pairs}
    env.policy.judge_winner = lambda request: alias_judge(preferring(self_winners))(request.user_text())
    judge_pairs(ctx, pairs, [self_judge(env.config, env.client)], seeds=[42])
    summarize(ctx, pairs, label="l1-vs-l0", judges=[GPT_JUDGE], bootstrap_samples=200)
    # An evaluation of the next generation recorded by another cycle: the trend figure shows both.
    l2 = ctx.repo.register_generation("L2", 2, bf16_uri="models/L2-bf16", parent_id=ctx.repo.get_generation("L1").id)
    judged = [Judgment(f"p{i}", 51 if i % 2 else 60, "gpt", 42, "AAB"[i % 3], "L2") for i in range(30)]
    summary = summarize_judgments(judged, lambda t: "test" if t == 60 else "train", bootstrap_samples=200)
    ctx.repo.record_evaluation("cycle2/pairwise/l2-vs-l1", "pairwise", generation_id=l2.id,
                               results={"label": "l2-vs-l1", "cycle": "cycle2", "generation_a": "L2",
                                        "generation_b": "L1", "pairs": 30, "judges": ["gpt"], "seeds": [42],
                                        "summary": summary.as_dict(), "agreement": {}})  # fmt: skip


def populate_benchmarks(ctx: CycleContext) -> None:
    from mass_ops.evaluation.benchmarks import load_sab_instances, sab_tasks
    from tests.evaluation.fakes import FIXTURES

    tasks = sab_tasks(load_sab_instances(FIXTURES / "sab"))
    plan = {"L0": (8000, ((1, 0, 0), (0, 0, 0))), "L1": (5000, ((1, 1, 0), (1, 1, 1)))}
    for generation, (tokens, trials) in plan.items():
        executor = BenchmarkExecutor(ctx, lambda r: {"x.txt": b"x"}, tokens_for=lambda r, t=tokens: t)
        for trial, successes in enumerate(trials):
            outcomes = run_trial(ctx, executor, tasks, generation, trial)
            scores = tuple(
                TaskScore(o.request.unit.task_id, float(s), o.episode_id)
                for o, s in zip(outcomes, successes, strict=True)
            )
            record_trial(ctx, TrialResult("sab", generation, trial, scores, {}))


def read(uri: str) -> bytes:
    return Path(uri.removeprefix("file://")).read_bytes()


def provenance_section(markdown: str) -> str:
    """The section after the headline: what the cycle ran with and what it spent."""
    return markdown.split("\n## Provenance and spend\n", 1)[1].split("\n## ", 1)[0]


def test_report_renders_every_figure_and_section(eval_env):
    ctx = report_cycle(eval_env)
    populate_search(ctx)
    populate_training(ctx)
    populate_evaluation(eval_env, ctx)
    populate_benchmarks(ctx)
    populate_ranking(ctx)
    populate_position_bias(ctx)
    ctx.repo.record_llm_call(ctx.cycle_id, "eval/manual/a1", purpose="external_judge", model="gpt", cost_usd=0.42,
                             prompt_tokens=1000, completion_tokens=100)  # fmt: skip

    uris = write_report(ctx)
    assert set(uris["figures"]) == {name for name, _ in FIGURES}
    for uri in uris["figures"].values():
        data = read(uri)
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
    page = read(uris["html"]).decode()
    # Self-contained: each figure is embedded as a data URI (the very bytes published), inside a link to its file.
    embedded = dict(re.findall(r'<a href="(figures/[a-z_]+\.png)"><img src="data:image/png;base64,([^"]+)"', page))
    assert sorted(embedded) == sorted(f"figures/{name}.png" for name, _ in FIGURES)
    assert page.count("<img ") == len(FIGURES), "no figure is only referenced"
    html_dir = Path(uris["html"].removeprefix("file://")).parent
    for target, encoded in embedded.items():
        assert base64.b64decode(encoded, validate=True) == (html_dir / target).read_bytes(), target
    assert "<script" not in page and "http://" not in page and "https://" not in page

    markdown = read(uris["markdown"]).decode()
    assert all(f"](figures/{name}.png)" in markdown for name, _ in FIGURES)
    # Scoreboard: task 51 won with v1 (the champion), task 202 never beat the reference.
    assert "| 51 | train | L | W★ | T | v1 | yes |" in markdown
    assert "| 202 | train | L | L | · | none | no |" in markdown
    # The demo-style let-through is stated explicitly.
    assert "Task 202: its workflow search never beat the bare reference" in markdown
    assert "require_beats_reference: false" in markdown and "2 collection episode(s)" in markdown
    assert "| 51 | 3 | 3 | 3 | 1 | 100% |" in markdown  # coverage: planned, executed, judged, wins
    # Pairwise tables, the agreement table, benchmarks with efficiency, training, usage.
    assert "### L1 vs L0 (l1-vs-l0): 1.000" in markdown
    assert "| split test |" in markdown and "| judge gpt-judge |" in markdown and "| task 60 |" in markdown
    assert "| L1 vs L0 | external judges | 4 | 0.500 | 2/4 | 0.500 | 0.000 |" in markdown  # self vs external majority
    assert "| sab | L0 | success % | 2 | 16.67 ± 23.57 |" in markdown
    assert "| sab | L1 | success % | 2 | 83.33 ± 23.57 |" in markdown
    assert "| sab | L0 | 6/6 | 0.167 | 8000 | 0.0208 |" in markdown  # score per 1k output tokens
    assert "| sab | L1 | 6/6 | 0.833 | 5000 | 0.1667 |" in markdown
    assert "| sft | 6 | 1.9000 | 3 | 1.9000 |" in markdown
    assert "$0.42" in markdown
    assert "| evaluate |" in markdown and "| search |" in markdown and "| train |" in markdown
    # The page carries the same content.
    assert "Task 202: its workflow search never beat the bare reference" in page
    assert page.count("<table>") == markdown.count("\n|---|")


def test_report_data_of_the_gathered_records(eval_env):
    ctx = report_cycle(eval_env)
    populate_search(ctx)
    populate_training(ctx)
    data = collect_report_data(ctx)
    boards = {b.task: b for b in data.scoreboard}
    assert boards[51].results == {0: "L", 1: "W", 2: "T"} and boards[51].champion == 1
    assert boards[202].champion is None and boards[202].executed == 2
    (curve,) = data.curves
    assert curve.val == [(0, 2.4), (3, 1.9), (6, 2.0)] and curve.selected_step == 3
    assert curve.train[0] == (1, pytest.approx(2.3))
    stages = {s.stage: s for s in data.stages}
    # Search: 5 episodes between 08:00 and 10:50, in-loop calls inside; 1 server GPU.
    assert stages["search"].episodes == 5 and stages["search"].calls == 7
    assert stages["search"].completion_tokens == 5 * 12_000 + 5 * 3_000 + 2 * 9_000
    # Union of busy intervals: 08:00-08:50, 09:00-09:50, 10:00-10:50 plus the calls' own (short) intervals.
    assert 2.5 <= stages["search"].gpu_hours < 2.7
    assert stages["collect"].episodes == 2 and stages["collect"].span_s == 3600
    # Self-hosted on GPUs (the log has MFU): the stage's GPU-hours at the serving price, no per-token price.
    assert stages["search"].cost_usd == pytest.approx(
        stages["search"].gpu_hours * ctx.config.prices.serving_gpu_hour_usd
    )
    assert not data.cpu_run


def test_an_empty_cycle_renders_one_line_per_empty_panel(eval_env):
    uris = write_report(eval_env.ctx, "reports/empty")
    assert "reports/empty/report.html" in uris["html"]
    assert uris["figures"] == {}, "nothing to show: no panel is drawn"
    page = read(uris["html"]).decode()
    assert "data:image/png;base64," not in page
    markdown = read(uris["markdown"]).decode()
    assert "No pairwise evaluation of this cycle is recorded yet" in markdown
    assert "\nPublic benchmarks: No benchmark trial is recorded for this cycle.\n" in markdown
    assert "## Public benchmarks" not in markdown
    for name, title in FIGURES:  # each empty panel is one line naming it
        assert f"](figures/{name}.png)" not in markdown
        assert sum(line.startswith(f"{title}: ") for line in markdown.splitlines()) <= 2
    assert "Win rate by generation (95% intervals): no pairwise evaluation recorded." in markdown


def test_the_nightly_report_is_written_for_the_nightly_cycle(eval_env):
    from mass_ops.layout import report_prefix
    from mass_ops.stages import api as stages
    from mass_ops.stages.nightly import nightly_config

    nightly = nightly_config(eval_env.config).cycle_name
    assert nightly != eval_env.config.cycle_name
    result = stages.nightly_report(eval_env.config)
    assert result["cycle"] == nightly and result["figures"] == 0  # nothing recorded: no panel drawn
    assert result["html"] == eval_env.ctx.artifacts.uri(f"{report_prefix(nightly)}/report.html")
    page = read(result["html"]).decode()
    assert f"MASS cycle report: {nightly}" in page


def test_an_evaluation_without_a_decisive_judgment_draws_a_note_not_an_empty_legend():
    import warnings

    from mass_ops.evaluation import report
    from mass_ops.evaluation.stats import PairwiseSummary, WinRate

    # What a random demo model gives: every verdict invalid, so counted as a tie, so no win rate anywhere.
    ties = WinRate(
        wins=0, losses=0, ties=2, invalid=2, judgments=2, pairs=2, win_rate=None, wilson=None, bootstrap=None
    )
    summary = PairwiseSummary(overall=ties, by_task={"60": ties}, by_split={"test": ties}, by_judge={"self": ties})
    evaluation = report.PairwiseEvaluation(
        key="k", label="L1_vs_L0", cycle="demo-L0", generation_a="L1", generation_b="L0", order=(1, 0, 0), pairs=2,
        judges=["self"], seeds=[42], summary=summary, agreement={},
    )  # fmt: skip
    data = report.ReportData(
        cycle="demo-L0", preset="demo", generation=0, served_model="m", config_hash="h", generated_at="now",
        evaluations=[evaluation],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns when asked for a legend of nothing
        figure = report.FIGURE_BUILDERS["win_rate_by_generation"](data)
    [ax] = figure.axes
    assert [text.get_text() for text in ax.texts] == [report.NO_DECISIVE_PAIR]
    assert ax.get_legend() is None and not ax.containers  # no error bars drawn


def test_invalid_verdicts_are_counted_per_judging_stage(eval_env):
    ctx = report_cycle(eval_env)
    repo, cycle = ctx.repo, ctx.cycle_id
    verdicts = [
        ("rhi", "v0_vs_no_harness", "A"),
        ("rhi", "v1_vs_no_harness", "invalid"),
        ("champion", "champion_v0_vs_v1", "B"),
        ("ranking", "a_vs_b", "invalid"),
        ("ranking", "b_vs_c", "tie"),
        ("external", "p1/gpt-judge/42", "invalid"),
        ("external", "p1/self/42", "A"),
    ]
    for ledger, key, verdict in verdicts:
        repo.record_comparison(cycle, 51, ledger, key, side_a="a", side_b="b", judge_model="m", verdict=verdict)
    unusable = [
        "task51/rhi/v1_vs_no_harness/a1", "task51/rhi/v1_vs_no_harness/a2", "task51/rhi/v1_vs_no_harness/a3",
        "task51/ranking/a_vs_b/a1", "task51/ranking/b_vs_c/swapped/a1", "eval/external/p1/gpt-judge/42/a1",
        "task51/optimizer/v0_to_v1/a1",  # an optimizer answer: not a judge's
    ]  # fmt: skip
    for key in unusable:
        purpose = "optimizer" if "optimizer" in key else "judge"
        repo.record_llm_call(cycle, key, purpose=purpose, model="m", status="invalid", error="no JSON object")
    repo.record_llm_call(cycle, "task51/ranking/b_vs_c/a1", purpose="self_judge", model="m", status="succeeded")

    data = collect_report_data(ctx)
    assert [(j.stage, j.verdicts, j.invalid, j.unusable_answers) for j in data.judging] == [
        ("search: vs reference", 2, 1, 3),
        ("search: arbitration", 1, 0, 0),
        ("rank: self-judge", 2, 1, 2),
        ("evaluate: gpt-judge", 1, 1, 1),
        ("evaluate: self", 1, 0, 0),
    ]
    markdown = read(write_report(ctx)["markdown"]).decode()
    assert "## Invalid judge verdicts" in markdown
    assert "| search: vs reference | 2 | 1 | 50.0% | 3 |" in markdown
    assert "| evaluate: gpt-judge | 1 | 1 | 100.0% | 1 |" in markdown
    assert "judge.max_invalid_fraction = 1" in markdown  # the demo-based test config tolerates every invalid one


def test_the_first_section_names_the_task_catalogue_and_the_prompt_templates(eval_env, tmp_path):
    from mass_ops.prompts import shipped_prompts
    from mass_ops.tasks import builtin_catalogue_dir, import_task_dir

    markdown = read(write_report(eval_env.ctx)["markdown"]).decode()
    first_section = provenance_section(markdown)
    assert "Task catalogue: builtin — mass-ops' own 12 tasks, not the reference's" in first_section
    digests = shipped_prompts().digests()
    assert f"Prompt templates: {len(digests)} recorded, 0 not the shipped text" in first_section
    for name, sha in digests.items():
        assert f"| {name} | {sha[:16]} | shipped |" in first_section

    # An imported catalogue: the cycle row records its identity and import record, and the report names them.
    imported = import_task_dir(builtin_catalogue_dir(), tmp_path / "reference" / "tasks")
    data = eval_env.config.model_dump(mode="json")
    data["name"] = "imported-tasks"
    data["tasks"]["catalogue"] = str(imported.source)
    ctx = open_test_cycle(validate_config(data))
    recorded = ctx.repo.get_cycle(ctx.cycle_name).provenance["catalogue"]
    assert recorded["identity"] == imported.identity() and recorded["identity"].startswith("imported:")
    assert recorded["provenance"] == imported.provenance.as_dict()
    first_section = provenance_section(read(write_report(ctx)["markdown"]).decode())
    assert f"Task catalogue: {imported.identity()} — imported from a folder named" in first_section
    assert f"({len(imported.provenance.files)} files, each SHA-256 recorded in the cycle row)" in first_section


def test_position_bias_ranking_throughput_and_cache_sections(eval_env):
    ctx = report_cycle(eval_env)
    populate_training(ctx)
    populate_ranking(ctx)
    populate_position_bias(ctx)
    # Prompt-cache hits: one rank call reports 600 of 1 000 prompt tokens cached; the others report nothing.
    usage = {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 600}}
    record_answer(ctx, "task51/ranking/p6/a1", "B", usage=usage)
    data = collect_report_data(ctx)

    rates = {(r.stage, r.judge): r for r in data.flip_rates}
    rank = rates[("rank: self-judge", "m")]
    assert (rank.checked, rank.flips, rank.reversals, rank.first_shown_won_twice, rank.unusable) == (3, 2, 1, 1, 1)
    assert rank.wilson == pytest.approx((0.207660, 0.938508), abs=1e-6)
    external = rates[("evaluate", "gpt-judge")]
    assert (external.checked, external.flips) == (1, 0)
    first = data.rankings[0]
    assert (first.rank, first.name, first.score, first.ci_low, first.ci_high) == (1, "t51_L0_s715100", 0.9, 0.2, 1.6)
    (curve,) = data.throughput
    assert curve.median_tokens_per_s == pytest.approx(970.0) and curve.peak_mem_gib == pytest.approx(1.55)
    assert curve.mfu[0] == (1, pytest.approx(0.31))
    shares = {c.stage: c for c in data.cache_shares}
    assert (shares["rank"].reporting, shares["rank"].units, shares["rank"].share) == (1, 10, 0.6)

    markdown = read(write_report(ctx)["markdown"]).decode()
    assert "## Judge position bias" in markdown
    assert "| rank: self-judge | m | 3 | 2 | 0.667 | [0.21, 0.94] | 1 | 1 | 1 |" in markdown
    assert "| evaluate | gpt-judge | 1 | 0 | 0.000 | [0.00, 0.79] | 0 | 0 | 0 |" in markdown
    assert "| 51 | 4 | t51_L0_s715100 | 0.900 | [0.20, 1.60] | 1.400 |" in markdown
    assert "](figures/ranking_scores.png)" in markdown and "](figures/training_throughput.png)" in markdown
    assert "| sft | 6 | 970 | 335 | 33.5% | 1.55 |" in markdown
    assert "| rank | 1/10 | 600 | 1,000 | 60.0% |" in markdown


def test_the_ranking_and_throughput_figures_draw_intervals_and_mfu():
    from mass_ops.evaluation import report

    data = report.ReportData(
        cycle="c", preset="demo", generation=0, served_model="m", config_hash="h", generated_at="now",
        rankings=[report.RankedTrajectory(51, "a", 1, 0.5, 0.1, 0.9), report.RankedTrajectory(51, "b", 2, -0.5, None,
                                                                                             None)],
        throughput=[report.ThroughputCurve("sft", [(1, 900.0), (2, 950.0)], [(1, 300.0)], [], None)],
    )  # fmt: skip
    [ranking] = report.FIGURE_BUILDERS["ranking_scores"](data).axes
    (bars,) = ranking.containers  # one error-bar container: scores with their intervals
    labels = [label.get_text() for label in ranking.get_yticklabels()]
    assert dict(zip(ranking.get_yticks(), labels, strict=True)) == {1: "1. a", 0: "2. b"}  # rank 1 on top
    segments = bars.lines[2][0].get_segments()
    assert [tuple(s[:, 0]) for s in segments] == [pytest.approx((0.1, 0.9)), pytest.approx((-0.5, -0.5))]
    [left] = report.FIGURE_BUILDERS["training_throughput"](data).axes  # no MFU: no empty MFU panel
    assert len(left.lines) == 2
    blocks = report.build_blocks(data)
    assert report.Block("p", "MFU: not computed (no FLOPs model or no training.peak_tflops_per_gpu).") in blocks


def test_the_ranking_figure_draws_an_interval_that_misses_its_score():
    """A bootstrap percentile interval may lie beside the full-data score (all ties, a lopsided resample): the figure
    draws the side that exists instead of failing the report (matplotlib refuses negative error bars)."""
    from mass_ops.evaluation import report

    data = report.ReportData(
        cycle="c", preset="demo", generation=0, served_model="m", config_hash="h", generated_at="now",
        rankings=[report.RankedTrajectory(51, "a", 1, 0.0, 0.2, 0.6), report.RankedTrajectory(51, "b", 2, 0.0, -0.6,
                                                                                             -0.1)],
    )  # fmt: skip
    [ranking] = report.FIGURE_BUILDERS["ranking_scores"](data).axes
    (bars,) = ranking.containers
    assert [tuple(s[:, 0]) for s in bars.lines[2][0].get_segments()] == [
        pytest.approx((0.0, 0.6)),
        pytest.approx((-0.6, 0.0)),
    ]


def test_the_first_section_shows_spend_against_budget_and_the_estimate_against_the_actuals(eval_env):
    data = eval_env.config.model_dump(mode="json")
    data["name"] = "budget-report"
    data["budgets"] = {"cycle_tokens": 500_000, "cycle_cost_usd": 10.0}
    ctx = open_test_cycle(validate_config(data))
    config = ctx.config
    # What validate_config saves (cost.estimate.CycleEstimate.as_dict), cut to the fields the report reads.
    stage = {"prompt_tokens": 100_000, "completion_tokens": 20_000, "serving_gpu_hours": 1.5, "training_gpu_hours": 0.0}
    saved = {"stages": [{"stage": "collect", **stage, "cost_usd": 4.5}], "lineage_cycle": None}
    ctx.repo.set_cycle_provenance(ctx.cycle_id, "estimate", saved)
    ctx.repo.add_budget_spend(ctx.cycle_id, ["cycle", "task:51"], tokens=123_456, cost_usd=1.25)
    ctx.repo.record_episode(
        ctx.cycle_id, task_id=51, kind="collection", candidate=0, seed=715100, status="succeeded",
        prompt_tokens=90_000, completion_tokens=12_000, started_at=T0, finished_at=T0 + timedelta(minutes=30),
    )  # fmt: skip

    first = provenance_section(read(write_report(ctx)["markdown"]).decode())
    assert "### Spend against budget" in first and "### Estimate against actual per stage" in first
    assert "| cycle | 123,456 | 500,000 | 1.25 | 10.00 | 1 |" in first
    assert "| task:51 | 123,456 | none | 1.25 | none | 1 |" in first
    gpu_hours = 0.5 * config.inference.server.gpus  # the episode's half hour on the inference server
    usd = gpu_hours * config.prices.serving_gpu_hour_usd  # self-hosted: GPU-hours at the serving price
    assert f"| collect | 120,000 | 102,000 | 1.18 | 1.50 | {gpu_hours:.2f} | 4.50 | {usd:,.2f} |" in first
    # The ledger was written by hand here, so it does not match the records: the report says by how much.
    assert "differs from the stage tables' total (102,000 tokens) by 21,456 tokens" in first
    assert "Estimate saved when the cycle was opened, from the documented defaults." in first

    bare = open_test_cycle(validate_config(eval_env.config.model_dump(mode="json") | {"name": "no-estimate"}))
    first = provenance_section(read(write_report(bare)["markdown"]).decode())
    assert "No spend is recorded in the budget ledger of this cycle." in first
    assert "No estimate was saved for this cycle" in first


def test_the_budget_section_lists_each_budget_alert_the_cycle_raised_or_says_there_was_none(eval_env):
    from mass_ops.store.budgets import BudgetLedger, BudgetLimits

    data = eval_env.config.model_dump(mode="json")
    data["name"] = "alerting"
    data["budgets"] = {"cycle_tokens": 1_000, "task_cost_usd": 2.0}
    ctx = open_test_cycle(validate_config(data))
    ledger = BudgetLedger(ctx.repo, ctx.cycle_id, BudgetLimits.from_mapping(ctx.config.budgets.model_dump()))
    ledger.record(("cycle", "task:51"), tokens=600, cost_usd=0.5)  # 60% of the cycle's tokens; 25% of the task's USD
    ledger.record(("cycle", "task:51"), tokens=250, cost_usd=1.2)  # 85% of the tokens, 85% of the USD

    first = provenance_section(read(write_report(ctx)["markdown"]).decode())
    alerts = re.findall(r"^Budget alert: (.*) at \d{4}-\d\d-\d\d \d\d:\d\d UTC\.$", first, re.MULTILINE)
    assert alerts == [
        "the cycle passed 50% of budgets.cycle_tokens = 1,000 tokens",
        "the cycle passed 80% of budgets.cycle_tokens = 1,000 tokens",
        "task 51 passed 50% of budgets.task_cost_usd = USD 2.00",
        "task 51 passed 80% of budgets.task_cost_usd = USD 2.00",
    ]
    assert "No budget alert" not in first

    quiet = open_test_cycle(validate_config(eval_env.config.model_dump(mode="json") | {"name": "quiet"}))
    first = provenance_section(read(write_report(quiet)["markdown"]).decode())
    assert "No budget alert: no spend reached 50% of a budget in this cycle." in first
    assert "Budget alert:" not in first


def test_the_benchmark_table_of_two_generations_cell_by_cell(eval_env):
    """The paper's layout from recorded `benchmark` evaluation rows of L0 and L1 (#18.4)."""
    from mass_ops.evaluation.benchmarks import load_sab_instances, sab_tasks
    from mass_ops.evaluation.benchmarks.table import HEADERS
    from mass_ops.evaluation.report import build_blocks, render_figures, render_markdown
    from tests.evaluation.fakes import FIXTURES

    ctx = eval_env.ctx
    tasks = sab_tasks(load_sab_instances(FIXTURES / "sab"))
    # L1's second trial has one task its grader never scored: attempted 3, scored 2.
    plan = {"L0": (8000, ((1, 0, 0), (0, 0, 0))), "L1": (4000, ((1, 1, 0), (1, None, 1)))}
    for generation, (tokens, trials) in plan.items():
        executor = BenchmarkExecutor(ctx, lambda r: {"x.txt": b"x"}, tokens_for=lambda r, t=tokens: t)
        for trial, scores in enumerate(trials):
            outcomes = run_trial(ctx, executor, tasks, generation, trial)
            recorded = tuple(
                TaskScore(o.request.unit.task_id, None if s is None else float(s), o.episode_id)
                for o, s in zip(outcomes, scores, strict=True)
            )
            metrics = {"evaluator": "fixture", "attempted": 3, "scored": sum(s is not None for s in scores)}
            record_trial(ctx, TrialResult("sab", generation, trial, recorded, metrics))
    data = collect_report_data(ctx)
    blocks = build_blocks(data)
    [table] = [b for b in blocks if b.kind == "table" and b.headers == HEADERS]
    # L0: trial means 1/3 and 0; 6 scored episodes of 8000 tokens, Σ score 1. L1: trial means 2/3 and 1 (over its
    # 2 scored tasks); 5 scored episodes of 4000 tokens, Σ score 4 → 4/20000 per token, 9.6 times L0's 1/48000.
    assert table.rows == (
        ("sab", "L0", "2", "0.167 ± 0.236", "3/3, 3/3", "8000", "0.0208", "1.00×"),
        ("sab", "L1", "2", "0.833 ± 0.236", "3/3, 3/2", "4000", "0.2000", "9.60×"),
    )
    markdown = render_markdown(blocks)
    assert "| sab | L1 | 2 | 0.833 ± 0.236 | 3/3, 3/2 | 4000 | 0.2000 | 9.60× |" in markdown
    assert "](figures/benchmark_table.png)" in markdown
    figure = render_figures(data, eval_env.tmp / "figures")["benchmark_table"]
    assert figure.read_bytes().startswith(PNG_SIGNATURE)


def _demo_like_data(**changes: object):
    """ReportData as a demo cycle leaves it: L0's own judge stood in, every verdict a tie, CPU only."""
    from mass_ops.cost.records import StageUsage
    from mass_ops.evaluation import report
    from mass_ops.evaluation.agreement import Agreement
    from mass_ops.evaluation.stats import PairwiseSummary, WinRate

    ties = WinRate(wins=0, losses=0, ties=2, invalid=2, judgments=2, pairs=2, win_rate=None, wilson=None,
                   bootstrap=None)  # fmt: skip
    summary = PairwiseSummary(overall=ties, by_task={"60": ties}, by_split={"test": ties}, by_judge={"self": ties})
    agreement = Agreement("L1", pairs=2, agreements=2, decisive_pairs=0, decisive_agreements=0, kappa=None,
                          confusion={"tie|tie": 2})  # fmt: skip
    evaluation = report.PairwiseEvaluation(
        key="k", label="l1-vs-l0", cycle="demo-L0", generation_a="L1", generation_b="L0", order=(1, 0, 0), pairs=2,
        judges=["in-loop-0"], seeds=[42], summary=summary, agreement={"L1": agreement},
    )  # fmt: skip
    stages = [
        report.StageCost("search", StageUsage(prompt_tokens=210_000, completion_tokens=1_084, wall_clock_s=600.0),
                         calls=12, episodes=6),
        report.StageCost("train", StageUsage(wall_clock_s=120.0)),
    ]  # fmt: skip
    values: dict = dict(
        cycle="demo-L0", preset="demo", generation=0, served_model="m", config_hash="h", generated_at="now",
        evaluations=[evaluation], stages=stages, cpu_run=True, wall_clock_s=1500.0,
        training_data=report.TrainingData(trajectories=2, windows=6, tokens=40_000, supervised_tokens=900),
        dag_run=report.DagRun("mass_cycle", "manual__2026-12-05T03:45:00", "/dags/mass_cycle/runs/manual__2026"),
    )  # fmt: skip
    values.update(changes)
    return report.ReportData(**values)


def test_the_report_leads_with_the_headline_of_a_demo_like_cycle():
    from mass_ops.evaluation.report import build_blocks, render_html, render_markdown

    markdown = render_markdown(build_blocks(_demo_like_data()))
    headline = markdown.split("\n## Headline\n", 1)[1].split("\n## ", 1)[0]
    assert markdown.index("## Headline") < markdown.index("## Provenance and spend")
    assert (
        "| L1 vs L0 win rate | no win rate: no decisive judgment (0 W / 0 L / 2 T over 2 judgments, 2 of them "
        "invalid verdicts; ties and invalid verdicts do not count) — judged by L0's own judge (stand-in) |"
    ) in headline
    assert "| Trained on | 2 trajectories: 6 windows, 40,000 tokens (900 supervised) |" in headline
    assert "| Cost | $0.00 for 211,084 tokens (priced at config.prices; a CPU run has no GPU-hours to price) |" in (
        headline
    )
    assert "| Wall-clock | 25.0 min (first recorded unit start to last unit end) |" in headline
    assert "| GPU-hours | CPU run: no GPU-hours |" in headline
    assert (
        "| Next | rerun the evaluation with more replicates (evaluation.rollout_count, evaluation.judge_seeds) and "
        "configure an external judge (evaluation.judges): no decisive judgment yet |"
    ) in headline
    assert "[Open DAG run manual__2026-12-05T03:45:00 in Airflow](</dags/mass_cycle/runs/manual__2026>)" in headline
    # The stand-in is named as such, never as external judges; agreement over 0 decisive pairs is n/a, not 1.000.
    assert "## Pairwise evaluation (L0's own judge (stand-in))" in markdown
    assert "(external judges)" not in markdown
    assert "| L1 vs L0 | L0's own judge (stand-in) | 2 | n/a | 0/0 | n/a | n/a |" in markdown
    assert "Judge agreement by generation: no pair was called decisively by both judges." in markdown
    assert "| train | 0.03 | 0.00 | none (CPU) |" in markdown and "CPU run: no GPU-hours (the server" in markdown
    assert "| total | 12 | 6 | 210,000 | 1,084 | $0.00 |" in markdown and "cost n/a" not in markdown
    from mass_ops.evaluation.report.figures import drawn_figures

    data = _demo_like_data()
    page = render_html(build_blocks(data), {name: b"png" for name in drawn_figures(data)})
    assert '<p><a href="/dags/mass_cycle/runs/manual__2026">Open DAG run manual__2026-12-05T03:45:00' in page


@pytest.mark.parametrize(
    ("rate", "bounds", "stand_in", "failed", "expected"),
    [
        (0.8, (0.6, 0.9), False, [], "promote L1: it beats L0 (the whole 95% interval is above 0.5)"),
        (0.8, (0.6, 0.9), True, [], "configure an external judge (evaluation.judges) and re-evaluate before"),
        (0.2, (0.1, 0.4), False, [], "do not promote L1: it loses to L0"),
        (0.55, (0.3, 0.7), False, [], "rerun the evaluation with more replicates"),
        (0.8, (0.6, 0.9), False, ["train (run sft failed)"], "inspect the failed stage: train (run sft failed)"),
    ],
)
def test_the_next_step_is_chosen_from_the_results(rate, bounds, stand_in, failed, expected):
    from dataclasses import replace

    from mass_ops.evaluation.report.blocks import next_step
    from mass_ops.evaluation.stats import WinRate

    data = _demo_like_data(failed_stages=failed)
    [evaluation] = data.evaluations
    overall = WinRate(wins=8, losses=2, ties=0, invalid=0, judgments=10, pairs=10, win_rate=rate, wilson=bounds,
                      bootstrap=bounds)  # fmt: skip
    judged = replace(evaluation, summary=replace(evaluation.summary, overall=overall),
                     judges=["in-loop-0"] if stand_in else ["gpt-judge"])  # fmt: skip
    assert next_step(replace(data, evaluations=[judged])).startswith(expected)


def test_the_dag_run_comes_from_airflow_s_task_variables(eval_env):
    environ = {"AIRFLOW_CTX_DAG_ID": "mass_cycle", "AIRFLOW_CTX_DAG_RUN_ID": "manual__2026-12-05T03:45:00+00:00",
               "AIRFLOW__API__BASE_URL": "https://airflow.example/"}  # fmt: skip
    data = collect_report_data(eval_env.ctx, environ=environ)
    assert data.dag_run is not None
    assert data.dag_run.url == "https://airflow.example/dags/mass_cycle/runs/manual__2026-12-05T03%3A45%3A00%2B00%3A00"
    assert collect_report_data(eval_env.ctx, environ={}).dag_run is None
