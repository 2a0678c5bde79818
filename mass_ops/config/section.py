"""The floor of every config section: documented maxima, value types, name patterns, `Section` and `ConfigError`.

A section forbids unknown keys, never coerces across types (YAML 'yes' is not 1.0) and is frozen once validated;
`validation_problems` turns a failed validation into one `field: rule` line per problem.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, ValidationError

from mass_ops.errors import InputError

# Documented maxima. A config is read by `plan` and by every task of a DAG run, so no value may make either allocate
# or compute more than a summary; each limit is far above what a real cycle uses (the reference value in brackets).
MAX_INT = 2**31 - 1  # any integer knob: fits a signed 32-bit column and every seed generator
MAX_CONFIG_BYTES = 256 * 1024  # a config file (the presets are ~3 KB)
MAX_CONFIG_DEPTH = 16  # nesting of mappings/lists in a config file or a --set value (the presets use 4)
MAX_TASK_ID = 999_999  # [324]
MAX_TASKS = 200  # ids in one task list [12]
MAX_SEARCH_ITERATIONS = 100  # [11]
MAX_CANDIDATES = 256  # teacher candidates per task [18]
MAX_OPPONENTS = 32  # tournament opponents per episode [6]
MAX_BOOTSTRAP_SAMPLES = 100_000  # [1000]
MAX_ROLLOUTS = 1000  # rollouts per task and generation [10]
MAX_JUDGE_SEEDS = 16  # [3]
MAX_JUDGES = 16  # external judges [2]
MAX_JUDGE_INVALID_RETRIES = 16  # extra judge calls per unusable verdict, per run [2]
MAX_TRAINING_STEPS = 100_000  # optimizer steps [1624]
MAX_MAP_ENTRIES = 64  # node selectors, tolerations


def _number(value: Any) -> Any:
    """Accept ints and floats for float knobs, but never bools or strings (YAML 'yes' is not 1.0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number (got {value!r})")
    return float(value)


StrictFloat = Annotated[float, BeforeValidator(_number)]
PositiveInt = Annotated[StrictInt, Field(gt=0, le=MAX_INT)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0, le=MAX_INT)]
Probability = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]
TaskId = Annotated[StrictInt, Field(gt=0, le=MAX_TASK_ID)]
TaskList = Annotated[list[TaskId], Field(max_length=MAX_TASKS)]
UsdAmount = Annotated[StrictFloat, Field(gt=0.0, le=1e9)]
# `\Z`, not `$`: `$` also matches before a final newline, and these names end up in URLs, paths and env lookups.
# Use them with `fullmatch`.
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
# A cycle name is one path segment of artifact keys and of report URLs (the Airflow plugin checks it with this).
CYCLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


class ConfigError(InputError):
    """A config that breaks one or more rules; `problems` holds one line per problem (exit status 2)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def validation_problems(exc: ValidationError) -> list[str]:
    """One `<dotted field>: <rule>` line per problem of a section, the offending value named where it is short."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and "(got " not in msg and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {err['input']!r})"
        for part in msg.split("; "):
            # Model-level rules name their field as "field: rule"; fold it into the location.
            field, sep, rule = part.partition(": ")
            if sep and re.fullmatch(r"[a-z_][a-z0-9_.]*", field):
                where = field if loc == "(top level)" else f"{loc}.{field}"
                lines.append(f"{where}: {rule}")
            else:
                lines.append(f"{loc}: {part}")
    return lines
