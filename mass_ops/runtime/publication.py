"""What one finished attempt publishes (`EpisodePublication`): its files, its status document and its row.

`assemble_publication` builds it once the agent and the proxy have stopped: the proxy log (already redacted by
`redact_attempt`, the API key replaced in every file the attempt produced) is gzipped, the transcript and log are
classified (`outcome.classify`), and the status document records the limits, durations and the proxy's own counts
(`usage`: the row's counts, never a re-read of a log the agent could have touched). A sink then publishes it
(`mass_ops.runtime.publishing`).
"""

from __future__ import annotations

import gzip
import logging
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, NonNegativeInt

from mass_ops.config import CycleConfig
from mass_ops.layout import EpisodeUnit
from mass_ops.runtime.agent_process import AgentRun
from mass_ops.runtime.attempt_folder import AttemptPaths, make_readable
from mass_ops.runtime.episode import EpisodeRequest, EpisodeStatus
from mass_ops.runtime.outcome import StatusContext, Transcript, UsageTotals, classify, status_record
from mass_ops.runtime.redaction import SecretRedactor
from mass_ops.store.artifacts import ArtifactStore
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

logger = logging.getLogger(__name__)


class EpisodeRecord(BaseModel):
    """The result fields of an attempt's row; its identity (cycle, unit, attempt, condition, prompt hash) comes from
    the unit and the request. Strict: the hand-off reads it back from a file the sandbox wrote."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: EpisodeStatus
    model: str
    exit_code: int | None
    failure: dict[str, Any] | None
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    requests: NonNegativeInt
    max_prompt_tokens: NonNegativeInt
    started_at: AwareDatetime
    finished_at: AwareDatetime
    qwen_code_version: str
    cached_prompt_tokens: NonNegativeInt = 0


@dataclass(frozen=True)
class AttemptFiles:
    """The files an attempt publishes besides its status document (names as in `layout.EPISODE_FILES`).

    `workspace` is the workspace folder, or — in a hand-off — its deterministic tar.gz (`workspace_archived`), which
    holds the same bytes `put_dir` would have stored.
    """

    workspace: Path
    prompt: Path
    stream: Path
    stderr: Path
    api_log: Path
    settings: Path
    workspace_archived: bool = False

    @classmethod
    def of_attempt(cls, paths: AttemptPaths) -> AttemptFiles:
        return cls(paths.workspace, paths.prompt, paths.stream, paths.stderr, paths.api_log_gz, paths.settings_record)


@dataclass(frozen=True)
class EpisodePublication:
    """Everything one finished attempt publishes: its files, its status document and its row."""

    request: EpisodeRequest
    unit: EpisodeUnit  # with the attempt number
    files: AttemptFiles
    status: dict[str, Any]
    record: EpisodeRecord
    retry_of_id: int | None = None


@dataclass(frozen=True)
class FinishedAttempt:
    """What the runner knows of an attempt once its agent and proxy have stopped: the input of its publication.
    `usage` is what the proxy counted; `egress` the egress proxy's counts, when the attempt had one."""

    request: EpisodeRequest
    unit: EpisodeUnit  # with the attempt number
    paths: AttemptPaths
    agent: AgentRun
    started_at: datetime
    finished_at: datetime
    client_endpoint: str
    env_policy: str
    durations: dict[str, float]
    usage: UsageTotals
    egress: dict[str, int] | None = None
    retry_of_id: int | None = None


def redact_attempt(paths: AttemptPaths, api_key: str | None, unit_key: str) -> None:
    """Replace the API key in the stream, stderr, proxy log and workspace of the attempt (logged when found)."""
    redactor = SecretRedactor(api_key or "")
    if not redactor.active:
        return
    changed = [
        name
        for name, path in (("stream", paths.stream), ("stderr", paths.stderr), ("api_log", paths.api_log))
        if redactor.file(path)
    ]
    changed += [f"workspace/{name}" for name in redactor.tree(paths.workspace)]
    if changed:
        logger.warning("episode %s: redacted the API key from %s", unit_key, ", ".join(changed))


