"""The cycle report researchers read: Markdown and a self-contained HTML page with PNG figures, built only from the
metadata and artifact stores (nothing is recomputed by calling a model). Design notes: docs/report.md.

Submodules, bottom up (none imports the facade; `model` imports none of its siblings):
  model        the records the readers return (`ReportData`), `Block`, `FIGURES` and the report's stage names
  data_training, data_cost   readers of training runs (losses, throughput) and of what each stage used
  data         the other readers and `collect_report_data`, which gathers everything into one `ReportData`
  figures      one matplotlib builder per figure (`FIGURE_BUILDERS`) and `render_figures` (PNGs)
  blocks       one builder per section (`SECTIONS`) and `build_blocks`
  rendering    `render_markdown` and `render_html` (inline CSS, no scripts, figures as data URIs)
  publishing   `write_report`: figures first, then the pages, each published atomically
"""

from mass_ops.evaluation.report.blocks import SECTIONS, build_blocks
from mass_ops.evaluation.report.data import collect_report_data
from mass_ops.evaluation.report.figures import FIGURE_BUILDERS, NO_DECISIVE_PAIR, render_figures
from mass_ops.evaluation.report.model import (
    CALL_STAGE,
    EPISODE_STAGE,
    FIGURES,
    JUDGING_STAGES,
    STAGE_ORDER,
    Block,
    BudgetLine,
    CacheShare,
    DagRun,
    EstimateRow,
    JudgeValidity,
    LossCurve,
    PairwiseEvaluation,
    PromptDigest,
    RankedTrajectory,
    ReportData,
    StageCost,
    TaskScoreboard,
    ThroughputCurve,
    TrainingData,
)
from mass_ops.evaluation.report.publishing import write_report
from mass_ops.evaluation.report.rendering import render_html, render_markdown

__all__ = [
    "CALL_STAGE",
    "EPISODE_STAGE",
    "FIGURES",
    "FIGURE_BUILDERS",
    "JUDGING_STAGES",
    "NO_DECISIVE_PAIR",
    "SECTIONS",
    "STAGE_ORDER",
    "Block",
    "BudgetLine",
    "CacheShare",
    "DagRun",
    "EstimateRow",
    "JudgeValidity",
    "LossCurve",
    "PairwiseEvaluation",
    "PromptDigest",
    "RankedTrajectory",
    "ReportData",
    "StageCost",
    "TaskScoreboard",
    "ThroughputCurve",
    "TrainingData",
    "build_blocks",
    "collect_report_data",
    "render_figures",
    "render_html",
    "render_markdown",
    "write_report",
]
