"""Teacher collection: eligibility, the frozen teacher prompt, seeds and conditions, one executor batch, failures
and crash-resume (MASS_SPEC §1 collect)."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mass_ops.context import CycleContext
from mass_ops.layout import teacher_prompt_key, workflow_version_key
from mass_ops.stages.collect import (
    CollectionError,
    collect_batch,
    eligibility,
    eligibility_key,
    freeze_teacher_prompt,
    run_collect,
)
from mass_ops.workflow import START_MARKER
from tests.inner_loop_fakes import (  # noqa: F401
    FailurePlan,
    InnerLoopEnv,
    inner_loop_fixture,
    kill_when,
    spawn_stage,
)


def retain(ctx: CycleContext, task_id: int, version: int | None, *, last: int = 1) -> str:
    """Record the outcome of a task's search directly: versions 0..last (v≥1 with a stored prompt) and the retained
    workflow. Returns the prompt of the retained (or last) version."""
    task = ctx.catalogue.task(task_id)
    template = task.initial_workflow
    prompts = {0: task.initial_prompt}
    for v in range(last + 1):
        design = template.design_block if v == 0 else f'{START_MARKER}\n["design v{v} of task {task_id}"]'
        if v:
            prompts[v] = template.render(design)
            ctx.artifacts.put_bytes(workflow_version_key(ctx.cycle_name, task_id, v), prompts[v].encode())
        ctx.repo.record_workflow_version(
            ctx.cycle_id, task_id, v, design=design, prompt_sha256=hashlib.sha256(prompts[v].encode()).hexdigest()
        )
    ctx.repo.record_retained_workflow(
        ctx.cycle_id, task_id, version=version, beats_reference=version is not None, last_evaluated_version=last
    )
    return prompts[last if version is None else version]


def test_teacher_candidates_run_with_reference_seeds_and_the_frozen_teacher_prompt(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51, 202), candidates=4)
    ctx = opened.ctx
    prompts = {51: retain(ctx, 51, 1), 202: retain(ctx, 202, 0)}
    batches: list[int] = []
    run = opened.executor.run
    opened.executor.run = lambda requests: batches.append(len(requests)) or run(requests)  # type: ignore[method-assign]

    results = collect_batch(ctx, opened.executor)
    assert batches == [8]  # every task's candidates in one batch
    assert [(r.task_id, r.decision, r.version_used, r.succeeded) for r in results] == [
        (51, "collect", 1, 4),
        (202, "collect", 0, 4),
    ]
    episodes = ctx.repo.episodes(ctx.cycle_id, kind="collection")
    assert sorted((e.task_id, e.candidate, e.seed, e.condition) for e in episodes) == sorted(
        [("51", i, 710000 + 5100 + i, "t51_L0") for i in range(4)]
        + [("202", i, 710000 + 20200 + i, "t202_L0") for i in range(4)]
    )
    # The directive exactly as its file reads, final newline kept (MASS_SPEC §1 collect).
    assert ctx.catalogue.source is not None
    directive = (ctx.catalogue.source / "teacher_directive.txt").read_bytes().decode("utf-8")
    assert directive.endswith("\n") and directive != ctx.catalogue.teacher_directive
    for task_id, prompt in prompts.items():
        stored = ctx.artifacts.get_bytes(teacher_prompt_key(ctx.cycle_name, task_id)).decode()
        assert stored == prompt.rstrip() + "\n\n" + directive
        expected_hash = hashlib.sha256(stored.encode()).hexdigest()
        assert {e.prompt_sha256 for e in episodes if e.task_id == str(task_id)} == {expected_hash}

    executed = list(opened.executor.executed)
    assert collect_batch(ctx, opened.executor)[0].succeeded == 4
    assert opened.executor.executed == executed  # a rerun reuses every finished episode


def test_a_task_that_never_beat_the_reference_is_skipped_with_a_clear_record(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51, 202), candidates=4)
    retain(opened.ctx, 51, None, last=1)
    retain(opened.ctx, 202, 1)
    rows = run_collect(opened.config, executor=opened.executor)
    skipped = rows[0]
    assert (skipped["task_id"], skipped["decision"], skipped["candidates"]) == (51, "skip", 0)
    assert "no workflow version beat the reference" in skipped["reason"]
    assert rows[1]["succeeded"] == 4
    record = opened.ctx.artifacts.get_json(eligibility_key(opened.ctx.cycle_name, 51))
    assert (record["decision"], record["beats_reference"], record["version_used"]) == ("skip", False, None)
    assert not opened.ctx.artifacts.exists(teacher_prompt_key(opened.ctx.cycle_name, 51))
    assert {e.task_id for e in opened.ctx.repo.episodes(opened.ctx.cycle_id, kind="collection")} == {"202"}


def test_the_demo_setting_lets_a_task_through_with_its_last_version_and_says_so(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51,), candidates=3, train_ranks=2, require_beats_reference=False)
    last_prompt = retain(opened.ctx, 51, None, last=2)
    decision = eligibility(opened.ctx, 51)
    assert (decision.decision, decision.version_used, decision.collects) == ("let_through", 2, True)
    assert "require_beats_reference is false" in decision.reason
    (result,) = collect_batch(opened.ctx, opened.executor)
    assert (result.decision, result.version_used, result.succeeded) == ("let_through", 2, 3)
    stored = opened.ctx.artifacts.get_bytes(teacher_prompt_key(opened.ctx.cycle_name, 51)).decode()
    assert stored.startswith(last_prompt.rstrip())
    assert opened.ctx.artifacts.get_json(eligibility_key(opened.ctx.cycle_name, 51))["decision"] == "let_through"


def test_a_changed_teacher_prompt_is_refused(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51,), candidates=3, train_ranks=2)
    retain(opened.ctx, 51, 1)
    key = teacher_prompt_key(opened.ctx.cycle_name, 51)
    opened.ctx.artifacts.put_bytes(key, b"an older teacher prompt")
    with pytest.raises(CollectionError, match="differs from the one built from workflow v1"):
        freeze_teacher_prompt(opened.ctx, 51, 1)
    with pytest.raises(CollectionError):
        collect_batch(opened.ctx, opened.executor)
    assert opened.ctx.repo.episodes(opened.ctx.cycle_id, kind="collection") == []


def test_a_directive_changed_since_the_catalogue_was_loaded_is_refused(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    opened = inner_loop.open(tasks=(51,), candidates=3, train_ranks=2)
    catalogue = opened.ctx.catalogue
    assert catalogue.source is not None
    copy = tmp_path / "catalogue"
    shutil.copytree(catalogue.source, copy)
    ctx = dataclasses.replace(opened.ctx, catalogue=dataclasses.replace(catalogue, source=copy))
    retain(ctx, 51, 1)
    (copy / "teacher_directive.txt").write_text("Another directive.\n", encoding="utf-8")
    with pytest.raises(CollectionError, match=r"teacher_directive\.txt: the teacher directive changed since"):
        freeze_teacher_prompt(ctx, 51, 1)
    assert not ctx.artifacts.exists(teacher_prompt_key(ctx.cycle_name, 51))


def test_bad_task_sets_and_unfinished_searches_are_refused(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51, 202), candidates=3, train_ranks=2)
    with pytest.raises(CollectionError, match=r"tasks \[60\] are not training tasks"):
        collect_batch(opened.ctx, opened.executor, [60])
    with pytest.raises(CollectionError, match="task 51: no retained workflow yet"):
        collect_batch(opened.ctx, opened.executor, [51])


def test_failed_candidates_are_counted_and_kept(inner_loop: InnerLoopEnv) -> None:
    failures = {
        "collection-t51-c1-s715101": FailurePlan(model_failure=True),
        "collection-t51-c2-s715102": FailurePlan(infra_attempts=9),
    }
    opened = inner_loop.open(tasks=(51,), candidates=4, train_ranks=2, executor_options={"failures": failures})
    retain(opened.ctx, 51, 1)
    (result,) = collect_batch(opened.ctx, opened.executor)
    assert (result.succeeded, result.model_failures, result.infra_failures) == (2, 1, 1)
    statuses = Counter(e.status for e in opened.ctx.repo.episodes(opened.ctx.cycle_id, kind="collection"))
    assert statuses == Counter({"succeeded": 2, "model_failure": 1, "infra_failure": 2})  # max_infra_attempts = 2


def test_a_collection_killed_mid_run_resumes_without_duplicates_or_losses(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    opened = inner_loop.open(tasks=(51, 202), candidates=6, train_ranks=2)
    retain(opened.ctx, 51, 1)
    retain(opened.ctx, 202, 0)
    repo, cycle = opened.ctx.repo, opened.ctx.cycle_id
    child = spawn_stage("collect", opened, tmp_path, latency=0.15)
    kill_when(child, lambda: len(repo.episodes(cycle, kind="collection")) >= 3)
    assert len(repo.episodes(cycle, kind="collection")) < 12

    results = collect_batch(opened.ctx, opened.executor)
    assert [r.succeeded for r in results] == [6, 6]
    episodes = repo.episodes(cycle, kind="collection")
    keys: Counter[Any] = Counter((e.task_id, e.candidate) for e in episodes)
    assert keys == Counter({(t, c): 1 for t in ("51", "202") for c in range(6)})
    assert all(e.attempt == 1 and e.status == "succeeded" for e in episodes)
