"""Evidence bundles and the pairwise judge (MASS_SPEC §5): `evidence` builds what a judge sees of a workspace,
`prompts` builds the messages (their texts are templates), `verdicts` holds the verdict schema and its strict and
lenient readings, `pairwise` makes the calls, `workspaces` says where a judged workspace comes from."""

from mass_ops.judge.evidence import EvidenceBundle, EvidenceCaps, EvidenceError, build_bundle, results_json_appendix
from mass_ops.judge.pairwise import JudgeOutcome, PairwiseCase, PairwiseJudge
from mass_ops.judge.prompts import (
    CANDIDATE_A_LABEL,
    CANDIDATE_B_LABEL,
    REFERENCE_LABEL,
    judge_system_prompt,
    judge_user_prompt,
    version_label,
)
from mass_ops.judge.verdicts import (
    VERDICT_PARSINGS,
    JudgeOutputError,
    PairwiseVerdict,
    VerdictParsing,
    parse_verdict,
    recorded_verdict,
)
from mass_ops.judge.workspaces import ExecutorWorkspace, StoredWorkspace, WorkspaceSource, bundle_workspace

__all__ = [
    "CANDIDATE_A_LABEL",
    "CANDIDATE_B_LABEL",
    "REFERENCE_LABEL",
    "VERDICT_PARSINGS",
    "EvidenceBundle",
    "EvidenceCaps",
    "EvidenceError",
    "ExecutorWorkspace",
    "JudgeOutcome",
    "JudgeOutputError",
    "PairwiseCase",
    "PairwiseJudge",
    "PairwiseVerdict",
    "StoredWorkspace",
    "VerdictParsing",
    "WorkspaceSource",
    "build_bundle",
    "bundle_workspace",
    "judge_system_prompt",
    "judge_user_prompt",
    "parse_verdict",
    "recorded_verdict",
    "results_json_appendix",
    "version_label",
]
