"""Repair a cycle: list exactly which units are missing or failed per stage, print the commands that redo them (the
Airflow clear, as a REST call and as the `airflow tasks clear` command, and the equivalent `mass-ops` stage
commands), and — unless it is a dry run — run the stage functions, which redo only what is missing.

What counts (from `ops.status`): a stage needs repair when it has started (any record) and has units that are not
done — failed on infrastructure, stopped by a budget, or not recorded. Stages that have not started are not a repair:
they are the rest of the run, listed as such. A budget-stopped unit is redone only after its budget is raised
(`budgets.*`: not part of the config hash, so the same cycle continues).

An episode an agent is at work on right now (a fresh lease: `ops.leases`) is not redone: it is listed as in
flight. Other partial units (a search step between its episodes and its proposal, a ranking with matches but no
ranks) cannot be told from interrupted ones: make sure the cycle is not running while repairing them.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.console import command_lines
from mass_ops.errors import InputError
from mass_ops.ops.api import STAGE_FUNCTIONS
from mass_ops.ops.status import (
    UnitState,
    _Records,
    cycle_row,
    cycle_units,
    open_repository,
    recorded_config,
)
from mass_ops.stages.registry import CYCLE_DAG, EXPORT, INNER_LOOP, REGISTER, SEARCH, SELECT_CHECKPOINT, TRACKED, Stage

DAG_ID = CYCLE_DAG
CLEAR_PATH = f"/api/v2/dags/{DAG_ID}/clearTaskInstances"
# The DAG tasks to clear per stage are the registry's `repair_tasks` (downstream tasks follow with
# include_downstream / --downstream); collection and ranking are one task instance per task (only the failed ones are
# cleared: only_failed / --only-failed). Search steps are one instance per version: see `_search_airflow_tasks`.
# A view for the DAG's tests, derived from the registry.
AIRFLOW_TASKS = {s.name: s.repair_tasks for s in TRACKED if s is not SEARCH}
NOT_DONE = ("failed", "budget_exhausted", "pending", "running")

StageRunner = Callable[[CycleConfig, list[int] | None], Any]


class RepairError(InputError):
    """A repair cannot run as asked (the config is not the cycle's); one line."""


@dataclass(frozen=True)
class StageRepair:
    """One stage's units to redo and how."""

    stage: str
    units: list[UnitState]
    tasks: list[int] | None  # the tasks to redo (per-task stages), None = the whole stage
    airflow_tasks: list[str]

    @property
    def budget_stopped(self) -> list[UnitState]:
        return [u for u in self.units if u.state == "budget_exhausted"]


@dataclass(frozen=True)
class RepairPlan:
    """What `mass-ops repair` redoes for one cycle."""

    cycle: str
    stages: list[StageRepair]
    not_started: list[str] = field(default_factory=list)
    in_flight: list[UnitState] = field(default_factory=list)  # leased episodes: at work now, not redone

    @property
    def nothing_to_repair(self) -> bool:
        return not self.stages

    @property
    def airflow_tasks(self) -> list[str]:
        return list(dict.fromkeys(t for s in self.stages for t in s.airflow_tasks))

    def airflow_rest(self, dag_run_id: str | None = None) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of the Airflow REST call that clears the failed instances and their downstream.
        `dry_run` is false explicitly: the endpoint defaults to a dry run that changes nothing."""
        body = {
            "dag_run_id": dag_run_id or "<dag_run_id>",
            "task_ids": self.airflow_tasks,
            "only_failed": True,
            "include_downstream": True,
            "dry_run": False,
        }
        return CLEAR_PATH, body

    def airflow_cli(self) -> str:
        """The same clear as an `airflow` command (add ``-s DATE -e DATE`` for a run with a logical date)."""
        pattern = "^(" + "|".join(t.replace(".", r"\.") for t in self.airflow_tasks) + ")$"
        return f"airflow tasks clear {DAG_ID} -t {shlex.quote(pattern)} --only-failed --downstream --yes"

    def stage_commands(self, config_args: Sequence[str]) -> list[str]:
        """The `mass-ops` commands that redo each stage, with the config arguments the cycle runs with."""
        lines = []
        base = " ".join(shlex.quote(a) for a in config_args)
        for repair in self.stages:
            tasks = "".join(f" --tasks {t}" for t in repair.tasks or [])
            stage = _tracked(repair.stage)
            if stage.command is None:
                # No `mass-ops` command runs the stage alone (the cycle's evaluation); repair calls its function.
                function = STAGE_FUNCTIONS[stage]
                where = f"{function.__module__}.{function.__name__}"
                lines.append(f"mass-ops repair {shlex.quote(self.cycle)} {base}  # runs {where}")
                continue
            lines.append(f"mass-ops {stage.command} {base}{tasks}")
        return list(dict.fromkeys(lines))

    def as_dict(self, config_args: Sequence[str] = (), dag_run_id: str | None = None) -> dict[str, Any]:
        path, body = self.airflow_rest(dag_run_id)
        return {
            "cycle": self.cycle,
            "nothing_to_repair": self.nothing_to_repair,
            "stages": [
                {
                    "stage": s.stage,
                    "tasks": s.tasks,
                    "units": [{"key": u.key, "state": u.state, "detail": u.detail} for u in s.units],
                    "airflow_tasks": s.airflow_tasks,
                }
                for s in self.stages
            ],
            "not_started": self.not_started,
            "in_flight": [{"stage": u.stage, "key": u.key, "detail": u.detail} for u in self.in_flight],
            "airflow_rest": {"method": "POST", "path": path, "body": body} if self.stages else None,
            "airflow_cli": self.airflow_cli() if self.stages else None,
            "commands": self.stage_commands(config_args) if self.stages else [],
        }

    def lines(self, config_args: Sequence[str], dag_run_id: str | None = None, width: int = 80) -> list[str]:
        """The plan as text (what `repair --dry-run` prints), `width` columns wide: prose wraps between words, the
        REST body is indented JSON and each command folds between its arguments (`mass_ops.console`), so every one
        still pastes whole."""
        flying = [f"in flight now, not redone: {u.stage} {u.key} ({u.detail})" for u in self.in_flight]
        if self.nothing_to_repair:
            rest = f" (not started yet: {', '.join(self.not_started)})" if self.not_started else ""
            return _wrapped([f"cycle {self.cycle}: nothing to repair{rest}", *flying], width)
        out = [f"cycle {self.cycle}: {sum(len(s.units) for s in self.stages)} unit(s) to redo", *flying]
        for repair in self.stages:
            out.append(f"{repair.stage}:")
            out += [f"  {u.key}  {u.state}" + (f" ({u.detail})" if u.detail else "") for u in repair.units]
            if repair.budget_stopped:
                out.append("  stopped by a budget: raise budgets.* (see `mass-ops status`) before redoing them")
        if self.not_started:
            out.append(f"not started yet (the rest of the run, not a repair): {', '.join(self.not_started)}")
        out = _wrapped(out, width)
        path, body = self.airflow_rest(dag_run_id)
        out.append("Airflow (REST):")
        out.append(f"  POST {path}")
        out += ["  " + line for line in json.dumps(body, indent=2).splitlines()]
        out.append("Airflow (CLI):")
        out += command_lines(self.airflow_cli(), width)
        out.append("mass-ops:")
        for line in self.stage_commands(config_args):
            command, _, comment = line.partition("  # ")
            out += command_lines(command, width)
            if comment:
                out.append(f"  # {comment}")
        return out


def _wrapped(lines: Sequence[str], width: int) -> list[str]:
    """Prose lines wrapped between words (indentation kept; a word longer than a line stays whole)."""
    out = []
    for line in lines:
        indent = line[: len(line) - len(line.lstrip())]
        out += textwrap.wrap(
            line, width, subsequent_indent=indent + "  ", break_long_words=False, break_on_hyphens=False
        ) or [line]
    return out


def _search_airflow_tasks(units: Sequence[UnitState]) -> list[str]:
    """The inner-loop group's instances of the broken search steps (v0 also has its two episode pods)."""
    tasks = []
    for unit in units:
        version = int(unit.key.rsplit("-v", 1)[1])
        if version == 0:
            tasks += [f"{INNER_LOOP}.reference_episode", f"{INNER_LOOP}.episode_v0"]
        tasks.append(f"{INNER_LOOP}.step_v{version}")
    return list(dict.fromkeys(tasks))


def plan_repair(config: CycleConfig, cycle: str) -> RepairPlan:
    """The repair plan of `cycle` in `config`'s metadata store (read only)."""
    repo = open_repository(config)
    row = cycle_row(repo, cycle)
    own, _ = recorded_config(config, row)
    records = _Records.read(repo, row.id)
    units = cycle_units(own, records)
    started = _started_stages(records, units)
    repairs: list[StageRepair] = []
    not_started = []
    in_flight = [u for u in units if u.leased]
    for stage in TRACKED:
        todo = [u for u in units if u.stage == stage.name and u.state in NOT_DONE and not u.leased]
        if stage.name not in started:
            if any(u.stage == stage.name for u in units):
                not_started.append(stage.name)
            continue
        if not todo:
            continue
        tasks = sorted({u.task_id for u in todo if u.task_id is not None}) if stage.per_task else None
        airflow = _search_airflow_tasks(todo) if stage is SEARCH else list(stage.repair_tasks)
        repairs.append(StageRepair(stage.name, todo, tasks, airflow))
    return RepairPlan(row.name, repairs, not_started, in_flight)


def _started_stages(records: _Records, units: Sequence[UnitState]) -> set[str]:
    """Stages with any record: a unit that is not pending, or an episode / call row of the stage."""
    from mass_ops.ops.status import call_stage, episode_stage

    started = {u.stage for u in units if u.state != "pending"}
    started |= {stage for e in records.episodes if (stage := episode_stage(e.kind)) is not None}
    started |= {call_stage(c) for c in records.calls}
    return started


# -- running it -------------------------------------------------------------------------------------------------------


def _tracked(name: str) -> Stage:
    return next(s for s in TRACKED if s.name == name)


def _runner(stage: Stage) -> StageRunner:
    """How a repair redoes `stage`: its function (`api.STAGE_FUNCTIONS`), with the tasks when it takes them."""
    function = STAGE_FUNCTIONS[stage]
    if stage is EXPORT:  # `mass-ops export`: checkpoint selection, export and registration, in that order

        def export(config: CycleConfig, _tasks: list[int] | None) -> Any:
            return [STAGE_FUNCTIONS[s](config) for s in (SELECT_CHECKPOINT, EXPORT, REGISTER)]

        return export
    if stage.per_task:
        return function

    def whole(config: CycleConfig, _tasks: list[int] | None) -> Any:
        return function(config)

    return whole


def default_runners() -> dict[str, StageRunner]:
    """The stage functions a repair runs (`mass_ops.stages.api`), by stage name. Stages with one function share one
    runner, which a repair runs once: rollouts and evaluation (it runs the missing rollouts, then judges)."""
    made: dict[Callable[..., Any], StageRunner] = {}
    return {stage.name: made.setdefault(STAGE_FUNCTIONS[stage], _runner(stage)) for stage in TRACKED}


def repair_cycle(config: CycleConfig, cycle: str | None = None, *, dry_run: bool = True) -> dict[str, Any]:
    """The missing or failed units of `cycle` (default: the config's) per stage and the commands that redo them, as
    JSON data; without `dry_run`, run the stage functions too (under ``ran``)."""
    from mass_ops.stages.common import jsonable

    plan = plan_repair(config, cycle or config.cycle_name)
    result = plan.as_dict()
    if not dry_run and not plan.nothing_to_repair:
        result["ran"] = [jsonable(row) for row in run_repair(config, plan)]
    return result


def run_repair(
    config: CycleConfig, plan: RepairPlan, *, runners: Mapping[str, StageRunner] | None = None
) -> list[dict[str, Any]]:
    """Run the stage function of every stage in `plan`, in cycle order (each redoes only its missing units); one row
    per stage run. `config` must be the cycle's own (its name and hash), as for any stage command."""
    if config.cycle_name != plan.cycle:
        raise RepairError(
            f"repair {plan.cycle}: the config names cycle {config.cycle_name!r}; pass the config the cycle runs "
            "with (the same --config and --set as its stages)"
        )
    chosen = {**default_runners(), **(runners or {})}
    rows = []
    done: set[int] = set()
    for repair in plan.stages:
        runner = chosen[repair.stage]
        if id(runner) in done:  # rollout and evaluate share one stage function
            continue
        done.add(id(runner))
        result = runner(config, repair.tasks)
        rows.append({"stage": repair.stage, "units": len(repair.units), "result": result})
    return rows
