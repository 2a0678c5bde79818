"""Evaluation of a generation (MASS_SPEC §10; ARCHITECTURE step 10): rollouts, pairing, external pairwise judging,
win rates with intervals, judge agreement, score per output token, public-benchmark adapters and the report.

The stage functions the CLI and the DAG call (rollouts, pairing, judging, summary, report) live in
`mass_ops.stages.evaluate`; `report` renders with matplotlib, imported only when a report is written.
"""

from mass_ops.evaluation.agreement import Agreement, judge_agreement, majority
from mass_ops.evaluation.efficiency import Efficiency, ScoredEpisode, score_per_output_token
from mass_ops.evaluation.external import (
    SELF_JUDGE,
    AnthropicChatClient,
    ExternalJudgeError,
    ReportJudge,
    external_judges,
    open_external_judge,
    self_judge,
)
from mass_ops.evaluation.pairing import PairingError, RolloutPair, pair_id
from mass_ops.evaluation.rollouts import RolloutError, RolloutSet, load_rollout_set, rollout_sets
from mass_ops.evaluation.stats import Judgment, PairwiseSummary, WinRate, wilson_interval, win_rate

__all__ = [
    "SELF_JUDGE",
    "Agreement",
    "AnthropicChatClient",
    "Efficiency",
    "ExternalJudgeError",
    "Judgment",
    "PairingError",
    "PairwiseSummary",
    "ReportJudge",
    "RolloutError",
    "RolloutPair",
    "RolloutSet",
    "ScoredEpisode",
    "WinRate",
    "external_judges",
    "judge_agreement",
    "load_rollout_set",
    "majority",
    "open_external_judge",
    "pair_id",
    "rollout_sets",
    "score_per_output_token",
    "self_judge",
    "wilson_interval",
    "win_rate",
]
