"""The document as blocks: `build_blocks` runs one builder per section, in `SECTIONS` order, over `ReportData`.

Each builder returns its section's headings, paragraphs, notes, tables and figure placeholders (a figure block
names an entry of `FIGURES`); the renderers turn the same blocks into Markdown and HTML.
"""

from __future__ import annotations

from collections.abc import Callable

from mass_ops.evaluation.benchmarks.table import HEADERS as BENCHMARK_TABLE_HEADERS
from mass_ops.evaluation.benchmarks.table import table_rows
from mass_ops.evaluation.report.figures import FIGURE_HAS_DATA
from mass_ops.evaluation.report.model import (
    FIGURES,
    Block,
    PairwiseEvaluation,
    ReportData,
    is_stand_in,
    judges_label,
    median,
)
from mass_ops.evaluation.stats import WinRate, format_rate

PROMPT_DIGEST_CHARS = 16


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _int(value: int) -> str:
    return f"{value:,}"


def _rate_row(name: str, rate: WinRate) -> tuple[str, ...]:
    return (
        name,
        str(rate.wins),
        str(rate.losses),
        str(rate.ties),
        _fmt(rate.win_rate),
        "n/a" if rate.wilson is None else f"[{rate.wilson[0]:.2f}, {rate.wilson[1]:.2f}]",
        "n/a" if rate.bootstrap is None else f"[{rate.bootstrap[0]:.2f}, {rate.bootstrap[1]:.2f}]",
    )


RATE_HEADERS = ("group", "W", "L", "T", "W/(W+L)", "Wilson 95%", "pair bootstrap 95%")


def _interval(bounds: tuple[float, float] | None, digits: int = 2) -> str:
    return "n/a" if bounds is None else f"[{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"


def _figure(data: ReportData, name: str, nothing: str) -> list[Block]:
    """The figure `name`, or one line saying it has nothing to show (`nothing`) instead of an empty panel."""
    if FIGURE_HAS_DATA[name](data):
        return [Block("figure", name)]
    return [Block("p", f"{dict(FIGURES)[name]}: {nothing}.")]


def _gpu_hours(data: ReportData, hours: float) -> str:
    return "CPU run: no GPU-hours" if data.cpu_run else f"{hours:,.2f}"


# -- the headline: the answer first ------------------------------------------------------------------------------------


def _win_rate_line(evaluation: PairwiseEvaluation | None) -> str:
    """L(k+1) vs L(k): the win rate with its interval, or why there is none."""
    if evaluation is None:
        return "no pairwise evaluation of this cycle is recorded"
    overall = evaluation.summary.overall
    counts = f"{overall.wins} W / {overall.losses} L / {overall.ties} T over {overall.judgments} judgments"
    if overall.win_rate is None:
        invalid = f", {overall.invalid} of them invalid verdicts" if overall.invalid else ""
        return f"no win rate: no decisive judgment ({counts}{invalid}; ties and invalid verdicts do not count)"
    bounds = overall.bootstrap or overall.wilson
    kind = "pair bootstrap" if overall.bootstrap else "Wilson"
    interval = "" if bounds is None else f", 95% {kind} interval {_interval(bounds)}"
    return f"{overall.win_rate:.3f}{interval} ({counts})"


def next_step(data: ReportData) -> str:
    """What to do next, chosen from the results: inspect a failed stage, rerun the evaluation, promote or not."""
    if data.failed_stages:
        return f"inspect the failed stage: {data.failed_stages[0]}"
    evaluation = data.headline_evaluation
    if evaluation is None:
        return "inspect the evaluate stage: no pairwise evaluation is recorded"
    new, parent = evaluation.generation_a, evaluation.generation_b
    external = " and configure an external judge (evaluation.judges)" if is_stand_in(evaluation) else ""
    overall = evaluation.summary.overall
    bounds = overall.bootstrap or overall.wilson
    if overall.win_rate is None:
        return (
            "rerun the evaluation with more replicates (evaluation.rollout_count, evaluation.judge_seeds)"
            f"{external}: no decisive judgment yet"
        )
    if bounds is not None and bounds[0] > 0.5:
        if external:
            return f"configure an external judge (evaluation.judges) and re-evaluate before promoting {new}"
        return f"promote {new}: it beats {parent} (the whole 95% interval is above 0.5)"
    if bounds is not None and bounds[1] < 0.5:
        return f"do not promote {new}: it loses to {parent} (the whole 95% interval is below 0.5)"
    return (
        "rerun the evaluation with more replicates (evaluation.rollout_count, evaluation.judge_seeds)"
        f"{external}: the 95% interval includes 0.5"
    )


