"""A workspace the platform refuses to unpack (a bomb over the archive limits) is a recorded outcome of its pairs,
not a crash: it loses without a judge call, one line says why, memory stays small, and a rerun reuses the rows."""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import pytest

import mass_ops.store.artifacts as artifacts_module
from mass_ops.judge.evidence import EvidenceCaps
from mass_ops.judge.workspaces import EvidenceCache, StoredWorkspace, bundle_workspace
from mass_ops.stages.collect import collect_batch
from mass_ops.stages.rank import rank_tasks, ranking_candidates
from tests.fixtures.archives import zero_bomb
from tests.inner_loop_fakes import InnerLoopEnv, inner_loop_fixture  # noqa: F401
from tests.stages.test_collect import retain

BOMB_BYTES = 3 << 30  # unpacked; the archive is ~3 MB, under the byte cap, so the ratio is what refuses it


def test_a_workspace_bomb_loses_its_matches_without_a_call_and_a_rerun_reuses_them(
    inner_loop: InnerLoopEnv, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = inner_loop.open(tasks=(51,), candidates=4, train_ranks=2)
    ctx = opened.ctx
    retain(ctx, 51, 1)
    collect_batch(ctx, opened.executor)
    bomber = ranking_candidates(ctx, 51)[0]
    # The candidate's stored workspace becomes a ~3 MB tar.gz that would unpack to 3 GiB of zeros.
    ctx.artifacts.put_file(ctx.artifacts.key_of(bomber.workspace_uri), zero_bomb(tmp_path / "b.tar.gz", BOMB_BYTES))
    extracted: list[str] = []
    real_extract = artifacts_module.extract_tar_gz

    def counting_extract(archive: Path, destination: Path, **kwargs: object) -> int:
        extracted.append(str(kwargs["what"]))
        return real_extract(archive, destination, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(artifacts_module, "extract_tar_gz", counting_extract)

    caplog.set_level(logging.WARNING, logger="mass_ops.judge.workspaces")
    tracemalloc.start()
    try:
        (result,) = rank_tasks(ctx, client=opened.client)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak:,} bytes"

    rows = ctx.repo.comparisons(ctx.cycle_id, "ranking", task_id=51)
    involved = [row for row in rows if bomber.name in (row.side_a, row.side_b)]
    assert involved and len(rows) == result.matches == 4
    for row in involved:
        assert row.verdict == ("B" if row.side_a == bomber.name else "A")
        assert row.llm_call_id is None
        assert "was not judged: refusing to extract" in row.rationale and "bytes unpacked" in row.rationale
    assert len(inner_loop.judge_requests()) == len(rows) - len(involved)
    assert extracted.count(bomber.workspace_uri) == 1  # refused once, then the refusal is reused in the process
    refusals = [r.getMessage() for r in caplog.records if bomber.workspace_uri in r.getMessage()]
    assert len(refusals) == 1 and "\n" not in refusals[0] and "not judged" in refusals[0]

    # A rerun reuses every recorded outcome: no judge call, no fetch or extraction of the bomb.
    requests, extractions = len(inner_loop.judge_requests()), len(extracted)
    (again,) = rank_tasks(ctx, client=opened.client)
    assert (again.judged_now, len(inner_loop.judge_requests()), len(extracted)) == (0, requests, extractions)
    scores = {entry.name: entry.score for entry in again.ranked}
    assert scores[bomber.name] == min(scores.values())  # it lost every match it played


def test_a_refused_workspace_bundle_names_the_task_location_and_reason(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    ctx = inner_loop.open(tasks=(51,), candidates=2, train_ranks=1).ctx
    uri = ctx.artifacts.put_file("cycles/x/bomb/workspace.tar.gz", zero_bomb(tmp_path / "b.tar.gz", BOMB_BYTES)).uri
    source = StoredWorkspace(ctx.artifacts, uri, "ws")
    bundle = bundle_workspace(source, task_id=51, task_text="t", caps=EvidenceCaps.local("qwen"))
    assert (bundle.task_id, bundle.location) == (51, uri)
    assert bundle.refused is not None and bundle.refused.startswith(f"refusing to extract {uri}: more than")
    assert bundle.render("W").endswith(f"`{uri}`\n\nThe workspace was not unpacked: {bundle.refused}")
    # A cached value that is not a bundle needs its own marking: no silent mix-up of evidence kinds.
    with pytest.raises(TypeError, match="pass refuse="):
        EvidenceCache(lambda root, source: ("not", "a bundle")).get("k", source)
