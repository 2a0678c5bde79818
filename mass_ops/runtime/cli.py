"""`mass-ops episode run`: run one episode unit (one or more seeds) of an open cycle — what an episode pod runs.

Inputs are the config (preset or file, `--set` overrides), the unit (`--task --kind --seed [--version]
[--candidate] [--generation] [--condition]`) and the prompt, as a local file or as an artifact URI of the configured
store; outputs are records and artifact URIs, printed as one JSON line per unit on stdout:
`{"episode_id", "status", "attempt", "artifacts", "unit", "reused"}`. Progress goes to stderr (Rich), logs too.

Exit status: 0 when every unit ended as `succeeded` or `model_failure` (a model failure is data, not an error);
3 when any ended as `infra_failure` after all its attempts; 2 for bad input (config, unit, prompt, a changed prompt
for a recorded unit, an endpoint that does not serve the model); 130 on Ctrl-C, 143 on SIGTERM — in both cases the
agents and proxies are stopped and nothing is recorded for the interrupted attempts.

`--handoff DIR` (a Kubernetes episode pod's sandbox container) reaches no store: every attempt goes to `mass-ops
episode publish --handoff DIR` beside it, which holds the credentials (docs/runtime.md, "The episode command").
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from mass_ops.config import ConfigError, CycleConfig, load_config
from mass_ops.errors import InputError
from mass_ops.layout import EpisodeKind, EpisodeUnit, bare_condition, teacher_condition, version_condition
from mass_ops.runtime.episode import EpisodeOutcome, EpisodeRequest, WorkspaceSeed

if TYPE_CHECKING:
    from mass_ops.context import CycleContext
    from mass_ops.runtime.handoff import SandboxHandoff
    from mass_ops.store.artifacts import ArtifactStore

episode_app = typer.Typer(no_args_is_help=True, help="Agent episodes: run one episode unit against the endpoint.")

EXIT_BAD_INPUT = 2
EXIT_INFRA_FAILURE = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
KINDS = ("reference", "search", "collection", "rollout", "benchmark")

_err = Console(stderr=True)
_STOPPED = "the interrupted attempts were stopped and nothing was recorded for them"


class EpisodeInputError(InputError):
    """A bad command-line input: its message is one line naming what is wrong."""


class Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler so that the pool cancels its episodes and cleans up."""


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    for line in message.splitlines() or [message]:
        _err.print(line, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


# A benchmark task's starting files (`runtime.episode.WorkspaceSeed`), given to both containers of its pod.
SeedUriOption = Annotated[
    str | None,
    typer.Option("--workspace-seed-uri", help="Benchmark episodes: the task's starting files (a tar.gz artifact)."),
]
SeedSha256Option = Annotated[
    str | None, typer.Option("--workspace-seed-sha256", help="SHA-256 the workspace seed must have (with its URI).")
]


@episode_app.command("run")
def run_command(
    task: Annotated[str, typer.Option("--task", help="Task id (a benchmark episode: the benchmark task's name).")],
    kind: Annotated[str, typer.Option("--kind", help="reference, search, collection, rollout or benchmark.")],
    seed: Annotated[list[int], typer.Option("--seed", help="Episode seed (repeatable: one unit per seed).")],
    config: Annotated[str, typer.Option("--config", "-c", help="Preset (paper, cycle2, demo) or YAML/JSON file.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a key: a.b=c (repeatable).")] = None,
    version: Annotated[int | None, typer.Option("--version", help="Workflow version (search episodes).")] = None,
    candidate: Annotated[int | None, typer.Option("--candidate", help="Candidate / replicate index.")] = None,
    generation: Annotated[
        str | None, typer.Option("--generation", help="Executing generation, when part of the identity (rollouts).")
    ] = None,
    condition: Annotated[str | None, typer.Option("--condition", help="Condition name; default from the kind.")] = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file", help="Prompt as a local UTF-8 file.")] = None,
    prompt_uri: Annotated[
        str | None, typer.Option("--prompt-uri", help="Prompt as an artifact URI of the configured store.")
    ] = None,
    scratch_dir: Annotated[
        Path | None, typer.Option("--scratch-dir", help="Where attempt folders are created (default: temp dir).")
    ] = None,
    keep_scratch: Annotated[bool, typer.Option("--keep-scratch", help="Keep attempt folders (debugging).")] = False,
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="Progress display (default: on a terminal).")
    ] = None,
    log_format: Annotated[str, typer.Option("--log-format", help="Logs on stderr: text or json.")] = "text",
    handoff: Annotated[
        Path | None,
        typer.Option("--handoff", help="Hand attempts to `episode publish --handoff DIR` instead of publishing."),
    ] = None,
    wall_clock_s: Annotated[
        int | None,
        typer.Option("--wall-clock-s", help="Benchmark episodes: the task's time limit (instead of the config's)."),
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option("--endpoint", help="Benchmark episodes: the evaluated generation's server."),
    ] = None,
    served_name: Annotated[
        str | None, typer.Option("--served-name", help="Benchmark episodes: the model name that server serves.")
    ] = None,
    workspace_seed_uri: SeedUriOption = None,
    workspace_seed_sha256: SeedSha256Option = None,
) -> None:
    """Run the episode unit(s) and print one JSON outcome line per seed."""
    with _episode_logging(log_format), _handoff_session(handoff) as session:
        _run(
            handoff=session,
            task=task,
            kind=kind,
            seed=seed,
            config=config,
            set_=set_,
            version=version,
            candidate=candidate,
            generation=generation,
            condition=condition,
            prompt_file=prompt_file,
            prompt_uri=prompt_uri,
            scratch_dir=scratch_dir,
            keep_scratch=keep_scratch,
            progress=progress,
            options=RunOptions(wall_clock_s, endpoint, served_name, workspace_seed_uri, workspace_seed_sha256),
        )


