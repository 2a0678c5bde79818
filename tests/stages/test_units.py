"""The request of one stage unit, as an episode pod runs it ahead of the stage: for every kind, exactly the request
the stage itself then runs (seen by the executor the stage is given), and one clear error where there is none yet."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from mass_ops.compute.kubernetes import EpisodeSpec
from mass_ops.layout import cycle_prefix
from mass_ops.runtime.episode import EpisodeRequest
from mass_ops.search import search_step
from mass_ops.serving import evaluation_scope
from mass_ops.stages.collect import collect_batch
from mass_ops.stages.evaluate import run_rollout_unit
from mass_ops.stages.units import EpisodeUnitError, episode_request, publish_prompt
from tests.evaluation.fakes import record_local_server, register_generations
from tests.inner_loop_fakes import FakeExecutor, InnerLoopEnv, inner_loop_fixture  # noqa: F401
from tests.stages.test_collect import retain


def by_slug(requests: list[EpisodeRequest]) -> dict[str, EpisodeRequest]:
    slugs = [request.unit.slug for request in requests]
    assert len(set(slugs)) == len(slugs), slugs
    return dict(zip(slugs, requests, strict=True))


def test_search_units_are_the_episodes_the_steps_run(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51, 202), iterations=1)
    ctx = opened.ctx
    ran: list[EpisodeRequest] = []
    opened.executor.on_episode = ran.append
    with pytest.raises(EpisodeUnitError) as caught:
        episode_request(ctx, EpisodeSpec("search", 51, version=1))
    assert str(caught.value) == (
        "search episode t51 v1: task 51: workflow version v1 does not exist yet; run step 0 first"
    )
    # The two pods before step 0: the reference and v0 (its prompt is the catalogue's, known from the start).
    first = [episode_request(ctx, EpisodeSpec("reference", 51)), episode_request(ctx, EpisodeSpec("search", 51, 0))]
    search_step(ctx, opened.executor, 51, 0, client=opened.client)
    assert by_slug(ran) == by_slug(first)
    # Step 0 proposed v1: its pod's request is now known, and it is the episode step 1 runs (the others are reused).
    ran.clear()
    second = episode_request(ctx, EpisodeSpec("search", 51, version=1))
    assert second.prompt != first[1].prompt and second.unit.seed != first[1].unit.seed
    search_step(ctx, opened.executor, 51, 1, client=opened.client)
    assert ran == [second]
    with pytest.raises(EpisodeUnitError, match=r"^search episode t51 v2: task 51: step 2 is outside 0\.\.1"):
        episode_request(ctx, EpisodeSpec("search", 51, version=2))


def test_collection_units_are_the_candidates_collection_runs(inner_loop: InnerLoopEnv) -> None:
    opened = inner_loop.open(tasks=(51, 202), candidates=3)
    ctx = opened.ctx
    with pytest.raises(EpisodeUnitError) as caught:
        episode_request(ctx, EpisodeSpec("collection", 51, candidate=0))
    assert str(caught.value) == (
        "collection episode t51 c0: task 51: no retained workflow yet; finish its search first"
    )
    retain(ctx, 51, 1)
    retain(ctx, 202, None)  # never beat the reference: skipped
    units = [episode_request(ctx, EpisodeSpec("collection", 51, candidate=c)) for c in range(3)]
    with pytest.raises(EpisodeUnitError, match=r"^collection episode t202 c0: task 202: no workflow version beat"):
        episode_request(ctx, EpisodeSpec("collection", 202, candidate=0))
    with pytest.raises(EpisodeUnitError, match=r"candidate 3 is outside 0\.\.2 \(collection\.candidates\)$"):
        episode_request(ctx, EpisodeSpec("collection", 51, candidate=3))
    ran: list[EpisodeRequest] = []
    opened.executor.on_episode = ran.append
    collect_batch(ctx, opened.executor)
    assert by_slug(ran) == by_slug(units)


def test_rollout_units_are_the_episodes_run_on_the_generations_server(
    inner_loop: InnerLoopEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # local servers' state files live under the cwd
    opened = inner_loop.open()
    ctx = opened.ctx
    register_generations(ctx.repo)
    for name in ("L0", "L1"):
        record_local_server(
            evaluation_scope(ctx.config), name, endpoint=f"http://127.0.0.1:9/{name}/v1", served_name=name
        )
    ran: list[EpisodeRequest] = []

    def executors(served: Any) -> contextlib.AbstractContextManager[FakeExecutor]:
        return contextlib.nullcontext(FakeExecutor(served, on_episode=ran.append))

    for generation in ("L1", "L0"):
        expected = episode_request(ctx, EpisodeSpec("rollout", 60, replicate=0, generation=generation))
        run_rollout_unit(ctx, generation, 60, 0, executor=executors)
        assert ran[-1] == expected
    # Paired by (task, replicate): the same seed, two units.
    assert ran[0].unit.seed == ran[1].unit.seed and ran[0].unit.slug != ran[1].unit.slug
    with pytest.raises(EpisodeUnitError, match=r"^rollout episode t60 r0 of L2: rollout: this cycle evaluates L1"):
        episode_request(ctx, EpisodeSpec("rollout", 60, replicate=0, generation="L2"))
    with pytest.raises(EpisodeUnitError, match="a rollout episode needs the generation it evaluates"):
        episode_request(ctx, EpisodeSpec("rollout", 60, replicate=0))
    # A benchmark episode's prompt is the dataset's: only its stage binds it (tests/evaluation/benchmarks/
    # test_pod_episodes.py); unbound, or bound to a prompt that is not stored, it has no request here.
    benchmark = EpisodeSpec("benchmark", "tb2_hello", candidate=0, generation="L1")
    with pytest.raises(EpisodeUnitError, match=r"^benchmark episode ttb2_hello c0 of L1: a benchmark episode is bound"):
        episode_request(ctx, benchmark)
    unstored = dataclasses.replace(
        benchmark, seed=1, condition="tb2_L1_t0", prompt_uri="s3://b/p", prompt_sha256="e" * 64
    )
    with pytest.raises(EpisodeUnitError, match="its prompt eeeeeeeeeeee… is not stored; bind it first"):
        episode_request(ctx, unstored)


def test_prompts_are_stored_once_under_their_hash(inner_loop: InnerLoopEnv) -> None:
    ctx = inner_loop.open().ctx
    request = episode_request(ctx, EpisodeSpec("reference", 51))
    uri = publish_prompt(ctx, request)
    key = f"{cycle_prefix(ctx.cycle_name)}/prompts/{request.prompt_sha256}.txt"
    assert uri == ctx.artifacts.uri(key) and ctx.artifacts.get_bytes(key) == request.prompt.encode()
    assert publish_prompt(ctx, request) == uri
    assert ctx.artifacts.list(f"{cycle_prefix(ctx.cycle_name)}/prompts/") == [key]