def _headline_blocks(data: ReportData) -> list[Block]:
    """The answer first: the win rate, what was trained, cost, time, GPU-hours, what to do next, the DAG run."""
    evaluation = data.headline_evaluation
    versus = f"L{data.generation + 1} vs L{data.generation}"
    if evaluation is not None:
        versus = f"{evaluation.generation_a} vs {evaluation.generation_b}"
    judged = f" — judged by {judges_label([evaluation])}" if evaluation is not None else ""
    trained = data.training_data
    trained_line = (
        "not rendered yet"
        if trained is None
        else f"{_int(trained.trajectories)} trajectories: {_int(trained.windows)} windows, {_int(trained.tokens)} "
        f"tokens ({_int(trained.supervised_tokens)} supervised)"
    )
    priced = "priced at config.prices" + ("; a CPU run has no GPU-hours to price" if data.cpu_run else "")
    rows = [
        (f"{versus} win rate", _win_rate_line(evaluation) + judged),
        ("Trained on", trained_line),
        ("Cost", f"${data.total_cost_usd:,.2f} for {_int(data.total_tokens)} tokens ({priced})"),
        ("Wall-clock", f"{_hours(data.wall_clock_s)} (first recorded unit start to last unit end)"),
        ("GPU-hours", _gpu_hours(data, data.total_gpu_hours)),
        ("Next", next_step(data)),
    ]
    if data.dag_run is not None:
        rows.append(("DAG run", f"{data.dag_run.dag_id} / {data.dag_run.run_id}"))
    blocks = [Block("h2", "Headline"), Block("table", headers=("", "result"), rows=tuple(rows))]
    if data.dag_run is not None:
        blocks.append(Block("link", f"Open DAG run {data.dag_run.run_id} in Airflow", href=data.dag_run.url))
    return blocks


def _hours(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.2f} h"


# -- the first section: what the cycle ran with, what it spent, and the notes -----------------------------------------


def _header_blocks(data: ReportData) -> list[Block]:
    """The title and the line naming the preset, the generations, the served model and the config."""
    return [
        Block("title", f"MASS cycle report: {data.cycle}"),
        Block(
            "p",
            f"Preset {data.preset}, generation L{data.generation} → L{data.generation + 1}, served model "
            f"{data.served_model}, config {data.config_hash[:12]}. Generated {data.generated_at}.",
        ),
    ]


def _provenance_blocks(data: ReportData) -> list[Block]:
    """What the cycle ran with: its task catalogue and the SHA-256 of each prompt template (first section)."""
    text = f"Task catalogue: {data.catalogue}"
    record = data.catalogue_import
    if record is not None:
        files = record.get("files")
        text += (
            f" — imported from a folder named {record.get('source', '?')!s} at {record.get('imported_at', '?')!s} "
            f"({len(files) if isinstance(files, dict) else 0} files, each SHA-256 recorded in the cycle row)"
        )
    elif data.catalogue == "builtin":
        text += " — mass-ops' own 12 tasks, not the reference's (`mass-ops tasks import` brings in those)"
    blocks = [Block("h2", "Provenance and spend"), Block("p", text + ".")]
    if data.prompts:
        replaced = sum(1 for p in data.prompts if p.shipped is not True)
        blocks.append(
            Block(
                "p",
                f"Prompt templates: {len(data.prompts)} recorded, {replaced} not the shipped text (prompts.dir).",
            )
        )
        rows = tuple(
            (
                p.name,
                p.sha256[:PROMPT_DIGEST_CHARS],
                "shipped" if p.shipped else "replaced" if p.shipped is False else "not shipped by this version",
            )
            for p in data.prompts
        )
        blocks.append(Block("table", headers=("template", "SHA-256 (prefix)", "text"), rows=rows))
    return blocks


