"""Issue #25 item 9, driven as an attacker would: the hostile stand-in agent leaves a sparse 300 MiB report in its
workspace (no disk spent), the real runner publishes the workspace as a ~300 KB tar.gz, and the judge that reads it
back refuses to unpack it (over the archive ratio limit): the pair is decided without a judge call, not crashed."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from mass_ops.judge.evidence import EvidenceBundle, EvidenceCaps, build_bundle
from mass_ops.judge.pairwise import PairwiseCase, PairwiseJudge
from mass_ops.judge.workspaces import EvidenceCache, StoredWorkspace, WorkspaceSource
from mass_ops.llm.calls import CallLedger, CallUnit
from mass_ops.runtime.qwen_install import QwenInstall
from mass_ops.runtime.runner import EpisodeRunner
from mass_ops.store.untrusted import ARCHIVE_LIMITS
from tests.runtime.hostile_agent import hostile_findings
from tests.support.runtime import TASK, PolicyHost, hostile_prompt, open_episode_cycle, request, runner_environ

REPORT_BYTES = 300 << 20  # past the ratio limit's floor, so a ~1000:1 archive of it is refused

ATTACK = f"""
    import os
    path = os.path.join(str(workspace), "research_report.md")
    with open(path, "wb") as out:
        out.write(b"# A report that is mostly nothing\\n")
        out.truncate({REPORT_BYTES})
    report(size=os.path.getsize(path), blocks=os.stat(path).st_blocks)
"""


class _NoCalls:
    """A judge client that must never be asked: a refused workspace is decided without a model."""

    def chat(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("the judge model was called for a refused workspace")


def test_a_sparse_report_that_bloats_the_workspace_is_refused_by_the_judge_not_unpacked(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall, caplog: pytest.LogCaptureFixture
) -> None:
    assert ARCHIVE_LIMITS.ratio_floor < REPORT_BYTES
    with policy_host.serve() as server:
        ctx = open_episode_cycle(tmp_path, f"{server.base_url}/v1")
        runner = EpisodeRunner(ctx, install=hostile_install, environ=runner_environ(), scratch_dir=tmp_path / "s")
        outcome = asyncio.run(runner.run_attempt(request(ctx, hostile_prompt(ATTACK)), 1))
    unit = outcome.request.unit
    stream = ctx.artifacts.get_bytes(f"cycles/{unit.cycle}/episodes/{unit.slug}/a1/stream.jsonl").decode()
    (finding,) = hostile_findings(stream)
    assert finding["size"] == REPORT_BYTES and finding["blocks"] * 512 < 1 << 20  # sparse: the attack cost nothing
    uri = outcome.artifacts["workspace"]
    archive_bytes = ctx.artifacts.info(ctx.artifacts.key_of(uri)).size
    assert archive_bytes < REPORT_BYTES // ARCHIVE_LIMITS.max_ratio  # what makes it a bomb

    caps = EvidenceCaps.local("qwen")

    def build(root: Path, source: WorkspaceSource) -> EvidenceBundle:
        return build_bundle(root, task_id=TASK, task_text="t", location=source.location, caps=caps, name=source.name)

    caplog.set_level(logging.WARNING, logger="mass_ops.judge.workspaces")
    bundle = EvidenceCache(build).get("hostile", StoredWorkspace(ctx.artifacts, uri, "workspace"))
    assert bundle.refused is not None and "bytes unpacked" in bundle.refused
    (line,) = [r.getMessage() for r in caplog.records if uri in r.getMessage()]
    assert "not judged" in line and "\n" not in line

    fair = EvidenceBundle(TASK, f"query_{TASK}", "fair", "## Directory tree\nresearch_report.md")
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    judge = PairwiseJudge(_NoCalls(), ledger, lambda seed: SimpleNamespace())  # type: ignore[arg-type]
    unit_key = CallUnit(f"task{TASK}/ranking/hostile_vs_fair", "self_judge", TASK)
    case = PairwiseCase(unit_key, TASK, "t", "candidate-a", "candidate-b", bundle, fair, seed=1)
    verdict = judge.judge(case)
    assert (verdict.verdict, verdict.call_id, verdict.calls) == ("B", None, 0)
    assert verdict.rationale.startswith("workspace A was not judged: refusing to extract")
