"""Metadata store and repository on SQLite and Postgres: every table round-trips, units are idempotent."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from mass_ops.store import migrations
from mass_ops.store.metadata import MetadataStore, MetadataURLError, mask_url
from mass_ops.store.repository import (
    ConfigChangedError,
    InvalidRecordError,
    MetadataRepository,
    UnitConflictError,
)
from mass_ops.store.schema import Base, Episode, ModelGeneration, episode_unit_key

CONFIG = {"name": "paper-L0", "search": {"iterations": 11, "seed_base": 450000}}
HASH = "a" * 64


@pytest.fixture(scope="module")
def migrated_url(metadata_module_url: str) -> str:
    """One migrated database per backend for this module; `repo` empties it before each test."""
    migrations.upgrade(metadata_module_url)
    return metadata_module_url


@pytest.fixture
def repo(migrated_url: str) -> Iterator[MetadataRepository]:
    store = MetadataStore(migrated_url)
    with store.transaction() as connection:
        # Generations reference their parent with ON DELETE RESTRICT: unlink them before deleting.
        connection.execute(sa.update(ModelGeneration).values(parent_id=None))
        for table in reversed(Base.metadata.sorted_tables):
            connection.execute(table.delete())
    repository = MetadataRepository(store)
    yield repository
    store.dispose()


@pytest.fixture
def cycle_id(repo: MetadataRepository) -> int:
    return repo.ensure_cycle("paper-L0", CONFIG, HASH, generation=0, preset="paper", parent_model="L0").id


def _count(repo: MetadataRepository, model: type[Base]) -> int:
    with repo.store.read() as session:
        return session.scalar(sa.select(sa.func.count()).select_from(model))


def _episode(repo: MetadataRepository, cycle_id: int, **overrides: object) -> Episode:
    fields: dict[str, object] = {"task_id": 51, "kind": "search", "seed": 453051, "status": "succeeded", "version": 3}
    fields.update(overrides)
    return repo.record_episode(cycle_id, **fields)


# -- engine and URLs ---------------------------------------------------------------------------------------------


def test_urls_never_show_passwords():
    store = MetadataStore("postgresql://mass:s3cret-pw@db.internal:5432/mass")
    assert "s3cret-pw" not in repr(store)
    assert "***" in repr(store)
    assert "s3cret-pw" not in mask_url("postgresql://mass:s3cret-pw@db/mass")
    store.dispose()


@pytest.mark.parametrize("url", ["mysql://root@localhost/mass", "not a url"])
def test_unsupported_urls_are_refused_with_a_clear_message(url: str):
    with pytest.raises(MetadataURLError, match="metadata URL"):
        MetadataStore(url)


def test_postgres_urls_get_an_installed_driver():
    store = MetadataStore("postgres://postgres@127.0.0.1/x")
    assert store.dialect == "postgresql"
    assert store.url.drivername in {"postgresql+psycopg", "postgresql+psycopg2"}
    store.dispose()


def test_sqlite_runs_in_wal_mode_with_foreign_keys_and_busy_timeout(tmp_path):
    store = MetadataStore(f"sqlite:///{tmp_path / 'nested' / 'dir' / 'm.db'}")
    with store.read() as session:
        assert session.execute(sa.text("PRAGMA journal_mode")).scalar() == "wal"
        assert session.execute(sa.text("PRAGMA foreign_keys")).scalar() == 1
        assert session.execute(sa.text("PRAGMA busy_timeout")).scalar() >= 10_000
    assert (tmp_path / "nested" / "dir" / "m.db").exists()
    store.dispose()


def test_in_memory_sqlite_shares_one_database_across_sessions():
    store = MetadataStore("sqlite://")
    Base.metadata.create_all(store.engine)
    repo = MetadataRepository(store)
    created = repo.ensure_cycle("mem", {}, HASH)
    assert repo.get_cycle("mem").id == created.id
    store.dispose()


def test_write_rolls_back_when_the_block_raises(repo: MetadataRepository, cycle_id: int):
    with pytest.raises(RuntimeError), repo.store.write() as session:
        session.add(
            Episode(cycle_id=cycle_id, unit_key="x", task_id="51", kind="search", seed=1, attempt=1, status="succeeded")
        )
        session.flush()
        raise RuntimeError("boom")
    assert _count(repo, Episode) == 0


# -- cycles ------------------------------------------------------------------------------------------------------


def test_ensure_cycle_freezes_the_config(repo: MetadataRepository, cycle_id: int):
    again = repo.ensure_cycle("paper-L0", CONFIG, HASH)
    assert again.id == cycle_id
    assert again.config == CONFIG
    assert again.preset == "paper"
    assert again.status == "pending"
    with pytest.raises(ConfigChangedError, match=r"paper-L0.*new cycle name"):
        repo.ensure_cycle("paper-L0", {**CONFIG, "search": {"iterations": 3}}, "b" * 64)
    assert repo.get_cycle("paper-L0").config_hash == HASH
    assert repo.get_cycle("missing") is None


def test_cycle_provenance_is_recorded_once_per_kind(repo: MetadataRepository, cycle_id: int):
    repo.set_cycle_provenance(cycle_id, "catalogue", {"identity": "builtin"})
    repo.set_cycle_provenance(cycle_id, "prompts", {"judge_user.j2": "ab" * 32})
    repo.set_cycle_provenance(cycle_id, "catalogue", {"identity": "builtin"})  # the same again is fine
    row = repo.get_cycle("paper-L0")
    assert row is not None and row.provenance == {
        "catalogue": {"identity": "builtin"},
        "prompts": {"judge_user.j2": "ab" * 32},
    }
    with pytest.raises(UnitConflictError, match="recorded its catalogue"):
        repo.set_cycle_provenance(cycle_id, "catalogue", {"identity": "imported:mass@0123456789ab"})


def test_cycle_status_transitions_stamp_times(repo: MetadataRepository, cycle_id: int):
    running = repo.set_cycle_status(cycle_id, "running")
    assert running.status == "running" and running.finished_at is None
    done = repo.set_cycle_status(cycle_id, "succeeded")
    assert done.finished_at is not None and done.finished_at.tzinfo is not None
    with pytest.raises(InvalidRecordError, match="'paused' is not one of"):
        repo.set_cycle_status(cycle_id, "paused")
    with pytest.raises(InvalidRecordError, match="cycle 999"):
        repo.set_cycle_status(999, "running")


# -- the whole cycle, table by table -----------------------------------------------------------------------------


def test_every_table_round_trips(repo: MetadataRepository, cycle_id: int):
    started = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)

    task = repo.record_cycle_task(cycle_id, 51, "train", bare_prompt_sha256="b" * 64, initial_prompt_sha256="c" * 64)
    repo.add_budget_spend(cycle_id, ["cycle", "task:51"], tokens=1200, cost_usd=0.5)
    assert {scope: row.tokens for scope, row in repo.budget_spend(cycle_id).items()} == {"cycle": 1200, "task:51": 1200}
    # A keyed charge (a pod's episode attempt) is added once: the marker commits with the increments.
    assert repo.add_budget_spend(cycle_id, ["cycle"], tokens=5, charge_key="episode:1") is True
    assert repo.add_budget_spend(cycle_id, ["cycle"], tokens=5, charge_key="episode:1") is False
    assert repo.budget_spend(cycle_id)["cycle"].tokens == 1205
    excluded = repo.record_cycle_task(cycle_id, 221, "train", excluded=True, exclusion_reason="never beat reference")
    repo.record_cycle_task(cycle_id, 60, "test")
    assert task.task_id == "51" and not task.excluded
    assert excluded.excluded and excluded.exclusion_reason == "never beat reference"
    assert [t.task_id for t in repo.cycle_tasks(cycle_id, split="test")] == ["60"]

    proposal = repo.record_llm_call(
        cycle_id,
        "t51/optimizer/v0_to_v1",
        purpose="optimizer",
        model="L0",
        task_id=51,
        seed=450051,
        prompt_tokens=90_000,
        completion_tokens=7_000,
        usage={"prompt_tokens": 90_000, "completion_tokens": 7_000},
        cost_usd=0.0,
        latency_s=61.5,
        prompt_uri="s3://b/p/full_prompt.txt",
        result_uri="s3://b/p/result.json",
    )
    v0 = repo.record_workflow_version(cycle_id, 51, 0, design="Create an agent team ... v0", prompt_sha256="d" * 64)
    v1 = repo.record_workflow_version(
        cycle_id,
        51,
        1,
        design="Create an agent team ... v1",
        parent_version=0,
        diff="-v0\n+v1",
        proposal_call_id=proposal.id,
    )
    assert [v.version for v in repo.workflow_versions(cycle_id, 51)] == [0, 1]
    assert v1.parent_version == v0.version and v1.proposal_call_id == proposal.id and v1.diff == "-v0\n+v1"

    reference = _episode(repo, cycle_id, kind="reference", version=None, seed=450051, condition="t51_bare")
    search = _episode(
        repo,
        cycle_id,
        version=1,
        seed=451051,
        condition="t51_v1",
        model="Qwen/Qwen3.6-27B-FP8",
        exit_code=0,
        prompt_sha256="e" * 64,
        prompt_tokens=1_500_000,
        completion_tokens=80_000,
        requests=120,
        max_prompt_tokens=190_000,
        started_at=started,
        finished_at=started + timedelta(minutes=95),
        artifacts={"workspace": "s3://b/ws.tar.gz", "api_log": "s3://b/api.jsonl.gz"},
        qwen_code_version="0.19.4",
    )
    assert search.duration_s == pytest.approx(95 * 60)
    assert search.started_at == started and search.started_at.tzinfo is not None
    assert search.artifacts["api_log"] == "s3://b/api.jsonl.gz"
    assert search.unit_key == "search-t51-v1-s451051/a1"
    assert repo.get_episode(search.id).prompt_tokens == 1_500_000

    # An attempt in flight has a lease (its row comes when it ends): one per unit, the later attempt replacing it.
    unit = {"task_id": 51, "kind": "search", "seed": 451052, "version": 2}
    first = repo.start_episode_lease(cycle_id, attempt=1, host="node-a pid 7", started_at=started, **unit)
    second = repo.start_episode_lease(cycle_id, attempt=2, host="ep-search-t51-v2", **unit)
    rollout = repo.start_episode_lease(cycle_id, task_id=60, kind="rollout", seed=9, attempt=1, candidate=0,
                                       generation="L1")  # fmt: skip
    (lease, other) = repo.episode_leases(cycle_id)
    assert (lease.id, lease.unit_key, lease.task_id, lease.version, lease.candidate) == (
        first.id, "search-t51-v2-s451052", "51", 2, None,
    )  # fmt: skip
    assert (lease.attempt, lease.host) == (2, "ep-search-t51-v2") and lease.started_at > started
    assert lease.started_at.tzinfo is not None and second.attempt == 2
    assert (other.unit_key, other.generation, other.candidate) == ("rollout-t60-c0-s9-gL1", "L1", 0)
    assert repo.end_episode_lease(cycle_id, attempt=1, **unit) is False, "attempt 1's end keeps attempt 2's lease"
    assert repo.end_episode_lease(cycle_id, attempt=2, **unit) is True
    assert [row.id for row in repo.episode_leases(cycle_id)] == [rollout.id]
    assert rollout.renewed_at is None, "a pod's lease: nothing renews it"
    renewed = repo.start_episode_lease(cycle_id, attempt=3, started_at=started, renewed=True, **unit)  # stays
    assert renewed.renewed_at == renewed.started_at == started, "a local runner's lease starts renewed"
    assert repo.renew_episode_lease(cycle_id, attempt=2, **unit) is False, "only the attempt it names renews it"
    assert repo.renew_episode_lease(cycle_id, attempt=3, **unit) is True
    (kept,) = [row for row in repo.episode_leases(cycle_id) if row.unit_key == "search-t51-v2-s451052"]
    assert kept.renewed_at is not None and kept.renewed_at > started

    judge = repo.record_llm_call(cycle_id, "t51/rhi/v1_vs_no_harness", purpose="judge", model="L0", seed=450051)
    rhi = repo.record_comparison(
        cycle_id,
        51,
        "rhi",
        "v1_vs_no_harness",
        side_a="no-harness-single-agent-baseline",
        side_b="multi-agent-design-v1",
        episode_a_id=reference.id,
        episode_b_id=search.id,
        judge_model="L0",
        seed=450051,
        verdict="B",
        rationale="B delivers every plot.",
        rationale_uri="s3://b/c/result.json",
        llm_call_id=judge.id,
        usage={"prompt_tokens": 60_000},
    )
    assert rhi.verdict == "B" and rhi.swapped is False and rhi.usage == {"prompt_tokens": 60_000}
    assert repo.get_comparison(cycle_id, 51, "rhi", "v1_vs_no_harness").id == rhi.id
    assert repo.get_comparison(cycle_id, 51, "champion", "v1_vs_no_harness") is None

    retained = repo.record_retained_workflow(
        cycle_id, 51, version=1, beats_reference=True, last_evaluated_version=11, model="L0"
    )
    nothing = repo.record_retained_workflow(
        cycle_id, 221, version=None, beats_reference=False, last_evaluated_version=11
    )
    assert retained.version == 1 and nothing.version is None
    assert [r.task_id for r in repo.retained_workflows(cycle_id)] == ["51", "221"]

    pool = [
        _episode(repo, cycle_id, kind="collection", version=None, candidate=i, seed=715100 + i, condition="t51_L0")
        for i in range(3)
    ]
    for rank, episode in enumerate(reversed(pool), start=1):
        repo.record_ranking(cycle_id, episode.id, score=1.0 / rank, rank=rank, ci_low=-0.5, ci_high=0.5)
        repo.record_selection(cycle_id, episode.id, "train" if rank < 3 else "val", rank=rank)
    ranking = repo.rankings(cycle_id, 51)
    assert [r.episode_id for r in ranking] == [pool[2].id, pool[1].id, pool[0].id]
    assert ranking[0].task_id == "51" and ranking[0].ci_high == 0.5
    assert [s.rank for s in repo.selections(cycle_id, "train")] == [1, 2]
    assert [s.episode_id for s in repo.selections(cycle_id, "val")] == [pool[0].id]

    dataset = repo.record_dataset(
        cycle_id,
        "train",
        "s3://b/datasets/train",
        episodes=2,
        windows=4,
        loss_tokens=1000,
        total_tokens=9000,
        stats={"aggregate": {"windows": 4}},
        tokenizer="L0",
    )
    assert repo.get_dataset(cycle_id, "train").stats == {"aggregate": {"windows": 4}}
    assert repo.get_dataset(cycle_id, "val") is None
    windows = [
        {
            "position": i,
            "episode_id": pool[2].id,
            "task_id": 51,
            "role": "orchestrator" if i == 0 else "worker",
            "is_main": i == 0,
            "thread": "abc123",
            "segment": 0,
            "window_index": i,
            "n_windows": 4,
            "n_tokens": 2000 + i,
            "n_loss_tokens": 250,
        }
        for i in range(4)
    ]
    assert repo.record_windows(dataset.id, windows) == 4
    assert [w.position for w in repo.windows(dataset.id, role="worker")] == [1, 2, 3]
    assert repo.windows(dataset.id)[0].weight == 1.0
    groups = {(g.task_id, g.role): (g.windows, g.loss_tokens) for g in repo.window_groups(dataset.id)}
    assert groups == {("51", "orchestrator"): (1, 250), ("51", "worker"): (3, 750)}

    run = repo.ensure_training_run(cycle_id, "sft", {"steps": 1624, "lr": 3e-5, "lora_r": 64})
    assert repo.set_training_run_status(run.id, "running").started_at is not None
    repo.record_checkpoint(run.id, 0, val_loss=1.30, val_tokens=40_000)
    best = repo.record_checkpoint(run.id, 150, uri="s3://b/t/step_00150", val_loss=1.10, val_tokens=40_000)
    repo.record_checkpoint(run.id, 200, uri="s3://b/t/step_00200", train_loss=0.9)
    finished = repo.set_training_run_status(run.id, "succeeded", log_uri="s3://b/t/train_log.jsonl")
    assert finished.finished_at is not None and finished.log_uri == "s3://b/t/train_log.jsonl"
    assert [c.step for c in repo.checkpoints(run.id)] == [0, 150, 200]
    assert repo.best_checkpoint(run.id).id == best.id

    base = repo.register_generation("L0", 0, bf16_uri="s3://b/models/L0-bf16", fp8_uri="s3://b/models/L0-fp8")
    child = repo.register_generation(
        "L1",
        1,
        bf16_uri="s3://b/models/L1-bf16",
        fp8_uri="s3://b/models/L1-fp8",
        parent_id=base.id,
        cycle_id=cycle_id,
        checkpoint_id=best.id,
        served_name="mass-L1",
        lineage={"config_hash": HASH, "dataset": dataset.uri, "checkpoint_step": 150},
    )
    assert repo.get_generation("L1").lineage["checkpoint_step"] == 150
    assert child.registered_at.tzinfo is not None

    evaluation = repo.record_evaluation(
        "paper-L0/external",
        "external_pairwise",
        generation_id=child.id,
        baseline_generation_id=base.id,
        cycle_id=cycle_id,
        results={"wins_a": 10, "wins_b": 5, "ties": 3, "win_rate_a": 10 / 15},
        results_uri="s3://b/eval/summary.json",
    )
    assert evaluation.results["win_rate_a"] == pytest.approx(2 / 3)
    assert [e.id for e in repo.evaluations(generation_id=base.id)] == [evaluation.id]
    assert repo.evaluations(kind="benchmark:sab") == []

    # Every table received at least one row.
    for table in Base.metadata.sorted_tables:
        with repo.store.read() as session:
            assert session.scalar(sa.select(sa.func.count()).select_from(table)) > 0, table.name


# -- idempotency and unit keys -----------------------------------------------------------------------------------


def test_recording_a_unit_twice_returns_the_first_row(repo: MetadataRepository, cycle_id: int):
    first = _episode(repo, cycle_id, prompt_sha256="f" * 64, requests=10)
    again = _episode(repo, cycle_id, prompt_sha256="f" * 64, requests=99)
    assert again.id == first.id
    assert again.requests == 10  # the second call changed nothing

    call = repo.record_llm_call(cycle_id, "k1", purpose="judge", model="L0")
    assert repo.record_llm_call(cycle_id, "k1", purpose="judge", model="L0", latency_s=3.0).id == call.id
    comparison = dict(side_a="a", side_b="b", judge_model="L0", verdict="tie")
    assert (
        repo.record_comparison(cycle_id, 51, "ranking", "m0", **comparison).id
        == repo.record_comparison(cycle_id, "51", "ranking", "m0", **comparison).id
    )
    version = repo.record_workflow_version(cycle_id, 51, 0, design="d")
    assert repo.record_workflow_version(cycle_id, 51, 0, design="d").id == version.id
    assert repo.register_generation("L0", 0, bf16_uri="u").id == repo.register_generation("L0", 0, bf16_uri="u").id
    assert _count(repo, Episode) == 1


def test_unit_key_distinguishes_every_identity_field(repo: MetadataRepository, cycle_id: int):
    variants = [
        {},
        {"version": 4},
        {"version": None},
        {"attempt": 2},
        {"seed": 453052},
        {"task_id": 53},
        {"kind": "rollout", "version": None, "candidate": 0, "generation": "L0"},
        {"kind": "rollout", "version": None, "candidate": 0, "generation": "L1"},
        {"kind": "rollout", "version": None, "candidate": 1, "generation": "L1"},
        {"kind": "collection", "version": None, "candidate": 0},
    ]
    ids = {_episode(repo, cycle_id, **variant).id for variant in variants}
    assert len(ids) == len(variants) == _count(repo, Episode)
    other_cycle = repo.ensure_cycle("cycle2-L1", CONFIG, HASH, generation=1).id
    assert _episode(repo, other_cycle).id not in ids


def test_unit_key_format_is_stable():
    assert (
        episode_unit_key(task_id="51", kind="search", seed=453051, attempt=1, version=3) == "search-t51-v3-s453051/a1"
    )
    assert (
        episode_unit_key(task_id="305", kind="rollout", seed=940500, attempt=2, candidate=0, generation="L1")
        == "rollout-t305-c0-s940500-gL1/a2"
    )


def test_same_key_with_different_content_is_a_conflict(repo: MetadataRepository, cycle_id: int):
    _episode(repo, cycle_id, prompt_sha256="1" * 64)
    with pytest.raises(UnitConflictError, match="prompt_sha256"):
        _episode(repo, cycle_id, prompt_sha256="2" * 64)
    repo.record_workflow_version(cycle_id, 51, 2, design="first design")
    with pytest.raises(UnitConflictError, match=r"workflow_versions .*design"):
        repo.record_workflow_version(cycle_id, 51, 2, design="another design")
    repo.ensure_training_run(cycle_id, "sft", {"steps": 10, "shape": (1, 2)})
    assert repo.ensure_training_run(cycle_id, "sft", {"steps": 10, "shape": [1, 2]}).args == {
        "steps": 10,
        "shape": [1, 2],
    }
    with pytest.raises(UnitConflictError, match="args"):
        repo.ensure_training_run(cycle_id, "sft", {"steps": 11})


def test_retries_are_new_attempts_and_only_successes_count(repo: MetadataRepository, cycle_id: int):
    failed = _episode(
        repo, cycle_id, kind="collection", version=None, candidate=4, seed=715104, status="infra_failure",
        failure={"subtype": "api_error_infra", "message": "ECONNRESET"},
    )  # fmt: skip
    retry = _episode(
        repo, cycle_id, kind="collection", version=None, candidate=4, seed=715104, attempt=2, retry_of_id=failed.id
    )
    _episode(repo, cycle_id, kind="collection", version=None, candidate=5, seed=715105, status="model_failure")
    attempts = repo.episode_attempts(cycle_id, task_id=51, kind="collection", seed=715104, candidate=4)
    assert [(e.attempt, e.status) for e in attempts] == [(1, "infra_failure"), (2, "succeeded")]
    assert attempts[0].failure == {"subtype": "api_error_infra", "message": "ECONNRESET"}
    assert attempts[1].retry_of_id == failed.id
    assert [e.id for e in repo.completed_episodes(cycle_id, 51, "collection")] == [retry.id]
    assert len(repo.episodes(cycle_id, kind="collection")) == 3
    assert len(repo.episodes(cycle_id, status="model_failure")) == 1
    assert repo.completed_episodes(cycle_id, 53, "collection") == []


def test_bad_values_and_missing_rows_are_refused(repo: MetadataRepository, cycle_id: int):
    with pytest.raises(InvalidRecordError, match="episode kind 'training' is not one of"):
        _episode(repo, cycle_id, kind="training")
    with pytest.raises(InvalidRecordError, match="verdict 'C'"):
        repo.record_comparison(cycle_id, 51, "rhi", "k", side_a="a", side_b="b", judge_model="m", verdict="C")
    with pytest.raises(InvalidRecordError, match="episodes"):
        _episode(repo, 12345)  # no such cycle: the foreign key refuses it on both databases
    with pytest.raises(InvalidRecordError, match="episode 777 does not exist in cycle"):
        repo.record_selection(cycle_id, 777, "train")
    with pytest.raises(InvalidRecordError, match="not a JSON document"):
        _episode(repo, cycle_id, failure={"when": object()})
    with pytest.raises(InvalidRecordError, match="unknown fields"):
        repo.record_windows(1, [{"position": 0, "input_ids": [1, 2]}])
    with pytest.raises(InvalidRecordError, match=r"started_at .* no time zone"):
        _episode(repo, cycle_id, started_at=datetime(2026, 1, 1))
    assert _count(repo, Episode) == 0


def test_windows_are_recorded_once_per_position(repo: MetadataRepository, cycle_id: int):
    dataset = repo.record_dataset(cycle_id, "val", "u", episodes=1, windows=3, loss_tokens=3, total_tokens=9)

    def window(position: int) -> dict[str, object]:
        return {
            "position": position,
            "task_id": "51",
            "role": "auxiliary",
            "is_main": False,
            "window_index": position,
            "n_windows": 3,
            "n_tokens": 3,
            "n_loss_tokens": 1,
        }

    assert repo.record_windows(dataset.id, [window(0), window(1)]) == 2
    assert repo.record_windows(dataset.id, [window(1), window(2)]) == 3
    assert repo.record_windows(dataset.id, []) == 3
    assert [w.position for w in repo.windows(dataset.id, task_id=51)] == [0, 1, 2]


# -- training and lineage ----------------------------------------------------------------------------------------


def test_checkpoint_save_and_validation_merge_in_either_order(repo: MetadataRepository, cycle_id: int):
    run = repo.ensure_training_run(cycle_id, "sft", {"steps": 300})
    repo.record_checkpoint(run.id, 150, val_loss=0.8, val_tokens=100)  # validation first
    merged = repo.record_checkpoint(run.id, 150, uri="file:///t/step_00150")
    assert (merged.uri, merged.val_loss, merged.val_tokens) == ("file:///t/step_00150", 0.8, 100)
    repo.record_checkpoint(run.id, 300, uri="file:///t/step_00300")  # saved, not validated
    repo.record_checkpoint(run.id, 0, val_loss=0.1, val_tokens=100)  # step 0 never counts
    repo.record_checkpoint(run.id, 50, val_loss=0.5, val_tokens=100)  # validated, not saved
    assert repo.best_checkpoint(run.id).step == 150
    repo.record_checkpoint(run.id, 300, val_loss=0.8, val_tokens=100)  # tie: the earlier step wins
    assert repo.best_checkpoint(run.id).step == 150
    with pytest.raises(UnitConflictError, match="val_loss"):
        repo.record_checkpoint(run.id, 150, val_loss=0.7)
    assert repo.best_checkpoint(repo.ensure_training_run(cycle_id, "other", {}).id) is None


def test_lineage_walks_back_to_the_base_model(repo: MetadataRepository, cycle_id: int):
    assert repo.latest_generation() is None
    l0 = repo.register_generation("L0", 0, bf16_uri="s3://m/L0-bf16")
    l1 = repo.register_generation("L1", 1, bf16_uri="s3://m/L1-bf16", parent_id=l0.id, cycle_id=cycle_id)
    l2 = repo.register_generation("L2", 2, bf16_uri="s3://m/L2-bf16", parent_id=l1.id)
    repo.register_generation("L1-ablation", 1, bf16_uri="s3://m/L1b", parent_id=l0.id)
    assert [g.name for g in repo.lineage(l2.id)] == ["L2", "L1", "L0"]
    assert [g.name for g in repo.lineage(l0.id)] == ["L0"]
    assert repo.lineage(9999) == []
    assert repo.latest_generation().id == l2.id
    with pytest.raises(UnitConflictError, match="parent_id"):
        repo.register_generation("L2", 2, bf16_uri="s3://m/L2-bf16", parent_id=l0.id)


def test_usage_totals_per_purpose_and_kind(repo: MetadataRepository, cycle_id: int):
    for i in range(3):
        repo.record_llm_call(
            cycle_id, f"j{i}", purpose="self_judge", model="L0", prompt_tokens=100, completion_tokens=10
        )
    repo.record_llm_call(cycle_id, "x", purpose="external_judge", model="gpt", prompt_tokens=5, cost_usd=0.25)
    repo.record_llm_call(cycle_id, "y", purpose="external_judge", model="gpt", status="failed", error="timeout")
    usage = {u.group: u for u in repo.llm_usage(cycle_id)}
    assert (usage["self_judge"].count, usage["self_judge"].prompt_tokens, usage["self_judge"].cost_usd) == (
        3,
        300,
        None,
    )
    assert (usage["external_judge"].count, usage["external_judge"].completion_tokens) == (2, 0)
    assert usage["external_judge"].cost_usd == pytest.approx(0.25)
    assert [c.unit_key for c in repo.llm_calls(cycle_id, purpose="external_judge")] == ["x", "y"]
    _episode(repo, cycle_id, prompt_tokens=1000, completion_tokens=50)
    _episode(repo, cycle_id, seed=1, prompt_tokens=500)
    (search,) = repo.episode_usage(cycle_id)
    assert (search.group, search.count, search.prompt_tokens, search.completion_tokens) == ("search", 2, 1500, 50)


# -- artifact hashes -----------------------------------------------------------------------------------------------


def test_rows_that_point_at_artifacts_keep_their_sha256(repo: MetadataRepository, cycle_id: int):
    sha = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("p", "r", "why", "stream", "log", "ck", "m")}
    call = repo.record_llm_call(
        cycle_id,
        "judge-1",
        purpose="judge",
        model="m",
        prompt_uri="s3://b/p",
        result_uri="s3://b/r",
        prompt_sha256=sha["p"],
        result_sha256=sha["r"].upper(),  # stored normalised
    )
    assert (call.prompt_sha256, call.result_sha256) == (sha["p"], sha["r"])
    comparison = repo.record_comparison(
        cycle_id,
        51,
        "rhi",
        "k1",
        side_a="v0",
        side_b="v1",
        judge_model="m",
        verdict="A",
        rationale_uri="s3://b/why",
        rationale_sha256=sha["why"],
    )
    assert comparison.rationale_sha256 == sha["why"]
    episode = _episode(repo, cycle_id, artifacts={"stream": "s3://b/stream"}, artifact_sha256={"stream": sha["stream"]})
    assert episode.artifact_sha256 == {"stream": sha["stream"]}
    run = repo.ensure_training_run(cycle_id, "sft", {"steps": 2})
    run = repo.set_training_run_status(run.id, "failed", log_uri="s3://b/log", log_sha256=sha["log"])
    assert run.log_sha256 == sha["log"]
    checkpoint = repo.record_checkpoint(run.id, 2, uri="s3://b/ck", sha256=sha["ck"])
    assert repo.checkpoints(run.id)[0].sha256 == checkpoint.sha256 == sha["ck"]
    model = repo.register_generation("L0", 0, bf16_uri="s3://b/m", bf16_sha256=sha["m"])
    evaluation = repo.record_evaluation(
        "e1", "nightly", generation_id=model.id, results={}, results_uri="s3://b/r", results_sha256=sha["r"]
    )
    assert evaluation.results_sha256 == sha["r"]

    uris = repo.artifact_uris()
    assert uris["s3://b/p"] == sha["p"] and uris["s3://b/stream"] == sha["stream"] and uris["s3://b/m"] == sha["m"]
    assert uris["s3://b/ck"] == sha["ck"] and uris["s3://b/why"] == sha["why"] and uris["s3://b/log"] == sha["log"]


def test_malformed_artifact_hashes_are_refused(repo: MetadataRepository, cycle_id: int):
    with pytest.raises(InvalidRecordError, match="not a SHA-256"):
        repo.record_llm_call(cycle_id, "j", purpose="judge", model="m", prompt_uri="s3://b/p", prompt_sha256="abc")
    with pytest.raises(InvalidRecordError, match="artifacts the episode does not have: api_log"):
        _episode(repo, cycle_id, artifacts={"stream": "s3://b/s"}, artifact_sha256={"api_log": "0" * 64})
    assert _count(repo, Episode) == 0


def test_a_cycle_s_rows_are_read_per_aggregate_in_the_order_recorded(repo: MetadataRepository, cycle_id: int):
    """The reads `status` and the training stages use: every row of one cycle (another cycle's are left out), in the
    order recorded; reading a training run never creates it."""
    other = repo.ensure_cycle("paper-L1", CONFIG, HASH, generation=1, preset="paper", parent_model="L1").id
    for cycle in (other, cycle_id):
        repo.record_workflow_version(cycle, 202, 0, design="d")
        repo.record_workflow_version(cycle, 51, 0, design="d")
        for split in ("val", "train"):
            repo.record_dataset(cycle, split, f"s3://b/{cycle}/{split}", episodes=1, windows=1, loss_tokens=1,
                                total_tokens=2)  # fmt: skip
    pool = [_episode(repo, cycle_id, kind="collection", version=None, candidate=i, seed=715100 + i) for i in range(2)]
    repo.record_ranking(cycle_id, pool[1].id, score=1.0, rank=1)
    repo.record_ranking(cycle_id, pool[0].id, score=0.5, rank=2)
    repo.record_selection(cycle_id, pool[1].id, "val", rank=1)
    repo.record_selection(cycle_id, pool[0].id, "train", rank=2)
    assert repo.get_training_run(cycle_id, "sft") is None and repo.training_runs(cycle_id) == []
    second = repo.ensure_training_run(cycle_id, "sft-b", {"steps": 2})
    first = repo.ensure_training_run(cycle_id, "sft", {"steps": 1})
    base = repo.register_generation("L0", 0, bf16_uri="s3://m/L0")
    child = repo.register_generation("L1", 1, bf16_uri="s3://m/L1", parent_id=base.id, cycle_id=cycle_id)
    mine = repo.record_evaluation("e1", "pairwise", generation_id=child.id, cycle_id=cycle_id, results={})
    repo.record_evaluation("e2", "pairwise", generation_id=child.id, cycle_id=other, results={})

    assert [(v.task_id, v.cycle_id) for v in repo.cycle_workflow_versions(cycle_id)] == [
        ("202", cycle_id),
        ("51", cycle_id),
    ]
    assert [d.split for d in repo.datasets(cycle_id)] == ["val", "train"]
    assert [r.episode_id for r in repo.cycle_rankings(cycle_id)] == [pool[1].id, pool[0].id]
    assert [s.split for s in repo.cycle_selections(cycle_id)] == ["val", "train"]
    assert [r.key for r in repo.training_runs(cycle_id)] == ["sft-b", "sft"] and repo.training_runs(other) == []
    assert repo.get_training_run(cycle_id, "sft").id == first.id != second.id
    assert [g.name for g in repo.cycle_generations(cycle_id)] == ["L1"]
    assert [e.id for e in repo.evaluations(cycle_id=cycle_id)] == [mine.id]
    assert repo.get_cycle_by_id(cycle_id).name == "paper-L0" and repo.get_cycle_by_id(-1) is None
