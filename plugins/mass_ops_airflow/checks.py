"""Post-checks: after a pod or Job ends, ask the stores whether the stage's outputs exist.

A zero exit code says the process ended cleanly, not that its unit of work is durable. A unit is done only when
its artifacts are published and its row is committed (ARCHITECTURE: units of work), so every Kubernetes operator
runs one of these after success and fails the task when the outputs are missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mass_ops_airflow.hooks import MassArtifactHook, MassMetadataHook

if TYPE_CHECKING:
    from mass_ops.compute.kubernetes import EpisodeSpec
    from mass_ops.config import CycleConfig

TERMINAL_EPISODE_STATUSES = ("succeeded", "model_failure")


class StageOutputMissing(RuntimeError):
    """The workload exited 0 but its outputs are not in the stores."""


class EpisodeBudgetStopped(StageOutputMissing):
    """The episode's last attempt was stopped by a budget (`budget_exhausted`): not a fault to retry; the message is
    one line naming the budget to raise before rerunning."""


def _cycle_id(config: CycleConfig) -> tuple[Any, int]:
    repo = MassMetadataHook().get_repository(config.storage.metadata_url)
    cycle = repo.get_cycle(config.cycle_name)
    if cycle is None:
        raise StageOutputMissing(f"cycle {config.cycle_name!r} is not in the metadata store")
    return repo, cycle.id


def episode_recorded(config: CycleConfig, episode: EpisodeSpec) -> dict[str, Any]:
    """The episode's final recorded attempt; raise when there is none or only infrastructure failures.

    Rollout replicates are stored in the episode's `candidate` column (the unit identity has no other slot).
    """
    repo, cycle_id = _cycle_id(config)
    rows = repo.episodes(cycle_id, task_id=episode.task_id, kind=episode.kind, generation=episode.generation)
    candidate = episode.candidate if episode.candidate is not None else episode.replicate
    rows = [r for r in rows if r.version == episode.version and r.candidate == candidate]
    if not rows:
        raise StageOutputMissing(f"episode {episode.slug}: the pod exited 0 but the metadata store has no row for it")
    final = max(rows, key=lambda r: (r.attempt, r.id))
    if final.status == "budget_exhausted":
        message = (final.failure or {}).get("message") or "a budget refused its next request"
        raise EpisodeBudgetStopped(f"episode {episode.slug}: attempt {final.attempt} is budget_exhausted: {message}")
    if final.status not in TERMINAL_EPISODE_STATUSES:
        raise StageOutputMissing(
            f"episode {episode.slug}: last attempt {final.attempt} is recorded as {final.status}, not finished"
        )
    return {"episode_id": final.id, "status": final.status, "attempt": final.attempt}


def training_recorded(config: CycleConfig) -> dict[str, Any]:
    """The cycle's succeeded training run and its checkpoints with a validation loss (step 0 excluded)."""
    repo, cycle_id = _cycle_id(config)
    succeeded = [run for run in repo.training_runs(cycle_id) if run.status == "succeeded"]
    if not succeeded:
        raise StageOutputMissing(f"training: the Job succeeded but cycle {config.cycle_name} has no succeeded run")
    run = succeeded[-1]
    best = repo.best_checkpoint(run.id)
    if best is None:
        raise StageOutputMissing(f"training run {run.key}: no saved checkpoint with a validation loss after step 0")
    return {"training_run_id": run.id, "best_step": best.step}


def export_published(config: CycleConfig) -> dict[str, Any]:
    """Every exported format of the next generation has safetensors shards in the artifact store."""
    hook = MassArtifactHook()
    found: dict[str, int] = {}
    with hook.credentials_env():
        store = hook.get_store(config.storage.artifact_url)
        for fmt in config.export.formats:
            prefix = config.models.next_bf16 if fmt == "bf16" else config.models.next_fp8
            shards = [key for key in store.list(prefix) if key.endswith(".safetensors")]
            if not shards:
                raise StageOutputMissing(f"export: no {fmt} safetensors under {prefix!r} in the artifact store")
            found[fmt] = len(shards)
    return {"shards": found}