@contextlib.contextmanager
def _handoff_session(root: Path | None) -> Iterator[SandboxHandoff | None]:
    """The hand-off of a `--handoff` run (None without): it marks the end with the exit status the run ends with."""
    if root is None:
        yield None
        return
    from mass_ops.runtime.handoff import HandoffError, SandboxHandoff

    session = SandboxHandoff(root)
    try:
        session.__enter__()
    except HandoffError as exc:
        raise _fail(str(exc)) from None
    try:
        yield session
    except BaseException as exc:
        session.__exit__(type(exc), exc, exc.__traceback__)
        raise
    session.__exit__(None, None, None)


@dataclass(frozen=True)
class RunOptions:
    """What a benchmark episode's stage decides for its run and the config does not say: the task's time limit (the
    stricter of the benchmark's official limit and the config's) and the server of the generation it evaluates.
    The config stays the cycle's (its hash is the cycle's identity, which the hand-off's publisher checks); these
    apply to the context the pool runs in, as `stages.benchmarks` applies them in-process."""

    wall_clock_s: int | None = None
    endpoint: str | None = None
    served_name: str | None = None
    workspace_seed_uri: str | None = None  # the task's starting files (`runtime.episode.WorkspaceSeed`)
    workspace_seed_sha256: str | None = None

    def check(self, kind: str) -> None:
        given = [flag for flag, value in self._flags() if value is not None]
        if given and kind != "benchmark":
            raise EpisodeInputError(f"{given[0]}: only benchmark episodes take it (kind is {kind})")
        if (self.endpoint is None) != (self.served_name is None):
            raise EpisodeInputError("--endpoint: give --endpoint and --served-name together")
        if self.wall_clock_s is not None and self.wall_clock_s < 1:
            raise EpisodeInputError(f"--wall-clock-s: {self.wall_clock_s} is not a number of seconds ≥ 1")
        if (self.workspace_seed_uri is None) != (self.workspace_seed_sha256 is None):
            raise EpisodeInputError(
                "--workspace-seed-uri: give --workspace-seed-uri and --workspace-seed-sha256 together"
            )
        self.workspace_seed()  # a malformed hash is one line here, before anything runs

    def workspace_seed(self) -> WorkspaceSeed | None:
        """The episode's workspace seed, when one was given."""
        return _workspace_seed(self.workspace_seed_uri, self.workspace_seed_sha256, "--workspace-seed-sha256")

    def _flags(self) -> list[tuple[str, Any]]:
        return [
            ("--wall-clock-s", self.wall_clock_s),
            ("--endpoint", self.endpoint),
            ("--served-name", self.served_name),
            ("--workspace-seed-uri", self.workspace_seed_uri),
            ("--workspace-seed-sha256", self.workspace_seed_sha256),
        ]

    def applied(self, ctx: CycleContext, generation: str | None) -> CycleContext:
        """`ctx` on the given server, its episodes stopped at the given time limit."""
        import dataclasses

        config = ctx.config
        if self.endpoint is not None and self.served_name is not None:
            from mass_ops.serving import GenerationServer, serving_config

            config = serving_config(config, GenerationServer(str(generation), self.endpoint, self.served_name))
        if self.wall_clock_s is not None:
            runtime = config.runtime.model_copy(update={"episode_wall_clock_s": self.wall_clock_s})
            config = config.model_copy(update={"runtime": runtime})
        return ctx if config is ctx.config else dataclasses.replace(ctx, config=config)