def _reconciliation(data: ReportData) -> Block | None:
    """The ledger's cycle spend against the stage tables' total: one figure, or the difference named."""
    cycle = next((b for b in data.budgets if b.scope == "cycle"), None)
    if cycle is None:
        return None
    expected = data.total_tokens - data.unbudgeted_tokens
    external = (
        f", less {_int(data.unbudgeted_tokens)} tokens of external judges, whose calls spend from no budget"
        if data.unbudgeted_tokens
        else ""
    )
    if cycle.tokens == expected:
        return Block(
            "p",
            f"Reconciled: the cycle's ledger spend, {_int(cycle.tokens)} tokens, is the stage tables' total "
            f"({_int(data.total_tokens)} tokens: every episode and LLM call{external}).",
        )
    return Block(
        "note",
        f"The cycle's ledger spend ({_int(cycle.tokens)} tokens) differs from the stage tables' total "
        f"({_int(data.total_tokens)} tokens{external}) by {_int(abs(expected - cycle.tokens))} tokens: the ledger "
        "missed spend (a record that failed, or episodes run before every episode was charged) or counted requests "
        "whose unit left no row.",
    )


def _alert_blocks(data: ReportData) -> list[Block]:
    """One line per budget alert the cycle raised (50% and 80% of a limit), or one line saying there was none."""
    if not data.budget_alerts:
        return [Block("p", "No budget alert: no spend reached 50% of a budget in this cycle.")]
    lines = []
    for a in data.budget_alerts:
        scope = "the cycle" if a.scope == "cycle" else a.scope.replace(":", " ").replace("_", "-")
        if a.limit is None:
            limit = f"{a.setting} (no longer set)"
        else:
            limit = f"{a.setting} = " + (f"USD {a.limit:,.2f}" if a.unit == "USD" else f"{int(a.limit):,} tokens")
        lines.append(Block("p", f"Budget alert: {scope} passed {a.percent}% of {limit} at {a.at}."))
    return lines


def _cost_control_blocks(data: ReportData) -> list[Block]:
    """Spend against budget and the estimate against the actuals per stage (part of the first section)."""
    blocks = [Block("h3", "Spend against budget")]
    rows: tuple[tuple[str, ...], ...]  # the two tables below have different widths
    headers: tuple[str, ...]
    if data.budgets:
        rows = tuple(
            (
                b.scope, _int(b.tokens), "none" if b.token_limit is None else _int(b.token_limit),
                f"{b.cost_usd:,.2f}", "none" if b.cost_limit is None else f"{b.cost_limit:,.2f}", str(b.requests),
            )
            for b in data.budgets
        )  # fmt: skip
        headers = ("scope", "tokens", "token budget", "USD (server-reported)", "USD budget", "requests")
        blocks.append(Block("table", headers=headers, rows=rows))
        reconciled = _reconciliation(data)
        if reconciled is not None:
            blocks.append(reconciled)
    else:
        blocks.append(Block("p", "No spend is recorded in the budget ledger of this cycle."))
    blocks.extend(_alert_blocks(data))
    blocks.append(Block("h3", "Estimate against actual per stage"))
    if data.estimate_source is None:
        blocks.append(Block("p", "No estimate was saved for this cycle (validate_config saves the first one)."))
    rows = tuple(
        (
            r.stage,
            "n/a" if r.estimated_tokens is None else _int(r.estimated_tokens), _int(r.actual_tokens),
            "n/a" if r.token_ratio is None else f"{r.token_ratio:.2f}",
            _fmt(r.estimated_gpu_hours, 2), "none (CPU)" if data.cpu_run else _fmt(r.actual_gpu_hours, 2),
            "n/a" if r.estimated_usd is None else f"{r.estimated_usd:,.2f}", f"{r.actual_usd:,.2f}",
        )
        for r in data.estimate_rows
    )  # fmt: skip
    if rows:
        headers = ("stage", "est. tokens", "tokens", "est./actual", "est. GPU-h", "GPU-h", "est. USD", "USD")
        blocks.append(Block("table", headers=headers, rows=rows))
    if data.estimate_source is not None:
        blocks.append(
            Block(
                "p",
                f"Estimate saved when the cycle was opened, from {data.estimate_source}. Actual USD: each call's "
                "server-reported cost (else its model's per-token price), priced agents' tokens, and GPU-hours at "
                "config.prices (self-hosted serving, training)"
                + ("; this CPU run has no GPU-hours." if data.cpu_run else "."),
            )
        )
    return blocks


def _notes_blocks(data: ReportData) -> list[Block]:
    """Every note the readers left (let-through tasks, carried designs, evaluation and benchmark notes)."""
    if not data.notes:
        return []
    return [Block("h2", "Notes"), *(Block("note", note) for note in data.notes)]


