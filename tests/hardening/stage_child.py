"""The process the fault matrix kills: one writing stage of a cycle, run to its end through the stage functions.

    python -m tests.hardening.stage_child STAGE CONFIG.json [--latency S] [--workdir DIR]

Prints ``ready`` once its imports are done and the config is read (the parent times kills from then on), then runs
every unit of STAGE in order as the DAG's tasks would — search steps, collection candidates, ranked tasks and the
selection, render, train, export + register, evaluation rollouts, evaluate — and prints ``done``. Episodes come from
the fake executor of the inner-loop tests (a stand-in for qwen-code, with `--latency` seconds per episode); every LLM
call goes to the endpoint the config names (the parent's scripted policy server).

STAGE ``broken`` is deliberately not idempotent (each run records every unit again as a new attempt and publishes an
artifact under a per-process key): the fault matrix's own test uses it to show that the counters catch duplicates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

STAGES = ("search", "collect", "rank", "render", "train", "export", "rollout", "evaluate", "broken")
BROKEN_UNITS = 6


def _fake_executors(latency_s: float) -> Callable[..., contextlib.AbstractContextManager[object]]:
    """An executor factory (context → context manager) handing out the inner-loop fake executor."""
    from tests.inner_loop_fakes import FakeExecutor

    @contextlib.contextmanager
    def factory(ctx: object) -> Iterator[object]:
        yield FakeExecutor(ctx, latency_s=latency_s, capacity=1)  # type: ignore[arg-type]

    return factory


def _broken(config: object, latency_s: float) -> None:
    """A stage without idempotency: what the matrix must flag as duplicated units and orphaned artifacts."""
    from mass_ops.context import attach_cycle

    ctx = attach_cycle(config)  # type: ignore[arg-type]
    for unit in range(BROKEN_UNITS):
        key = f"broken/u{unit}"
        done = [row for row in ctx.repo.llm_calls(ctx.cycle_id) if row.unit_key.startswith(f"{key}/")]
        uri = ctx.artifacts.put_json(f"cycles/{ctx.cycle_name}/broken/{os.getpid()}/u{unit}.json", {"unit": unit}).uri
        time.sleep(latency_s)
        ctx.repo.record_llm_call(
            ctx.cycle_id,
            f"{key}/a{len(done) + 1}",
            purpose="judge",
            model="none",
            status="succeeded",
            result_uri=uri,
        )


def run_stage(stage: str, config_file: Path, latency_s: float, workdir: Path | None) -> None:
    """Every unit of `stage` for the cycle of `config_file`, in the order the DAG runs them."""
    from mass_ops.config import validate_config
    from mass_ops.context import attach_cycle
    from mass_ops.stages import api

    config = validate_config(json.loads(config_file.read_text()))
    executors = _fake_executors(latency_s)
    api.episode_executor = executors  # type: ignore[assignment]  # the stage functions look it up at call time
    print("ready", flush=True)
    if stage == "search":
        for task in api.search_tasks(config):
            for version in range(config.search.iterations + 1):
                api.search_step(config, task, version)
    elif stage == "collect":
        for task, candidate in api.collection_units(config):
            api.collect_candidate(config, task, candidate)
    elif stage == "rank":
        for task in api.ranking_tasks(config):
            api.rank_task(config, task)
        api.select(config)
    elif stage == "render":
        api.render(config)
    elif stage == "train":
        from mass_ops.stages.train import train

        train(config, workdir=workdir, accelerator="cpu")
        api.select_checkpoint(config)
    elif stage == "export":
        api.export(config)
        api.register(config)
    elif stage == "rollout":
        from mass_ops.stages.evaluate import rollout_units, run_rollout_unit

        ctx = attach_cycle(config)
        for generation, task, replicate in rollout_units(config):
            run_rollout_unit(ctx, generation, task, replicate, executor=executors)  # type: ignore[arg-type]
    elif stage == "evaluate":
        from mass_ops.stages.evaluate import evaluate

        evaluate(attach_cycle(config), executor=executors)  # type: ignore[arg-type]
    else:
        _broken(config, latency_s)
    print("done", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.hardening.stage_child")
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("config", type=Path)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per fake episode")
    parser.add_argument("--workdir", type=Path, default=None, help="train: the run folder")
    args = parser.parse_args(argv)
    run_stage(args.stage, args.config, args.latency, args.workdir)


if __name__ == "__main__":
    sys.exit(main())