def _run(
    *,
    handoff: SandboxHandoff | None = None,
    task: str,
    kind: str,
    seed: list[int],
    config: str,
    set_: list[str] | None,
    version: int | None,
    candidate: int | None,
    generation: str | None,
    condition: str | None,
    prompt_file: Path | None,
    prompt_uri: str | None,
    scratch_dir: Path | None,
    keep_scratch: bool,
    progress: bool | None,
    options: RunOptions | None = None,
) -> None:
    """`episode run`: check the unit, read its prompt, run one attempt per seed, print one line per outcome."""
    options = options or RunOptions()
    cfg = _load_config(config, set_)
    try:
        task_id = _check_unit(cfg, task, kind, version, seed, candidate=candidate, generation=generation)
        options.check(kind)
        if kind == "benchmark" and condition is None:
            raise EpisodeInputError("--condition: a benchmark episode needs its trial's condition")
    except EpisodeInputError as exc:
        raise _fail(str(exc)) from None

    from mass_ops.runtime.handoff import HandoffError

    ctx, prompt = _context_and_prompt(cfg, handoff, kind, generation, prompt_file, prompt_uri)
    chosen_condition = condition or default_condition(cfg, kind, cast(int, task_id), version)
    unit_kind = cast(EpisodeKind, kind)  # checked by _check_unit
    requests = [
        EpisodeRequest(
            unit=EpisodeUnit(
                cfg.cycle_name,
                task_id,  # type: ignore[arg-type]  # a benchmark task is named; the store keeps ids as text
                unit_kind,
                s,
                version=version,
                candidate=candidate,
                generation=generation,
            ),
            condition=chosen_condition,
            prompt=prompt,
            workspace_seed=options.workspace_seed(),
        )
        for s in seed
    ]
    pool_options: dict[str, Any] = {"scratch_dir": scratch_dir, "keep_scratch": keep_scratch}
    if handoff is not None:
        try:
            ctx = handoff.open(cfg, requests)
        except HandoffError as exc:
            raise _fail(str(exc), 1) from None
        pool_options["sink"] = handoff.sink
        pool_options["proxy_sessions"] = handoff.proxy_sessions  # None unless the publisher opens them
    assert ctx is not None  # attached, or opened by the hand-off
    outcomes = _run_pool(options.applied(ctx, generation), requests, pool_options, progress)
    for outcome in outcomes:
        print(json.dumps(outcome_line(outcome)), flush=True)
    if any(outcome.status == "infra_failure" for outcome in outcomes):
        raise typer.Exit(EXIT_INFRA_FAILURE)


def _load_config(config: str, set_: list[str] | None) -> CycleConfig:
    """The cycle config, or exit 2 with every problem it has."""
    try:
        return load_config(config, set_ or ())
    except ConfigError as exc:
        raise _fail("\n".join(exc.problems)) from None