# -- search, judging and ranking ---------------------------------------------------------------------------------------


def _scoreboard_blocks(data: ReportData) -> list[Block]:
    """Each task's results of every version against the reference, the champion marked."""
    blocks = [Block("h2", "RHI scoreboard")]
    versions = sorted({v for b in data.scoreboard for v in b.results})
    if data.scoreboard:
        rows = []
        for board in data.scoreboard:
            cells = []
            for version in versions:
                result = board.results.get(version, "")
                cells.append(f"{result}★" if board.champion == version and result else result or "·")
            champion = f"v{board.champion}" if board.champion is not None else "none"
            rows.append((str(board.task), board.split, *cells, champion, "yes" if board.champion is not None else "no"))
        headers = ("task", "split", *(f"v{v}" for v in versions), "champion", "beats reference")
        blocks.append(Block("table", headers=headers, rows=tuple(rows)))
    else:
        blocks.append(Block("p", "No RHI search is recorded for this cycle."))
    blocks.extend(_figure(data, "rhi_scoreboard", "no RHI search recorded"))
    return blocks


def _coverage_blocks(data: ReportData) -> list[Block]:
    """Per task: versions planned, executed, judged and beating the reference."""
    blocks = [Block("h2", "Search coverage")]
    if data.scoreboard:
        rows = tuple(
            (
                str(b.task),
                str(b.planned),
                str(b.executed),
                str(len(b.results)),
                str(b.wins),
                f"{b.executed / b.planned:.0%}" if b.planned else "n/a",
            )
            for b in data.scoreboard
        )
        headers = ("task", "planned versions", "executed", "judged", "beat reference", "coverage")
        blocks.append(Block("table", headers=headers, rows=rows))
    blocks.extend(_figure(data, "search_coverage", "no RHI search recorded"))
    return blocks


def _judging_blocks(data: ReportData) -> list[Block]:
    """Verdicts, invalid verdicts and unusable answers per judging stage, and the rule that fails a stage."""
    blocks = [Block("h2", "Invalid judge verdicts")]
    if data.judging:
        rows = tuple(
            (
                j.stage,
                str(j.verdicts),
                str(j.invalid),
                f"{j.invalid / j.verdicts:.1%}" if j.verdicts else "n/a",
                str(j.unusable_answers),
            )
            for j in data.judging
        )
        headers = ("stage", "verdicts", "invalid (ties)", "invalid share", "unusable answers")
        blocks.append(Block("table", headers=headers, rows=rows))
    else:
        blocks.append(Block("p", "No judge verdict is recorded for this cycle."))
    blocks.append(
        Block(
            "p",
            "An answer that is not a usable verdict is retried (judge.invalid_retries) with a seed derived from the "
            "call's; a verdict still invalid counts as a tie. A stage fails when its invalid share exceeds "
            f"judge.max_invalid_fraction = {data.max_invalid_fraction:g} (per task in search and rank, per judge in "
            "evaluate), and its rerun judges the pair again.",
        )
    )
    return blocks


def _position_bias_blocks(data: ReportData) -> list[Block]:
    """Flip rate per judge: how often the verdict changes when the two workspaces swap places."""
    blocks = [Block("h2", "Judge position bias")]
    if data.flip_rates:
        rows = tuple(
            (
                r.stage,
                r.judge,
                str(r.checked),
                str(r.flips),
                _fmt(r.rate),
                _interval(r.wilson),
                str(r.reversals),
                str(r.first_shown_won_twice),
                str(r.unusable),
            )
            for r in data.flip_rates
        )
        headers = ("stage", "judge", "pairs in both orders", "flips", "flip rate", "Wilson 95%", "A/B reversals",
                   "first shown won both", "invalid in an order")  # fmt: skip
        blocks.append(Block("table", headers=headers, rows=rows))
    else:
        blocks.append(Block("p", "No pair was judged in both presentations (judge.position_bias_sample is "
                                 f"{data.position_bias_sample:g} and swap-consistent judging is off)."))  # fmt: skip
    blocks.append(
        Block(
            "p",
            "A flip: the verdict changes when A and B swap places (the swapped verdict mapped back) — a reversal, or "
            "a tie in one order and a winner in the other; a tie in both is consistent. Pairs with an invalid "
            "verdict in either order are left out. The swapped call is a measurement (judge.position_bias_sample "
            f"= {data.position_bias_sample:g} of the pairs, picked by a hash of the call key): the verdicts used for "
            "RHI and ranking are the single forward calls, as in the reference.",
        )
    )
    return blocks


