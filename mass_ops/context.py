"""The handles every stage works with: config, catalogue, metadata repository, artifact store, cycle row.

`open_cycle` is the `validate_config` stage: it checks the config against the task catalogue, upgrades the metadata
schema, and freezes the config into the cycle row by hash (a different config for the same cycle name is refused).
`attach_cycle` is what every later stage calls: it refuses a cycle that was never opened or whose frozen hash differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from mass_ops.config import ConfigError, CycleConfig
from mass_ops.errors import InputError
from mass_ops.prompts import PromptSet, check_recorded, check_templates, shipped_prompts
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import ArtifactStore
from mass_ops.store.repository import MetadataRepository
from mass_ops.tasks.catalogue import TaskCatalogue
from mass_ops.tasks.importer import load_catalogue


class CycleNotOpenError(InputError):
    """A stage ran before `validate_config` opened its cycle."""


@dataclass
class CycleContext:
    """Everything a stage needs, built from the config alone (so any process or pod can rebuild it)."""

    config: CycleConfig
    catalogue: TaskCatalogue
    repo: MetadataRepository
    artifacts: ArtifactStore
    cycle_id: int
    # The prompt templates the cycle recorded (shipped, or overridden by `prompts.dir`); every builder gets them.
    prompts: PromptSet = field(default_factory=shipped_prompts)

    @property
    def cycle_name(self) -> str:
        """The cycle's name in the metadata store."""
        return self.config.cycle_name


def load_task_catalogue(config: CycleConfig) -> TaskCatalogue:
    """The catalogue named by `tasks.catalogue`, checked to hold every task the config uses (MASS_SPEC §1)."""
    source = config.require_catalogue()  # the paper presets make the user choose: their tasks or ours
    try:
        catalogue = load_catalogue(None if source == "builtin" else source)
    except ValueError as exc:
        raise ConfigError([f"config: tasks.catalogue: {exc}"]) from None
    problems = []
    used = set(config.tasks.train_candidates) | set(config.tasks.test) | set(config.rollout_tasks())
    missing = sorted(used - set(catalogue.ids))
    if missing:
        problems.append(f"config: tasks: {missing} have no bare and initial prompt in catalogue {catalogue.source}")
    if problems:
        raise ConfigError(problems)
    return catalogue


def catalogue_provenance(catalogue: TaskCatalogue) -> dict[str, Any]:
    """What a cycle row records of its task catalogue: its identity (``builtin``, ``imported:<folder>@<digest>``…)
    and, for an imported one, its import record (source folder name, SHA-256 of every file, import time)."""
    record = catalogue.provenance
    return {"identity": catalogue.identity(), "provenance": record.as_dict() if record is not None else None}


def _stores(config: CycleConfig) -> tuple[MetadataRepository, ArtifactStore]:
    return MetadataRepository.from_url(config.storage.metadata_url), open_artifact_store(config.storage.artifact_url)


def open_cycle(config: CycleConfig, *, upgrade_schema: bool = True) -> CycleContext:
    """Validate against the catalogue and the prompt templates, create/upgrade the schema, and freeze the config
    into its cycle row (with the SHA-256 of every prompt template)."""
    catalogue = load_task_catalogue(config)
    prompts = check_templates(config)  # a template that does not render is a config error before anything is written
    if upgrade_schema:
        from mass_ops.store.migrations import upgrade

        upgrade(config.storage.metadata_url)
    repo, artifacts = _stores(config)
    cycle = repo.ensure_cycle(
        config.cycle_name,
        config.model_dump(mode="json", exclude={"storage"}),
        config.config_hash(),
        generation=config.generation,
        preset=config.preset,
        parent_model=config.models.served_name,
    )
    check_recorded(prompts, (cycle.provenance or {}).get("prompts"), config.cycle_name)
    repo.set_cycle_provenance(cycle.id, "prompts", prompts.digests())
    # Which tasks the cycle runs on (ours, or the reference's imported from the user's copy), for the report.
    repo.set_cycle_provenance(cycle.id, "catalogue", catalogue_provenance(catalogue))
    for task_id in sorted(set(config.tasks.train_candidates) | set(config.tasks.test)):
        task = catalogue.task(task_id)
        split = "test" if task_id in config.tasks.test else "train"
        # Prompt hashes freeze the catalogue too: an edited task file under the same cycle is refused.
        repo.record_cycle_task(
            cycle.id,
            task_id,
            split=split,
            excluded=task_id in config.tasks.excluded,
            exclusion_reason=task.exclusion_reason,
            bare_prompt_sha256=hashlib.sha256(task.bare_prompt.encode()).hexdigest(),
            initial_prompt_sha256=hashlib.sha256(task.initial_prompt.encode()).hexdigest(),
        )
    return CycleContext(config, catalogue, repo, artifacts, cycle.id, prompts)


def attach_cycle(config: CycleConfig) -> CycleContext:
    """The context of a cycle that `open_cycle` already froze; refuses a changed config or changed prompts."""
    catalogue = load_task_catalogue(config)
    prompts = check_templates(config)
    repo, artifacts = _stores(config)
    cycle = repo.get_cycle(config.cycle_name)
    if cycle is None:
        raise CycleNotOpenError(f"cycle {config.cycle_name!r} is not open: run the validate_config stage first")
    if cycle.config_hash != config.config_hash():
        # ensure_cycle raises the same ConfigChangedError message for a changed config.
        repo.ensure_cycle(config.cycle_name, {}, config.config_hash())
    check_recorded(prompts, (cycle.provenance or {}).get("prompts"), config.cycle_name)
    return CycleContext(config, catalogue, repo, artifacts, cycle.id, prompts)