def _context_and_prompt(
    cfg: CycleConfig,
    handoff: SandboxHandoff | None,
    kind: str,
    generation: str | None,
    prompt_file: Path | None,
    prompt_uri: str | None,
) -> tuple[CycleContext | None, str]:
    """The attached cycle (None in a hand-off, whose publisher opens it later) and the episode's prompt."""
    from mass_ops.context import attach_cycle
    from mass_ops.runtime.handoff import HandoffError

    try:
        if handoff is not None:
            # The stores are the publisher's: the cycle, recorded attempts and a rollout's server come in its ledger.
            if prompt_uri is not None:
                raise EpisodeInputError("--prompt-uri: a --handoff run reads no artifact store; use --prompt-file")
            if prompt_file is not None:
                handoff.await_prompt(prompt_file)  # the publisher's to write when it lies in the hand-off folder
            return None, _read_prompt(None, prompt_file, None)
        ctx = attach_cycle(cfg)
        if kind == "rollout" and generation:
            # A rollout runs on the server of the generation it evaluates (the cycle's evaluation servers).
            from mass_ops.serving import evaluation_scope, generation_server, serving_context

            ctx = serving_context(ctx, generation_server(ctx, generation, evaluation_scope(cfg)))
        return ctx, _read_prompt(ctx.artifacts, prompt_file, prompt_uri)
    except (EpisodeInputError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except HandoffError as exc:
        raise _fail(str(exc), 1) from None


def _run_pool(
    ctx: CycleContext, requests: list[EpisodeRequest], pool_options: dict[str, Any], progress: bool | None
) -> list[EpisodeOutcome]:
    """Run the requests through an `EpisodePool`; every failure of the run becomes its one-line exit."""
    from mass_ops.runtime.handoff import HandoffError
    from mass_ops.runtime.pool import EpisodeBatchError, EpisodePool, EpisodePromptConflictError
    from mass_ops.runtime.preflight import EpisodePreflightError

    display = _Display(len(requests), enabled=progress if progress is not None else _err.is_terminal)
    previous_handler = _install_sigterm()
    try:
        with display, EpisodePool(ctx, on_event=display.on_event, **pool_options) as pool:
            return pool.run(requests)
    except Terminated:
        raise _fail(f"episode run: terminated (SIGTERM); {_STOPPED}", EXIT_TERMINATED) from None
    except KeyboardInterrupt:
        raise _fail(f"episode run: interrupted; {_STOPPED}", EXIT_INTERRUPTED) from None
    except (EpisodePreflightError, EpisodePromptConflictError) as exc:
        raise _fail(str(exc)) from None
    except HandoffError as exc:
        raise _fail(str(exc), 1) from None
    except EpisodeBatchError as exc:
        for outcome in exc.outcomes:
            if outcome is not None:
                print(json.dumps(outcome_line(outcome)), flush=True)
        raise _fail(str(exc), 1) from None
    finally:
        _restore_sigterm(previous_handler)


@episode_app.command("publish")
def publish_command(
    handoff: Annotated[Path, typer.Option("--handoff", help="The folder `episode run --handoff` writes.")],
    config: Annotated[str, typer.Option("--config", "-c", help="Preset (paper, cycle2, demo) or YAML/JSON file.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a key: a.b=c (repeatable).")] = None,
    stale_after_s: Annotated[
        float, typer.Option("--stale-after-s", help="Give up when the episode container's heartbeat is this old.")
    ] = 60.0,
    start_timeout_s: Annotated[
        float, typer.Option("--start-timeout-s", help="How long to wait for the episode container's request.")
    ] = 600.0,
    log_format: Annotated[str, typer.Option("--log-format", help="Logs on stderr: text or json.")] = "text",
    prompt_uri: Annotated[
        str | None,
        typer.Option("--prompt-uri", help="Prompt artifact to write into the hand-off folder for the episode."),
    ] = None,
    prompt_sha256: Annotated[
        str | None, typer.Option("--prompt-sha256", help="SHA-256 the prompt artifact must have (with --prompt-uri).")
    ] = None,
    workspace_seed_uri: SeedUriOption = None,
    workspace_seed_sha256: SeedSha256Option = None,
    proxy_control: Annotated[
        Path | None,
        typer.Option("--proxy-control", help="The pod proxy's control socket: open each attempt's proxy session."),
    ] = None,
    proxy_sessions: Annotated[
        Path | None,
        typer.Option("--proxy-sessions", help="The pod proxy's session-log folder (with --proxy-control)."),
    ] = None,
    endpoint: Annotated[
        str | None, typer.Option("--endpoint", help="Benchmark episodes: the evaluated generation's server.")
    ] = None,
    served_name: Annotated[
        str | None, typer.Option("--served-name", help="Benchmark episodes: the model name that server serves.")
    ] = None,
) -> None:
    """Publish what `episode run --handoff` hands over: each attempt's artifacts, then its row (one JSON line each).
    With `--proxy-control` it also opens and closes each attempt's session on the pod's proxy, and publishes that
    session's own log and counts."""
    with _episode_logging(log_format):
        try:
            cfg = load_config(config, set_ or ())
        except ConfigError as exc:
            raise _fail("\n".join(exc.problems)) from None
        from mass_ops.compute.kubernetes import EpisodeServer, SpecError
        from mass_ops.runtime.handoff import (
            HandoffError,
            HandoffPublisher,
            IncompleteHandoffError,
            PodProxy,
            PromptDelivery,
        )

        if (prompt_uri is None) != (prompt_sha256 is None):
            raise _fail("episode publish: give --prompt-uri and --prompt-sha256 together")
        if (workspace_seed_uri is None) != (workspace_seed_sha256 is None):
            raise _fail("episode publish: give --workspace-seed-uri and --workspace-seed-sha256 together")
        if (proxy_control is None) != (proxy_sessions is None):
            raise _fail("episode publish: give --proxy-control and --proxy-sessions together")
        if (endpoint is None) != (served_name is None):
            raise _fail("episode publish: give --endpoint and --served-name together")
        try:
            server = None if endpoint is None else EpisodeServer(endpoint, str(served_name))
        except SpecError as exc:
            raise _fail(f"episode publish: --endpoint: {exc}") from None
        try:
            seed = _workspace_seed(workspace_seed_uri, workspace_seed_sha256, "--workspace-seed-sha256")
        except EpisodeInputError as exc:
            raise _fail(f"episode publish: {exc}") from None
        if not handoff.is_dir():
            # The pod mounts the shared folder before either container starts; a missing one is a wrong path.
            raise _fail(f"episode publish: --handoff {handoff} is not a folder (the volume both containers share)")
        publisher = HandoffPublisher(
            cfg,
            handoff,
            start_timeout_s=start_timeout_s,
            stale_after_s=stale_after_s,
            on_outcome=lambda outcome: print(json.dumps(outcome_line(outcome)), flush=True),
            prompt=PromptDelivery(prompt_uri, prompt_sha256) if prompt_uri and prompt_sha256 else None,
            workspace_seed=seed,
            proxy=None if proxy_control is None else PodProxy(proxy_control, Path(str(proxy_sessions))),
            server=server,
        )
        try:
            code = publisher.run()
        except IncompleteHandoffError as exc:
            raise _fail(f"episode publish: {exc}") from None
        except (HandoffError, ValueError) as exc:
            raise _fail(f"episode publish: {exc}", 1) from None
    if code:
        raise _fail(f"episode publish: {publisher.failures} attempt(s) could not be published (see the log)", code)


def outcome_line(outcome: EpisodeOutcome) -> dict[str, Any]:
    """The machine-readable result of one unit (what an Airflow operator reads from the pod's log)."""
    return {
        "episode_id": outcome.episode_id,
        "status": outcome.status,
        "attempt": outcome.attempt,
        "artifacts": outcome.artifacts,
        "unit": f"{outcome.request.unit.cycle}/{outcome.request.unit.slug}",
        "reused": outcome.reused,
    }


def default_condition(cfg: CycleConfig, kind: str, task: int, version: int | None) -> str:
    """The reference release's condition name for a unit (MASS_SPEC §1)."""
    if kind == "search" and version is not None:
        return version_condition(task, version)
    if kind == "collection":
        return teacher_condition(task, cfg.generation)
    return bare_condition(task)


def _check_unit(
    cfg: CycleConfig,
    task: str,
    kind: str,
    version: int | None,
    seeds: list[int],
    *,
    candidate: int | None = None,
    generation: str | None = None,
) -> int | str:
    """The unit's task id (an int; a benchmark task's name) once the unit is checked."""
    if kind not in KINDS:
        raise EpisodeInputError(f"--kind: {kind!r} is not one of {', '.join(KINDS)}")
    task_id: int | str
    if kind == "benchmark":
        # A benchmark task belongs to its benchmark's dataset, not to the cycle's catalogue: the stage that binds the
        # episode (stages.benchmarks) read it there; its trial is the unit's candidate.
        from mass_ops.compute.kubernetes import BENCHMARK_TASK_NAME

        if not BENCHMARK_TASK_NAME.fullmatch(task):
            raise EpisodeInputError(f"--task: {task!r} is not a benchmark task name (<benchmark>_<instance>)")
        if candidate is None or not generation:
            raise EpisodeInputError("--candidate, --generation: a benchmark episode needs its trial and generation")
        task_id = task
    else:
        try:
            task_id = int(task)
        except ValueError:
            raise EpisodeInputError(f"--task: {task!r} is not a task id (a whole number)") from None
        known = set(cfg.tasks.train_candidates) | set(cfg.tasks.test) | set(cfg.rollout_tasks())
        if task_id not in known:
            raise EpisodeInputError(
                f"--task: task {task_id} is not part of cycle {cfg.cycle_name} (tasks: {sorted(known)})"
            )
    if kind == "search" and version is None:
        raise EpisodeInputError("--version: search episodes need the workflow version")
    if kind != "search" and version is not None:
        raise EpisodeInputError(f"--version: only search episodes have a workflow version (kind is {kind})")
    if any(s < 0 for s in seeds):
        raise EpisodeInputError("--seed: seeds must be non-negative")
    if len(set(seeds)) != len(seeds):
        raise EpisodeInputError("--seed: a seed is given twice")
    return task_id


def _workspace_seed(uri: str | None, sha256: str | None, flag: str) -> WorkspaceSeed | None:
    """`WorkspaceSeed(uri, sha256)` when both are given (None when neither); a malformed hash is one line."""
    if uri is None or sha256 is None:
        return None
    try:
        return WorkspaceSeed(uri, sha256)
    except ValueError as exc:
        raise EpisodeInputError(f"{flag}: {exc}") from None


def _read_prompt(store: Any, prompt_file: Path | None, prompt_uri: str | None) -> str:
    if (prompt_file is None) == (prompt_uri is None):
        raise EpisodeInputError("episode run: give exactly one of --prompt-file or --prompt-uri")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise EpisodeInputError(f"--prompt-file: cannot read {prompt_file}: {exc}") from None
    else:
        assert prompt_uri is not None
        key = artifact_key_of(store, prompt_uri)
        try:
            text = store.get_bytes(key).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise EpisodeInputError(f"--prompt-uri: cannot read {prompt_uri}: {exc}") from None
    if not text.strip():
        raise EpisodeInputError("episode run: the prompt is empty")
    return text


def artifact_key_of(store: ArtifactStore, uri: str) -> str:
    """The key of `uri` in `store`; EpisodeInputError if the URI lies outside it."""
    from mass_ops.store.artifacts import ArtifactKeyError

    try:
        return store.key_of(uri)
    except ArtifactKeyError as exc:
        raise EpisodeInputError(f"--prompt-uri: {exc}") from None


# --- signals, progress and logs ---------------------------------------------------------------------------------


def _install_sigterm() -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(previous: Any) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


class _Display:
    """Rich progress on stderr: units done of total, with running/retrying/failure counts."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.counts = {"running": 0, "retrying": 0, "succeeded": 0, "model_failure": 0, "infra_failure": 0}
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=_err,
            disable=not enabled,
        )
        self._task = self._progress.add_task(self._describe(), total=total)
        self._lock = threading.Lock()

    def __enter__(self) -> _Display:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def on_event(self, event: Any) -> None:
        with self._lock:
            final = event.kind in ("done", "reused")
            if event.kind == "started":
                self.counts["running"] += 1
            elif event.kind == "finished":
                self.counts["running"] -= 1
            elif event.kind == "retrying":
                self.counts["retrying"] += 1
            elif final and event.status in self.counts:
                self.counts[event.status] += 1
            self._progress.update(self._task, description=self._describe(), advance=1 if final else 0)

    def _describe(self) -> str:
        c = self.counts
        return (
            f"episodes: {c['running']} running, {c['succeeded']} succeeded, {c['model_failure']} model failures, "
            f"{c['infra_failure']} infrastructure failures, {c['retrying']} retries"
        )


class _JsonLogFormatter(logging.Formatter):
    """One JSON object per log record, with the episode fields the runtime attaches."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in ("episode", "episode_event"):
            if hasattr(record, field):
                entry[field] = getattr(record, field)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


@contextlib.contextmanager
def _episode_logging(log_format: str) -> Iterator[None]:
    """Runtime logs on stderr for the duration of the command (text, or one JSON object per line)."""
    if log_format not in ("text", "json"):
        raise _fail(f"--log-format: {log_format!r} is not text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonLogFormatter() if log_format == "json" else logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    )
    package = logging.getLogger("mass_ops")
    previous_level = package.level
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(previous_level)
