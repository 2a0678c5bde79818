"""Metadata store throughput on a paper-sized cycle, and the latency of the stages' hot queries.

Records one cycle the way the stages do — every unit in its own idempotent transaction (≈ 260 episodes, ≈ 750 LLM
calls, ≈ 650 comparisons, ≈ 2 500 training windows holding ≈ 17 M loss tokens, plus versions, rankings, selections,
checkpoints, generations) — then records it all again (a retried stage: every unit a no-op). Baselines, measured in
the same run on the same database: the same rows as plain ``INSERT … RETURNING`` per unit (same commits, no
idempotency), and as plain INSERTs in one single transaction (raw insert speed).

    .venv/bin/python benchmarks/metadata_store.py                 # fresh database on 127.0.0.1:5432, dropped after
    .venv/bin/python benchmarks/metadata_store.py --url sqlite:////tmp/m.db
    .venv/bin/python benchmarks/metadata_store.py --tiny      # a few rows of each kind (what the suite runs)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from mass_ops.store import migrations
from mass_ops.store.metadata import MetadataStore, mask_url, resolve_url
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.schema import Base

DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


@dataclass(frozen=True)
class Workload:
    """How many rows of each kind one recorded cycle holds."""

    name: str
    search_tasks: tuple[int, ...]
    train_tasks: tuple[int, ...]
    test_tasks: tuple[int, ...]
    versions: int
    arbitrations: int  # champion arbitrations per task (data dependent; a typical count)
    candidates: int
    matches: int  # ring tournament per training task
    external_pairs: int  # report: pairs × 2 providers × 3 seeds
    windows: int
    training_steps: int = 1624  # a checkpoint every 50 steps and at the end
    loss_tokens_per_window: int = 6800
    window_batch: int = 500


# Paper cycle 1 (MASS_SPEC §1-§8): 9 searched tasks × (reference + v0..v11); 8 eligible tasks × 18 candidates, 54
# ring matches each (6 opponents); 2 500 windows × 6 800 ≈ 17 M supervised tokens.
PAPER = Workload(
    "paper-sized",
    search_tasks=(51, 53, 56, 202, 205, 221, 302, 307, 324),
    train_tasks=(51, 53, 56, 202, 205, 302, 307, 324),
    test_tasks=(60, 207, 305),
    versions=12,
    arbitrations=4,
    candidates=18,
    matches=54,
    external_pairs=12,
    windows=2500,
)
# The same shape at a few rows of each kind: the suite runs the script so it cannot rot (`--tiny`).
TINY = Workload(
    "tiny",
    search_tasks=(51, 221),
    train_tasks=(51,),
    test_tasks=(60,),
    versions=2,
    arbitrations=1,
    candidates=3,
    matches=2,
    external_pairs=1,
    windows=4,
    training_steps=100,
    window_batch=3,
)


class PlainInsertRepository(MetadataRepository):
    """Baseline writer: the same rows through plain ``INSERT … RETURNING`` (a duplicate would fail)."""

    def _insert_once(self, session: Session, model: Any, key: Any, values: Any, must_match: Any = ()) -> Any:
        return session.scalars(sa.insert(model).values(**key, **values).returning(model)).one()


class OneTransaction:
    """Store stand-in that runs every repository call inside one open session (one commit at the end)."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self.dialect = store.dialect
        self.session: Session | None = None

    @contextmanager
    def write(self) -> Iterator[Session]:
        assert self.session is not None
        yield self.session

    read = write

    @contextmanager
    def transaction_scope(self) -> Iterator[None]:
        with self.store.write() as session:
            self.session = session
            yield
        self.session = None