def _ranking_blocks(data: ReportData) -> list[Block]:
    """Per task: the ranked trajectories and the best one's score with its bootstrap interval."""
    blocks = [Block("h2", "Ranking (self-judged tournament, Bradley–Terry)")]
    tasks = sorted({r.task for r in data.rankings})
    if tasks:
        rows = []
        for task in tasks:
            ranked = sorted((r for r in data.rankings if r.task == task), key=lambda r: r.rank)
            best = ranked[0]
            bounds = (best.ci_low, best.ci_high) if best.ci_low is not None and best.ci_high is not None else None
            widths = [r.ci_high - r.ci_low for r in ranked if r.ci_low is not None and r.ci_high is not None]
            rows.append(
                (str(task), str(len(ranked)), best.name, _fmt(best.score), _interval(bounds), _fmt(median(widths)))
            )
        headers = ("task", "trajectories", "rank 1", "score", "95% bootstrap", "median interval width")
        blocks.append(Block("table", headers=headers, rows=tuple(rows)))
    else:
        blocks.append(Block("p", "No ranking is recorded for this cycle."))
    blocks.extend(_figure(data, "ranking_scores", "no ranking recorded"))
    return blocks


# -- evaluation and benchmarks -----------------------------------------------------------------------------------------


def _evaluation_blocks(evaluation: PairwiseEvaluation) -> list[Block]:
    """One pairwise evaluation of this cycle: its overall rate, its design, and its rates by split, judge and task."""
    summary = evaluation.summary
    rows = [_rate_row("overall", summary.overall)]
    rows += [_rate_row(f"split {name}", rate) for name, rate in summary.by_split.items()]
    rows += [_rate_row(f"judge {name}", rate) for name, rate in summary.by_judge.items()]
    task_rows = tuple(_rate_row(f"task {name}", rate) for name, rate in summary.by_task.items())
    return [
        Block(
            "h3",
            f"{evaluation.generation_a} vs {evaluation.generation_b} ({evaluation.label}): "
            f"{format_rate(summary.overall)}",
        ),
        Block(
            "p",
            f"{evaluation.pairs} pairs × judges {', '.join(evaluation.judges)} × presentation seeds "
            f"{', '.join(str(s) for s in evaluation.seeds)} = {summary.overall.judgments} judgments.",
        ),
        Block("table", headers=RATE_HEADERS, rows=tuple(rows)),
        Block("table", headers=RATE_HEADERS, rows=task_rows),
    ]


def _pairwise_blocks(data: ReportData) -> list[Block]:
    """Win rates of the newer generation by the external judges (or the stand-in), and the agents' output tokens per
    rollout."""
    blocks = [Block("h2", f"Pairwise evaluation ({judges_label(data.own_evaluations or data.evaluations)})")]
    stand_ins = [e for e in data.own_evaluations if is_stand_in(e)]
    if stand_ins:
        blocks.append(
            Block(
                "note",
                f"No external judge is configured: {stand_ins[0].generation_b}'s own in-loop judge stands in for the "
                "external judges, so these verdicts are not independent of the models compared.",
            )
        )
    blocks.append(
        Block(
            "p",
            "Win rate = W/(W+L) of the newer generation (side A); ties and invalid verdicts are excluded, and the "
            "rate is n/a without a decisive judgment. Wilson treats judgments as independent; the pair bootstrap "
            "resamples pairs with all their judgments.",
        )
    )
    blocks.extend(_figure(data, "win_rate_by_generation", "no pairwise evaluation recorded"))
    for evaluation in data.own_evaluations:
        blocks.extend(_evaluation_blocks(evaluation))
    if data.rollout_tokens:
        rows = tuple(
            (generation, str(count), _fmt(mean, 0)) for generation, (count, mean) in data.rollout_tokens.items()
        )
        blocks.append(Block("p", "Agent output tokens per rollout episode:"))
        blocks.append(Block("table", headers=("generation", "rollouts", "mean output tokens"), rows=rows))
    return blocks