def read_proxy_log(path: Path) -> list[dict[str, Any]]:
    """The fields of each proxy record that classification and accounting read (bodies are not kept in memory)."""
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = loads_untrusted(line, what=str(path), max_bytes=len(line), max_depth=None)
            except UntrustedInputError:
                continue
            if not isinstance(record, dict):
                continue
            response = record.get("response")
            summary = (
                {"usage": response.get("usage"), "error": response.get("error")} if isinstance(response, dict) else None
            )
            records.append(
                {
                    "seq": record.get("seq"),
                    "path": record.get("path"),
                    "status": record.get("status"),
                    "proxy_error": record.get("proxy_error"),
                    "response": summary,
                    "budget_exhausted": record.get("budget_exhausted"),
                }
            )
    return records


def gzip_log(source: Path, target: Path) -> None:
    """gzip -6 of the proxy log (an empty log still gives a valid, empty archive)."""
    with gzip.open(target, "wb", compresslevel=6) as out:
        if source.exists():
            with source.open("rb") as handle:
                shutil.copyfileobj(handle, out, 1 << 20)


def assemble_publication(
    attempt: FinishedAttempt,
    records: list[dict[str, Any]],
    *,
    config: CycleConfig,
    store: ArtifactStore,
    qwen_code_version: str,
    execution_mode: str,
) -> EpisodePublication:
    """Gzip the proxy log, classify and write the status document: what the attempt publishes. `records` are the
    proxy log's (`read_proxy_log`, after redaction), read for classification only; `store` names the artifacts."""
    request, unit, paths, agent = attempt.request, attempt.unit, attempt.paths, attempt.agent
    started_at, finished_at, usage = attempt.started_at, attempt.finished_at, attempt.usage
    gzip_log(paths.api_log, paths.api_log_gz)
    transcript = Transcript.parse(paths.stream.read_text(encoding="utf-8", errors="replace"))
    limits = config.runtime
    classification = classify(
        transcript,
        records,
        backend=config.inference.backend,
        terminated_by=agent.terminated_by,
        wall_clock_s=limits.episode_wall_clock_s,
    )
    context = StatusContext(
        unit_key=unit.key,
        attempt=unit.attempt,
        condition=request.condition,
        seed=unit.seed,
        model=config.models.served_name,
        endpoint=config.inference.endpoint,
        client_endpoint=attempt.client_endpoint,
        qwen_code_version=qwen_code_version,
        exit_code=agent.exit_code,
        started_at=started_at,
        finished_at=finished_at,
        prompt_source=store.uri(unit.artifact_key("prompt")),
        api_log=store.uri(unit.artifact_key("api_log")),
        api_requests=len(records),
        env_policy=attempt.env_policy,
        operational_limits={
            "http_response_timeout_ms": limits.http_response_timeout_ms,
            "foreground_shell_timeout_ms": limits.shell_timeout_ms,
            "context_window_tokens": config.inference.context_window_tokens,
            "max_tokens_per_model_response": config.inference.episode_max_output_tokens,
            "stream_idle_timeout_ms": limits.stream_idle_timeout_ms,
            "episode_wall_clock_s": limits.episode_wall_clock_s,
        },
        durations={**attempt.durations, "total_s": (finished_at - started_at).total_seconds()},
        terminated_by=agent.terminated_by,
        execution_mode=execution_mode,
    )
    # Whatever the agent left (a `chmod 000`) must not break the workspace tarball.
    make_readable(paths.workspace)
    status = status_record(context, classification, usage)
    if request.workspace_seed is not None:
        # Which files the agent started from: the workspace is the seed plus the agent's work.
        status["workspace_seed"] = request.workspace_seed.as_dict()
    if attempt.egress:
        status["egress"] = attempt.egress  # connections, refused, bytes_up, bytes_down (mass_ops.compute.egress)
    return EpisodePublication(
        request=request,
        unit=unit,
        files=AttemptFiles.of_attempt(paths),
        status=status,
        record=EpisodeRecord(
            status=classification.status,
            model=context.model,
            exit_code=context.exit_code,
            failure=classification.failure,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            requests=usage.requests,
            max_prompt_tokens=usage.max_prompt_tokens,
            started_at=started_at,
            finished_at=finished_at,
            qwen_code_version=context.qwen_code_version,
            cached_prompt_tokens=usage.cached_prompt_tokens,
        ),
        retry_of_id=attempt.retry_of_id,
    )