def record_cycle(repo: MetadataRepository, tag: str, work: Workload = PAPER) -> dict[str, int]:
    """Record one cycle of `work`; returns rows written per table (ids needed by the hot queries under '_')."""
    rows: dict[str, int] = {}

    def count(table: str, n: int = 1) -> None:
        rows[table] = rows.get(table, 0) + n

    cycle = repo.ensure_cycle(f"bench-{tag}", {"preset": "paper", "tag": tag}, "c" * 64, preset="paper")
    count("cycles")
    cycle_id = cycle.id
    for task in work.search_tasks + work.test_tasks:
        repo.record_cycle_task(cycle_id, task, "test" if task in work.test_tasks else "train", excluded=task == 221)
        count("cycle_tasks")

    usage = {"prompt_tokens": 80_000, "completion_tokens": 6_000}
    artifacts = {"workspace": "s3://b/ws.tar.gz", "api_log": "s3://b/api.jsonl.gz", "status": "s3://b/status.json"}
    episode_fields = dict(
        status="succeeded",
        model="Qwen/Qwen3.6-27B-FP8",
        exit_code=0,
        prompt_sha256="e" * 64,
        prompt_tokens=1_500_000,
        completion_tokens=80_000,
        requests=120,
        max_prompt_tokens=190_000,
        duration_s=5400.0,
        artifacts=artifacts,
        qwen_code_version="0.19.4",
    )

    for task in work.search_tasks:
        seed = 450000 + task
        reference = repo.record_episode(
            cycle_id, task_id=task, kind="reference", seed=seed, condition=f"t{task}_bare", **episode_fields
        )
        count("episodes")
        for version in range(work.versions):
            proposal_id = None
            if version > 0:
                proposal_id = repo.record_llm_call(
                    cycle_id, f"t{task}/optimizer/v{version - 1}_to_v{version}", purpose="optimizer", model="L0",
                    task_id=task, seed=seed, prompt_tokens=90_000, completion_tokens=7_000, usage=usage,
                    latency_s=60.0, prompt_uri="s3://b/p", result_uri="s3://b/r",
                ).id  # fmt: skip
                count("llm_calls")
            repo.record_workflow_version(
                cycle_id, task, version, design=f"Create an agent team ... v{version}", parent_version=version - 1
                if version else None, diff="-old\n+new", prompt_uri="s3://b/v", proposal_call_id=proposal_id,
            )  # fmt: skip
            count("workflow_versions")
            episode = repo.record_episode(
                cycle_id, task_id=task, kind="search", version=version, seed=seed + 1000 * version,
                condition=f"t{task}_v{version}", **episode_fields,
            )  # fmt: skip
            count("episodes")
            judge = repo.record_llm_call(
                cycle_id, f"t{task}/rhi/v{version}_vs_no_harness", purpose="judge", model="L0", task_id=task,
                seed=seed, prompt_tokens=60_000, completion_tokens=3_000, usage=usage, latency_s=40.0,
            )  # fmt: skip
            count("llm_calls")
            repo.record_comparison(
                cycle_id, task, "rhi", f"v{version}_vs_no_harness", side_a="no-harness-single-agent-baseline",
                side_b=f"multi-agent-design-v{version}", episode_a_id=reference.id, episode_b_id=episode.id,
                judge_model="L0", seed=seed, verdict="B" if version % 3 else "A", rationale="B ships every plot. " * 40,
                llm_call_id=judge.id, usage=usage,
            )  # fmt: skip
            count("comparisons")
        for arbitration in range(work.arbitrations):
            key = f"champion_v{arbitration}_vs_v{arbitration + 1}"
            call = repo.record_llm_call(
                cycle_id, f"t{task}/champion/{key}", purpose="arbitration", model="L0", task_id=task, seed=seed
            )
            count("llm_calls")
            repo.record_comparison(
                cycle_id, task, "champion", key, side_a=f"multi-agent-design-v{arbitration}",
                side_b=f"multi-agent-design-v{arbitration + 1}", judge_model="L0", seed=seed, verdict="B",
                llm_call_id=call.id,
            )  # fmt: skip
            count("comparisons")
        repo.record_retained_workflow(
            cycle_id, task, version=None if task == 221 else min(4, work.versions - 1), beats_reference=task != 221,
            last_evaluated_version=work.versions - 1, model="L0",
        )  # fmt: skip
        count("retained_workflows")

    pool: dict[int, list[int]] = {}
    for task in work.train_tasks:
        pool[task] = []
        for candidate in range(work.candidates):
            episode = repo.record_episode(
                cycle_id, task_id=task, kind="collection", candidate=candidate, seed=710000 + 100 * task + candidate,
                condition=f"t{task}_L0", **episode_fields,
            )  # fmt: skip
            pool[task].append(episode.id)
            count("episodes")
        for match in range(work.matches):
            a, b = pool[task][match % work.candidates], pool[task][(match * 7 + 1) % work.candidates]
            call = repo.record_llm_call(
                cycle_id, f"t{task}/ranking/m{match}", purpose="self_judge", model="L0", task_id=task,
                seed=1234 + 1000 * task + match, prompt_tokens=70_000, completion_tokens=2_000, usage=usage,
            )  # fmt: skip
            count("llm_calls")
            repo.record_comparison(
                cycle_id, task, "ranking", f"m{match}", side_a="candidate-a", side_b="candidate-b", episode_a_id=a,
                episode_b_id=b, judge_model="L0", seed=1234 + 1000 * task + match, verdict="AB"[match % 2],
                llm_call_id=call.id,
            )  # fmt: skip
            count("comparisons")
        for rank, episode_id in enumerate(pool[task], start=1):
            repo.record_ranking(cycle_id, episode_id, score=1.0 / rank, rank=rank, ci_low=-1.0, ci_high=1.0)
            count("rankings")
            if rank <= 16:
                repo.record_selection(cycle_id, episode_id, "train" if rank <= 15 else "val", rank=rank)
                count("selections")

    train = repo.record_dataset(
        cycle_id, "train", "s3://b/datasets/train", episodes=120, windows=work.windows,
        loss_tokens=work.windows * work.loss_tokens_per_window, total_tokens=work.windows * 30_000,
        stats={"aggregate": {}},
    )  # fmt: skip
    repo.record_dataset(cycle_id, "val", "s3://b/datasets/val", episodes=8, windows=0, loss_tokens=0, total_tokens=0)
    count("datasets", 2)
    selected = [episode for task in work.train_tasks for episode in pool[task][:15]]
    windows = [
        {
            "position": position,
            "episode_id": selected[position % len(selected)],
            "task_id": work.train_tasks[position % len(work.train_tasks)],
            "role": ("orchestrator", "worker", "auxiliary")[position % 3],
            "is_main": position % 3 == 0,
            "thread": f"{position % 97:010x}",
            "segment": position % 5,
            "window_index": position % 4,
            "n_windows": 4,
            "n_tokens": 30_000,
            "n_loss_tokens": work.loss_tokens_per_window,
        }
        for position in range(work.windows)
    ]
    for start in range(0, work.windows, work.window_batch):
        repo.record_windows(train.id, windows[start : start + work.window_batch])
    count("training_windows", work.windows)

    run = repo.ensure_training_run(cycle_id, "sft", {"steps": work.training_steps, "lr": 3e-5})
    count("training_runs")
    best = None
    for step in [*range(0, work.training_steps, 50), work.training_steps]:
        validated = step % 150 == 0 or step == work.training_steps
        checkpoint = repo.record_checkpoint(
            run.id, step, uri=f"s3://b/t/step_{step:05d}" if step else None,
            val_loss=1.0 / (1 + step) if validated else None, val_tokens=40_000 if validated else None,
        )  # fmt: skip
        best = checkpoint if validated and step else best
        count("checkpoints")
    base = repo.register_generation(f"L0-{tag}", 0, bf16_uri="s3://b/m/L0-bf16", fp8_uri="s3://b/m/L0-fp8")
    child = repo.register_generation(
        f"L1-{tag}", 1, bf16_uri="s3://b/m/L1-bf16", fp8_uri="s3://b/m/L1-fp8", parent_id=base.id, cycle_id=cycle_id,
        checkpoint_id=best.id if best else None, lineage={"cycle": f"bench-{tag}"},
    )  # fmt: skip
    count("model_generations", 2)
    for task in work.test_tasks:
        for replicate in range(max(1, work.external_pairs // len(work.test_tasks))):
            for provider in ("openai", "anthropic"):
                for seed in (42, 43, 44):
                    key = f"pair-{task}-{replicate}/{provider}/{seed}"
                    call = repo.record_llm_call(
                        cycle_id, f"external/{key}", purpose="external_judge", model=f"{provider}-judge",
                        provider=provider, task_id=task, seed=seed, cost_usd=0.4,
                    )  # fmt: skip
                    count("llm_calls")
                    repo.record_comparison(
                        cycle_id, task, "external", key, side_a=f"L1-{tag}", side_b=f"L0-{tag}",
                        judge_model=f"{provider}-judge", judge_provider=provider, seed=seed, swapped=seed == 44,
                        verdict="A", llm_call_id=call.id,
                    )  # fmt: skip
                    count("comparisons")
    repo.record_evaluation(
        f"bench-{tag}/external", "external_pairwise", generation_id=child.id, baseline_generation_id=base.id,
        cycle_id=cycle_id, results={"wins_a": 60, "wins_b": 12},
    )  # fmt: skip
    count("evaluations")
    rows["_cycle_id"], rows["_dataset_id"], rows["_run_id"], rows["_generation_id"] = (
        cycle_id, train.id, run.id, child.id,
    )  # fmt: skip
    return rows


def total(rows: dict[str, int]) -> int:
    return sum(n for table, n in rows.items() if not table.startswith("_"))


def timed(action: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = action()
    return result, time.perf_counter() - start


def hot_queries(repo: MetadataRepository, ids: dict[str, int], repeat: int) -> list[tuple[str, float, int]]:
    cycle, dataset, run, generation = ids["_cycle_id"], ids["_dataset_id"], ids["_run_id"], ids["_generation_id"]
    queries: list[tuple[str, Callable[[], Any]]] = [
        ("completed collection episodes of a task", lambda: repo.completed_episodes(cycle, 51, "collection")),
        ("attempts of one episode unit (skip check)", lambda: repo.episode_attempts(
            cycle, task_id=51, kind="collection", seed=715100, candidate=0)),
        ("one comparison by ledger key (resume check)", lambda: repo.get_comparison(
            cycle, 51, "rhi", "v3_vs_no_harness")),
        ("RHI ledger of a task", lambda: repo.comparisons(cycle, "rhi", task_id=51)),
        ("ranking ledger of a task", lambda: repo.comparisons(cycle, "ranking", task_id=51)),
        ("whole ranking ledger of the cycle", lambda: repo.comparisons(cycle, "ranking")),
        ("train selection", lambda: repo.selections(cycle, "train")),
        ("window groups (task x role) of a dataset", lambda: repo.window_groups(dataset)),
        ("orchestrator windows of a task", lambda: repo.windows(dataset, task_id=51, role="orchestrator")),
        ("LLM usage per purpose", lambda: repo.llm_usage(cycle)),
        ("episode usage per kind", lambda: repo.episode_usage(cycle)),
        ("best checkpoint", lambda: repo.best_checkpoint(run)),
        ("latest generation", repo.latest_generation),
        ("lineage of a generation", lambda: repo.lineage(generation)),
    ]  # fmt: skip
    results = []
    for name, query in queries:
        query()  # warm the statement cache and the connection pool
        durations = []
        for _ in range(repeat):
            result, seconds = timed(query)
            durations.append(seconds)
        size = len(result) if isinstance(result, list) else int(result is not None)
        results.append((name, statistics.median(durations) * 1000, size))
    return results


def create_database(admin_url: str) -> str:
    engine = sa.create_engine(resolve_url(admin_url), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    name = f"mass_bench_{uuid.uuid4().hex[:10]}"
    with engine.connect() as connection:
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    engine.dispose()
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def drop_database(admin_url: str, url: str) -> None:
    engine = sa.create_engine(resolve_url(admin_url), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')
    engine.dispose()


def run(url: str, repeat: int, work: Workload = PAPER) -> None:
    migrations.upgrade(url)
    store = MetadataStore(url)
    print(f"database: {mask_url(store.url)}")

    repo = MetadataRepository(store)
    rows, seconds = timed(lambda: record_cycle(repo, "units", work))
    n = total(rows)
    units_rate = n / seconds
    summary = ", ".join(f"{table} {count}" for table, count in rows.items() if not table.startswith("_"))
    print(f"{work.name} cycle: {n} rows ({summary})")
    print(f"  idempotent units, one transaction each : {seconds:7.2f} s  {units_rate:8.0f} rows/s")

    again, rerun_seconds = timed(lambda: record_cycle(repo, "units", work))
    assert again == rows, "a rerun must return the same rows"
    with store.read() as session:
        stored = sum(session.scalar(sa.select(sa.func.count()).select_from(t)) for t in Base.metadata.sorted_tables)
    assert stored == n, f"rerun wrote rows: {stored} stored, {n} expected"
    print(f"  rerun, every unit a no-op             : {rerun_seconds:7.2f} s  {n / rerun_seconds:8.0f} rows/s")

    plain_rows, plain_seconds = timed(lambda: record_cycle(PlainInsertRepository(store), "plain", work))
    plain_rate = total(plain_rows) / plain_seconds
    print(f"  baseline: plain INSERT per unit        : {plain_seconds:7.2f} s  {plain_rate:8.0f} rows/s")

    one = OneTransaction(store)
    bulk_repo = PlainInsertRepository(one)  # type: ignore[arg-type]  # duck-typed store
    with one.transaction_scope():
        bulk_rows, bulk_seconds = timed(lambda: record_cycle(bulk_repo, "bulk", work))
    bulk_rate = total(bulk_rows) / bulk_seconds
    print(f"  baseline: plain INSERTs, one transaction: {bulk_seconds:7.2f} s  {bulk_rate:8.0f} rows/s")
    print(f"ratio idempotent / plain per unit: {units_rate / plain_rate:.2f}  (cost of ON CONFLICT + read-back)")
    print(f"ratio idempotent / one transaction: {units_rate / bulk_rate:.2f}  (cost of a durable commit per unit)")

    print(f"hot queries (median of {repeat}):")
    for name, milliseconds, size in hot_queries(repo, rows, repeat):
        print(f"  {name:44s} {milliseconds:7.2f} ms  ({size} rows)")
    store.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="metadata database (default: a fresh Postgres database, dropped after)")
    parser.add_argument("--admin-url", default=DEFAULT_ADMIN_URL, help="Postgres maintenance database")
    parser.add_argument("--repeat", type=int, default=15, help="runs per hot query")
    parser.add_argument("--tiny", action="store_true", help="a few rows of each kind instead of a paper-sized cycle")
    args = parser.parse_args(argv)
    work = TINY if args.tiny else PAPER
    if args.url:
        run(args.url, args.repeat, work)
        return 0
    try:
        url = create_database(args.admin_url)
    except sa.exc.OperationalError as exc:
        print(f"Postgres at {mask_url(args.admin_url)} is unreachable: {exc.orig}; pass --url", file=sys.stderr)
        return 2
    try:
        run(url, args.repeat, work)
    finally:
        drop_database(args.admin_url, url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