def _agreement_blocks(data: ReportData) -> list[Block]:
    """The in-loop self-judge against the external majority (or the stand-in's), per evaluation. Over 0 decisive
    pairs every rate is n/a: ties and invalid verdicts agree with each other without saying anything."""
    blocks = [Block("h2", "Judge agreement")]
    agreement_rows = tuple(
        (
            f"{e.generation_a} vs {e.generation_b}",
            judges_label([e]),
            str(a.pairs),
            _fmt(a.rate) if a.decisive_pairs else "n/a",
            f"{a.decisive_agreements}/{a.decisive_pairs}",
            _fmt(a.decisive_rate),
            _fmt(a.kappa) if a.decisive_pairs else "n/a",
        )
        for e in data.evaluations
        for a in e.agreement.values()
    )
    if agreement_rows:
        headers = ("evaluation", "against", "pairs", "agreement", "decisive agree", "decisive rate", "Cohen's κ")
        blocks.append(Block("table", headers=headers, rows=agreement_rows))
    else:
        blocks.append(Block("p", "No self-judge verdicts on evaluation pairs are recorded."))
    blocks.extend(_figure(data, "judge_agreement", "no pair was called decisively by both judges"))
    return blocks


def _benchmark_blocks(data: ReportData) -> list[Block]:
    """Public benchmark scores per generation, score per output token, and the paper's table."""
    blocks = [Block("h2", "Public benchmarks")]
    if data.benchmarks:
        blocks.append(
            Block(
                "table",
                headers=("benchmark", "generation", "measure", "trials", "mean ± sample SD"),
                rows=tuple((b, g, m, str(t), v) for b, g, m, t, v in data.benchmarks),
            )
        )
        eff_rows = tuple(
            (
                e.benchmark,
                e.generation,
                f"{e.accounted}/{e.episodes}",
                _fmt(e.mean_score),
                _fmt(e.mean_output_tokens, 0),
                _fmt(e.score_per_1k_output_tokens, 4),
            )
            for e in data.efficiency
        )
        if eff_rows:
            headers = ("benchmark", "generation", "episodes with tokens", "mean score", "mean output tokens",
                       "score per 1k output tokens")  # fmt: skip
            blocks.append(Block("table", headers=headers, rows=eff_rows))
    elif not data.benchmark_table:
        return [Block("p", "Public benchmarks: No benchmark trial is recorded for this cycle.")]
    blocks.extend(_benchmark_table_blocks(data))
    return blocks


def _benchmark_table_blocks(data: ReportData) -> list[Block]:
    """The paper's layout: per benchmark, each generation's score, attempted/scored tasks, tokens and the ratio."""
    if not data.benchmark_table:
        return []  # the section's one line already says no trial is recorded
    return [
        Block("h3", "By generation (the paper's table)"),
        Block("table", headers=BENCHMARK_TABLE_HEADERS, rows=table_rows(data.benchmark_table)),
        Block("figure", "benchmark_table"),
    ]


# -- training, tokens, cost and time -----------------------------------------------------------------------------------


def _training_blocks(data: ReportData) -> list[Block]:
    """Per training run: the last step, the least validation loss and the selected checkpoint; then throughput."""
    blocks = [Block("h2", "Training")]
    if data.curves:
        rows = tuple(
            (
                c.run,
                str(max((s for s, _ in c.train), default=0)),
                _fmt(min((v for _, v in c.val), default=None), 4),
                "n/a" if c.selected_step is None else str(c.selected_step),
                _fmt(c.selected_val_loss, 4),
            )
            for c in data.curves
        )
        headers = ("run", "last logged step", "min validation loss", "selected step", "selected val loss")
        blocks.append(Block("table", headers=headers, rows=rows))
    blocks.extend(_figure(data, "loss_curves", "no training run recorded"))
    blocks.extend(_throughput_blocks(data))
    return blocks


def _throughput_blocks(data: ReportData) -> list[Block]:
    """Median training throughput and MFU per run (the figure shows every logged step)."""
    blocks: list[Block] = []
    if data.throughput:
        rows = tuple(
            (
                c.run,
                str(len(c.tokens_per_s)),
                _fmt(c.median_tokens_per_s, 0),
                _fmt(median([v for _, v in c.supervised_tokens_per_s]), 0),
                "n/a" if not c.mfu else f"{100 * (median([v for _, v in c.mfu]) or 0.0):.1f}%",
                _fmt(c.peak_mem_gib, 2),
            )
            for c in data.throughput
        )
        headers = ("run", "logged steps", "median tokens/s", "median supervised tokens/s", "median MFU",
                   "peak memory GiB (rank 0)")  # fmt: skip
        blocks.append(Block("table", headers=headers, rows=rows))
        if not any(c.mfu for c in data.throughput):
            why = "a CPU run" if data.cpu_run else "no FLOPs model or no training.peak_tflops_per_gpu"
            blocks.append(Block("p", f"MFU: not computed ({why})."))
    blocks.extend(_figure(data, "training_throughput", "no training throughput logged"))
    return blocks


