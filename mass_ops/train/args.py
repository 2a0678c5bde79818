"""`TrainArgs`: one LoRA SFT job (MASS_SPEC §8), read from the JSON file the trainer is started with.

Every hyper-parameter, its default (the paper's constants), rule and help text comes from
`mass_ops.config.TrainerSettings`, the fields the config's `training:` section has too; this class adds only what
belongs to one job: its paths, its accelerator, the checkpoint it resumes from and an optional regex of LoRA targets.
The file is plain data, so the stage that launches training (locally, as a Kubernetes Job or a TrainJob) writes it
once and every rank of every node reads the same thing. Files written before the config and the trainer shared their
fields name two of them differently (`target_modules`, `attn_implementation`); they are read under the new names.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError, model_validator

from mass_ops.config import TrainerSettings, validation_problems
from mass_ops.errors import InputError
from mass_ops.train.lora_targets import REFERENCE_TARGET_PATTERN, LoraTargetError, lora_target_pattern

# Kept under its old name: the reference's regex, verbatim (multimodal Qwen3.5/3.6 checkpoints only).
PAPER_TARGET_MODULES = REFERENCE_TARGET_PATTERN
# Keys of args files written before the rename → the shared field names (see `TrainArgs._renamed_keys`).
_RENAMED = {"attn_implementation": "attention", "target_modules": "lora_target_modules"}
_REQUIRED = frozenset({"model_dir", "train_data", "out_dir"})


class TrainArgsError(InputError):
    """A training argument file that cannot be used; the message names the field and the rule."""


class TrainArgs(TrainerSettings):
    """One training job: the trainer settings plus the paths and machine it runs with. Paths are local to the machine
    that runs the ranks (the launching stage stages data in).

    Batch geometry: one window per rank per micro-step, so an optimizer step averages `world_size × grad_accum`
    per-window token-mean losses (the paper: 3 ranks × 1). Invalid values raise `TrainArgsError`.
    """

    model_dir: str = Field(min_length=1, description="BF16 parent (config, safetensors shards); frozen, never written.")
    train_data: str = Field(min_length=1, description="Window JSONL (MASS_SPEC §7), one window per line.")
    out_dir: str = Field(
        min_length=1,
        description="Receives args.json, train_log.jsonl, exposure_log.jsonl, resume_log.jsonl and step_NNNNN/ "
        "checkpoints.",
    )
    val_data: str | None = Field(
        default=None,
        description="Validation window JSONL (rank-16 trajectories); null disables validation and checkpoint "
        "selection.",
    )
    accelerator: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="DeepSpeed accelerator of this machine; cpu runs on gloo (tests, the laptop demo)."
    )
    resume_from: str | None = Field(
        default=None,
        description="A step_NNNNN directory of this run: restores adapters, optimizer, step and exposure counts "
        "exactly.",
    )
    lora_target_regex: str | None = Field(
        default=None,
        description="A regex PEFT fullmatches against module names, used as is instead of the pattern built from "
        "lora_target_modules (e.g. PAPER_TARGET_MODULES, the reference's own); null: built from the names. A cycle "
        "names projections, so the config has no such key.",
    )

    if not TYPE_CHECKING:  # type checkers keep the typed, keyword-per-field constructor

        def __init__(self, **data: Any) -> None:
            try:
                super().__init__(**data)
            except ValidationError as exc:
                raise TrainArgsError("; ".join(validation_problems(exc))) from None

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Read the old key names: a list of `target_modules` is `lora_target_modules`, a string `lora_target_regex`."""
        if not isinstance(data, dict) or not set(data) & set(_RENAMED):
            return data
        data = dict(data)
        for old, new in _RENAMED.items():
            if old in data and new not in data:
                value = data.pop(old)
                data["lora_target_regex" if isinstance(value, str) and old == "target_modules" else new] = value
        return data

    def _rule_problems(self) -> list[str]:
        problems = super()._rule_problems()
        if self.lora_target_regex is not None:
            try:
                re.compile(self.lora_target_regex)
            except re.error as exc:
                problems.append(f"lora_target_regex: not a valid regex ({exc})")
        return problems

    def target_pattern(self) -> str:
        """The regex PEFT fullmatches against module names to choose the adapted projections."""
        if self.lora_target_regex is not None:
            return self.lora_target_regex
        try:
            return lora_target_pattern(self.lora_target_modules)
        except LoraTargetError as exc:  # the settings' own rule refuses such a list first
            raise TrainArgsError(f"lora_target_modules: {exc}") from None

    # ------------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-ready."""
        return self.model_dump(mode="json")

    def write(self, path: str | Path) -> Path:
        """Write the args atomically (temp file, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "training args") -> TrainArgs:
        """Validate a mapping (an args file's content); `TrainArgsError` names `source` and every problem."""
        if not isinstance(data, dict):
            raise TrainArgsError(f"{source}: must be a JSON object")
        unknown = sorted(set(data) - set(cls.model_fields) - set(_RENAMED))
        if unknown:
            raise TrainArgsError(f"{source}: unknown keys {unknown}")
        missing = sorted(_REQUIRED - set(data))
        if missing:
            raise TrainArgsError(f"{source}: missing keys {missing}")
        try:
            return cls(**data)
        except TrainArgsError as exc:
            raise TrainArgsError(f"{source}: {exc}") from None

    @classmethod
    def read(cls, path: str | Path) -> TrainArgs:
        """The args file at `path`; `TrainArgsError` when it is missing, not JSON or not valid args."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise TrainArgsError(f"{path}: training args file not found") from None
        except json.JSONDecodeError as exc:
            raise TrainArgsError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))
