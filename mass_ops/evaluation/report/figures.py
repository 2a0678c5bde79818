"""The report's figures: one builder per name of `FIGURES`, each drawing a matplotlib Figure from `ReportData`.

A figure with nothing to show is not drawn (`FIGURE_HAS_DATA`): the document says so in one line instead. matplotlib
is imported only here, lazily, on the Agg canvas, without pyplot's global state; `render_figures` writes the PNGs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mass_ops.evaluation.benchmarks.table import draw_benchmark_table
from mass_ops.evaluation.report.model import FIGURES, PairwiseEvaluation, ReportData, judges_label
from mass_ops.evaluation.stats import WinRate

_COLOURS = {"W": "#4c9a5f", "L": "#c8553d", "T": "#b8b8b8"}


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=11, color="#666666", transform=ax.transAxes)
    ax.set_axis_off()


def _single_axes(width: float, height: float, has_data: bool, nothing: str) -> tuple[Any, Any | None]:
    """A figure of one panel and that panel to draw on; without data the panel shows `nothing` and is None here,
    so the caller returns the figure as it is."""
    figure = _new_figure(width, height)
    ax = figure.subplots()
    if not has_data:
        _empty(ax, nothing)
        return figure, None
    return figure, ax


def _scoreboard_figure(data: ReportData) -> Any:
    from matplotlib.patches import Rectangle

    boards = data.scoreboard
    versions = sorted({v for b in boards for v in b.results} | {v for b in boards for v in range(b.planned)})
    width, height = max(6.0, 1.2 + 0.55 * len(versions)), max(2.4, 0.9 + 0.45 * len(boards))
    figure, ax = _single_axes(width, height, bool(boards), "No RHI search recorded")
    if ax is None:
        return figure
    for row, board in enumerate(boards):
        for column, version in enumerate(versions):
            result = board.results.get(version)
            colour = _COLOURS.get(result or "", "#ffffff")
            ax.add_patch(Rectangle((column, row), 1, 1, facecolor=colour, edgecolor="#dddddd"))
            if result:
                ax.text(column + 0.5, row + 0.5, result, ha="center", va="center", fontsize=9, color="white")
            if board.champion == version:
                ax.add_patch(Rectangle((column, row), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
                ax.text(column + 0.88, row + 0.22, "★", ha="center", va="center", fontsize=9, color="black")
    ax.set_xlim(0, len(versions))
    ax.set_ylim(len(boards), 0)
    ax.set_xticks([c + 0.5 for c in range(len(versions))], [f"v{v}" for v in versions])
    ax.set_yticks([r + 0.5 for r in range(len(boards))], [f"task {b.task} ({b.split})" for b in boards])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title("Each version vs the bare reference: W win, L loss, T tie (★ champion)", fontsize=10)
    return figure


def _coverage_figure(data: ReportData) -> Any:
    boards = data.scoreboard
    figure, ax = _single_axes(max(6.0, 1.0 + 0.9 * len(boards)), 3.6, bool(boards), "No RHI search recorded")
    if ax is None:
        return figure
    x = list(range(len(boards)))
    series = (
        ("planned", [b.planned for b in boards], "#d9d9d9"),
        ("executed", [b.executed for b in boards], "#7aa6c2"),
        ("judged", [len(b.results) for b in boards], "#3d6f94"),
        ("beat reference", [b.wins for b in boards], "#4c9a5f"),
    )
    width = 0.2
    for index, (name, values, colour) in enumerate(series):
        ax.bar([i + (index - 1.5) * width for i in x], values, width, label=name, color=colour)
    ax.set_xticks(x, [str(b.task) for b in boards])
    ax.set_xlabel("task")
    ax.set_ylabel("workflow versions")
    ax.legend(fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    return figure


def _rate_point(rate: WinRate) -> tuple[float, float, float] | None:
    if rate.win_rate is None:
        return None
    low, high = rate.bootstrap or rate.wilson or (rate.win_rate, rate.win_rate)
    return rate.win_rate, rate.win_rate - low, high - rate.win_rate


NO_DECISIVE_PAIR = "no decisive judgment yet (all ties or invalid): no win rate"


def _win_rate_figure(data: ReportData) -> Any:
    evaluations = data.evaluations
    width = max(6.0, 1.5 + 1.4 * len(evaluations))
    figure, ax = _single_axes(width, 3.8, bool(evaluations), "No pairwise evaluation recorded")
    if ax is None:
        return figure
    groups: list[tuple[str, Callable[[PairwiseEvaluation], WinRate | None], str, float]] = [
        ("overall", lambda e: e.summary.overall, "#222222", 0.0),
        ("train tasks", lambda e: e.summary.by_split.get("train"), "#3d6f94", -0.18),
        ("test tasks", lambda e: e.summary.by_split.get("test"), "#c8553d", 0.18),
    ]
    plotted = False
    for name, pick, colour, offset in groups:
        xs, ys, lows, highs = [], [], [], []
        for index, evaluation in enumerate(evaluations):
            rate = pick(evaluation)
            point = _rate_point(rate) if rate is not None else None
            if point is not None:
                xs.append(index + offset)
                ys.append(point[0])
                lows.append(point[1])
                highs.append(point[2])
        if xs:
            ax.errorbar(xs, ys, yerr=[lows, highs], fmt="o", capsize=4, color=colour, label=name)
            plotted = True
    ax.axhline(0.5, color="#999999", linestyle="--", linewidth=1)
    ax.set_ylim(-0.04, 1.06)  # room for markers and caps at 0 and 1
    ax.set_xlim(-0.6, len(evaluations) - 0.4)
    ax.set_xticks(range(len(evaluations)), [f"{e.generation_a} vs {e.generation_b}" for e in evaluations])
    ax.set_ylabel("win rate W/(W+L) of the newer model")
    if plotted:
        ax.legend(fontsize=8, loc="lower right")
    else:  # every judgment a tie or invalid: there is no win rate to draw
        ax.text(0.5, 0.75, NO_DECISIVE_PAIR, ha="center", fontsize=10, color="#666666", transform=ax.transAxes)
    judged_by = judges_label(evaluations)
    ax.set_title(f"{judged_by[0].upper()}{judged_by[1:]}; bars: pair-bootstrap 95% interval", fontsize=10)
    return figure


def _agreement_figure(data: ReportData) -> Any:
    # Agreement over pairs neither judge called decisively is no evidence (ties and invalid verdicts agree trivially).
    points = [(e, a) for e in data.evaluations for a in e.agreement.values() if a.decisive_pairs]
    width = max(6.0, 1.5 + 1.4 * len(points))
    figure, ax = _single_axes(width, 3.6, bool(points), "No self-judge verdicts on evaluation pairs recorded")
    if ax is None:
        return figure
    x = list(range(len(points)))
    raw = [a.rate or 0.0 for _, a in points]
    decisive = [a.decisive_rate or 0.0 for _, a in points]
    ax.bar([i - 0.15 for i in x], raw, 0.3, label="agreement (A/B/tie)", color="#3d6f94")
    ax.bar([i + 0.15 for i in x], decisive, 0.3, label="agreement on decisive pairs", color="#7aa6c2")
    for i, (_, agreement) in enumerate(points):
        kappa = "n/a" if agreement.kappa is None else f"{agreement.kappa:.2f}"
        ax.text(i, 1.03, f"n={agreement.pairs}, κ={kappa}", ha="center", fontsize=8)
    ax.set_ylim(0, 1.12)
    ax.set_xlim(-0.7, len(points) - 0.3)
    ax.set_xticks(x, [f"{e.generation_a} vs {e.generation_b}" for e, _ in points])
    ax.set_ylabel("fraction of pairs")
    ax.legend(fontsize=8, ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    ax.set_title("In-loop self-judge vs external majority", fontsize=10)
    return figure


def _loss_figure(data: ReportData) -> Any:
    curves = [c for c in data.curves if c.train or c.val]
    figure, ax = _single_axes(7.0, 3.8, bool(curves), "No training run recorded")
    if ax is None:
        return figure
    for curve in curves:
        if curve.train:
            ax.plot(*zip(*curve.train, strict=True), label=f"{curve.run} train", linewidth=1.2)
        if curve.val:
            ax.plot(*zip(*curve.val, strict=True), marker="o", label=f"{curve.run} validation", linewidth=1.2)
        if curve.selected_step is not None and curve.selected_val_loss is not None:
            ax.scatter([curve.selected_step], [curve.selected_val_loss], s=120, facecolors="none", edgecolors="black")
            ax.annotate(
                f"selected step {curve.selected_step}",
                (curve.selected_step, curve.selected_val_loss),
                textcoords="offset points",
                xytext=(8, 8),
                fontsize=8,
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token mean)")
    ax.legend(fontsize=8)
    return figure


def _ranking_figure(data: ReportData) -> Any:
    """One panel per ranked task: each trajectory's Bradley–Terry score with its bootstrap interval, best on top."""
    tasks = sorted({r.task for r in data.rankings})
    columns = min(3, max(1, len(tasks)))
    rows = max(1, -(-len(tasks) // columns))
    per_panel = max((sum(1 for r in data.rankings if r.task == t) for t in tasks), default=1)
    figure = _new_figure(3.4 * columns + 0.6, max(2.6, 0.22 * per_panel + 1.2) * rows)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    if not tasks:
        _empty(axes[0], "No ranking recorded")
        return figure
    for ax, task in zip(axes, tasks, strict=False):
        ranked = sorted((r for r in data.rankings if r.task == task), key=lambda r: r.rank)
        y = list(range(len(ranked)))[::-1]
        scores = [r.score for r in ranked]
        has_ci = [r.ci_low is not None and r.ci_high is not None for r in ranked]
        # A bootstrap percentile interval need not contain the point estimate (a fit on all matches can lie outside
        # the resampled fits' range, e.g. when every verdict is a tie): draw the interval's side that exists.
        lower = [max(0.0, r.score - r.ci_low) if ok else 0.0 for r, ok in zip(ranked, has_ci, strict=True)]  # type: ignore[operator]
        upper = [max(0.0, r.ci_high - r.score) if ok else 0.0 for r, ok in zip(ranked, has_ci, strict=True)]  # type: ignore[operator]
        ax.errorbar(scores, y, xerr=[lower, upper], fmt="o", color="#3d6f94", ecolor="#7aa6c2", capsize=2)
        ax.set_yticks(y, [f"{r.rank}. {r.name}" for r in ranked], fontsize=7)
        ax.axvline(0.0, color="#999999", linewidth=0.6)
        ax.set_title(f"task {task}", fontsize=9)
        ax.set_xlabel("Bradley–Terry score", fontsize=8)
    for ax in axes[len(tasks) :]:
        ax.set_axis_off()
    return figure


def _throughput_figure(data: ReportData) -> Any:
    """Tokens/s (all tokens and supervised ones) per step, and an MFU panel only where the trainer computed MFU."""
    with_mfu = [c for c in data.throughput if c.mfu]
    figure = _new_figure(9.0 if with_mfu else 6.0, 3.6)
    left, right = figure.subplots(1, 2) if with_mfu else (figure.subplots(), None)
    if not data.throughput:
        _empty(left, "No training throughput logged")
        return figure
    for curve in data.throughput:
        left.plot(*zip(*curve.tokens_per_s, strict=True), label=f"{curve.run} tokens/s", linewidth=1.2)
        if curve.supervised_tokens_per_s:
            left.plot(
                *zip(*curve.supervised_tokens_per_s, strict=True),
                label=f"{curve.run} supervised tokens/s",
                linewidth=1.0,
                linestyle="--",
            )
    left.set_xlabel("optimizer step")
    left.set_ylabel("tokens/s (all ranks)")
    left.legend(fontsize=8)
    if right is None:  # the table says in one line why there is no MFU
        return figure
    for curve in with_mfu:
        right.plot([s for s, _ in curve.mfu], [100 * v for _, v in curve.mfu], label=curve.run, linewidth=1.2)
    right.set_xlabel("optimizer step")
    right.set_ylabel("MFU (%)")
    right.legend(fontsize=8)
    return figure


def _tokens_figure(data: ReportData) -> Any:
    stages = [s for s in data.stages if s.prompt_tokens or s.completion_tokens]
    figure, ax = _single_axes(7.0, 3.8, bool(stages), "No token accounting recorded")
    if ax is None:
        return figure
    x = list(range(len(stages)))
    prompt = [s.prompt_tokens for s in stages]
    completion = [s.completion_tokens for s in stages]
    ax.bar(x, prompt, 0.6, label="prompt tokens", color="#7aa6c2")
    ax.bar(x, completion, 0.6, bottom=prompt, label="completion tokens", color="#3d6f94")
    top = max(p + c for p, c in zip(prompt, completion, strict=True))
    for i, stage in enumerate(stages):
        cost = "cost n/a" if stage.cost_usd is None else f"${stage.cost_usd:,.2f}"
        ax.text(i, prompt[i] + completion[i] + top * 0.02, cost, ha="center", fontsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(x, [s.stage for s in stages])
    ax.set_ylabel("tokens (LLM calls + agent episodes)")
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:,.0f}"))
    ax.legend(fontsize=8)
    return figure


def _time_figure(data: ReportData) -> Any:
    stages = [s for s in data.stages if s.span_s or s.busy_s or s.gpu_hours]
    figure = _new_figure(9.0, 3.8)
    left, right = figure.subplots(1, 2)
    if not stages:
        _empty(left, "No timings recorded")
        right.set_axis_off()
        return figure
    x = list(range(len(stages)))
    left.bar([i - 0.18 for i in x], [s.span_s / 3600 for s in stages], 0.36, label="wall-clock", color="#3d6f94")
    left.bar([i + 0.18 for i in x], [s.busy_s / 3600 for s in stages], 0.36, label="summed unit time", color="#7aa6c2")
    left.set_xticks(x, [s.stage for s in stages], rotation=30, ha="right")
    left.set_ylabel("hours")
    left.legend(fontsize=8)
    right.bar(x, [s.gpu_hours for s in stages], 0.6, color="#c8553d")
    right.set_xticks(x, [s.stage for s in stages], rotation=30, ha="right")
    right.set_ylabel("GPU-hours")
    return figure


def _benchmark_table_figure(data: ReportData) -> Any:
    """The paper's benchmark table as bars: score mean ± SD, and score per output token relative to L0."""
    return draw_benchmark_table(data.benchmark_table, _new_figure(10.0, 3.6))


FIGURE_BUILDERS: dict[str, Callable[[ReportData], Any]] = {
    "rhi_scoreboard": _scoreboard_figure,
    "search_coverage": _coverage_figure,
    "win_rate_by_generation": _win_rate_figure,
    "judge_agreement": _agreement_figure,
    "ranking_scores": _ranking_figure,
    "loss_curves": _loss_figure,
    "training_throughput": _throughput_figure,
    "tokens_cost": _tokens_figure,
    "wallclock_gpu": _time_figure,
    "benchmark_table": _benchmark_table_figure,
}


# Whether a figure has anything to show; one that has not is a line of text in the document, not a drawn panel.
FIGURE_HAS_DATA: dict[str, Callable[[ReportData], bool]] = {
    "rhi_scoreboard": lambda d: any(b.results or b.executed for b in d.scoreboard),
    "search_coverage": lambda d: any(b.results or b.executed for b in d.scoreboard),
    "win_rate_by_generation": lambda d: bool(d.evaluations),
    "judge_agreement": lambda d: any(a.decisive_pairs for e in d.evaluations for a in e.agreement.values()),
    "ranking_scores": lambda d: bool(d.rankings),
    "loss_curves": lambda d: any(c.train or c.val for c in d.curves),
    "training_throughput": lambda d: bool(d.throughput),
    "tokens_cost": lambda d: any(s.prompt_tokens or s.completion_tokens for s in d.stages),
    "wallclock_gpu": lambda d: any(s.span_s or s.busy_s or s.gpu_hours for s in d.stages),
    "benchmark_table": lambda d: bool(d.benchmark_table),
}


def drawn_figures(data: ReportData) -> list[str]:
    """The figures with something to show, in document order."""
    return [name for name, _title in FIGURES if FIGURE_HAS_DATA[name](data)]


def render_figures(data: ReportData, folder: Path) -> dict[str, Path]:
    """Every figure with something to show (`drawn_figures`) as a PNG in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in drawn_figures(data):
        figure = FIGURE_BUILDERS[name](data)
        path = folder / f"{name}.png"
        figure.savefig(path, format="png")
        paths[name] = path
    return paths