def _cache_blocks(data: ReportData) -> list[Block]:
    """Prompt-cache hits per stage, when any server reported cached prompt tokens."""
    if not data.cache_shares:
        return []
    rows = tuple(
        (
            c.stage,
            f"{c.reporting}/{c.units}",
            _int(c.cached_tokens),
            _int(c.prompt_tokens),
            "n/a" if c.share is None else f"{c.share:.1%}",
        )
        for c in data.cache_shares
    )
    return [
        Block("h3", "Prompt-cache hits"),
        Block(
            "table",
            headers=("stage", "units reporting", "cached prompt tokens", "their prompt tokens", "cached share"),
            rows=rows,
        ),
        Block(
            "p",
            "Cached share = cached prompt tokens (usage.prompt_tokens_details.cached_tokens) over the prompt tokens "
            "of the LLM calls and agent episodes whose server reported them; agents resend their context every "
            "turn, so a falling share is a cost regression.",
        ),
    ]


def _tokens_blocks(data: ReportData) -> list[Block]:
    """LLM calls, episodes, tokens and reported cost per stage; then prompt-cache hits."""
    blocks = [Block("h2", "Tokens and cost per stage")]
    if data.stages:
        rows = tuple(
            (
                s.stage,
                _int(s.calls),
                _int(s.episodes),
                _int(s.prompt_tokens),
                _int(s.completion_tokens),
                f"${s.cost_usd or 0.0:,.2f}",
            )
            for s in data.stages
        )
        total = ("total", _int(sum(s.calls for s in data.stages)), _int(sum(s.episodes for s in data.stages)),
                 _int(sum(s.prompt_tokens for s in data.stages)), _int(sum(s.completion_tokens for s in data.stages)),
                 f"${data.total_cost_usd:,.2f}")  # fmt: skip
        headers = ("stage", "LLM calls", "episodes", "prompt tokens", "completion tokens", "cost")
        blocks.append(Block("table", headers=headers, rows=(*rows, total)))
    blocks.extend(_figure(data, "tokens_cost", "no token accounting recorded"))
    blocks.extend(_cache_blocks(data))
    return blocks


def _time_blocks(data: ReportData) -> list[Block]:
    """Wall-clock, summed unit time and GPU-hours per stage."""
    blocks = [Block("h2", "Wall-clock and GPU-hours per stage")]
    if data.stages:
        rows = tuple(
            (s.stage, _fmt(s.span_s / 3600, 2), _fmt(s.busy_s / 3600, 2),
             "none (CPU)" if data.cpu_run else _fmt(s.gpu_hours, 2))
            for s in data.stages
        )  # fmt: skip
        headers = ("stage", "wall-clock h", "summed unit h", "GPU-hours")
        blocks.append(Block("table", headers=headers, rows=rows))
        text = (
            "GPU-hours: inference-server GPUs × the stage's wall-clock (time with at least one episode or in-loop "
            "call running) for stages on our server; one GPU per training rank × the run's wall-clock. External "
            "judges use no GPU of ours."
        )
        blocks.append(Block("p", "CPU run: no GPU-hours (the server and the trainer ran on CPUs)." if data.cpu_run
                            else text))  # fmt: skip
    blocks.extend(_figure(data, "wallclock_gpu", "no timings recorded"))
    return blocks


# -- the document ------------------------------------------------------------------------------------------------------

SECTIONS: tuple[Callable[[ReportData], list[Block]], ...] = (
    _header_blocks,
    _headline_blocks,
    _provenance_blocks,
    _cost_control_blocks,
    _notes_blocks,
    _scoreboard_blocks,
    _coverage_blocks,
    _judging_blocks,
    _position_bias_blocks,
    _ranking_blocks,
    _pairwise_blocks,
    _agreement_blocks,
    _benchmark_blocks,
    _training_blocks,
    _tokens_blocks,
    _time_blocks,
)


def build_blocks(data: ReportData) -> list[Block]:
    """The report as blocks, rendered to both Markdown and HTML."""
    return [block for section in SECTIONS for block in section(data)]
