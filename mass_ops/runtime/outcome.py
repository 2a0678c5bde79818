"""Outcome of one episode attempt: classification of the agent's transcript and proxy log, and the status record.

Classification (MASS_SPEC §4, plus what the reference cannot meet): a request refused by a budget →
`budget_exhausted` (neither model data nor an infrastructure fault: never retried); an infrastructure "[API Error"
as the last assistant text, or an API failure in the proxy log → `infra_failure` (`api_error_infra`); else success
iff a `result` event succeeded; else a model failure (its result's subtype, or `wall_clock_limit` / `no_result`
when the attempt ended without one). Statuses: `succeeded`, `infra_failure`, `budget_exhausted`, `model_failure`.
The status record (`status.json`) carries every field of the reference `run_status.json` plus status, attempt,
unit, token usage, durations and proxy failures. The rules in full: docs/runtime.md (`mass_ops.runtime.outcome`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from mass_ops.runtime.episode import EpisodeStatus
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

API_ERROR_PREFIX = "[API Error"
INFRA_ERROR_MARKERS = (
    "Connection error",
    "ECONNREFUSED",
    "Request timeout",
    "fetch failed",
    "ECONNRESET",
    "socket hang up",
    "No stream activity",
    "terminated",
    "Service Unavailable",
    "502",
    "503",
)
INFRA_SUBTYPE = "api_error_infra"
BUDGET_SUBTYPE = "budget_exhausted"
PROXY_FAILURE_MESSAGE = "API failure recorded in proxy log"
WALL_CLOCK_SUBTYPE = "wall_clock_limit"
NO_RESULT_SUBTYPE = "no_result"
INFRA_MESSAGE_CHARS = 300
FAILURE_MESSAGE_CHARS = 1500
LAST_TOOL_CALLS = 5
TOOL_ARGS_CHARS = 200
MAX_PROXY_FAILURES = 5  # listed in the failure document; the status record lists them all
EXECUTION_MODE = "headless_host_visible_yolo"
# Every route on which the server generates (chat and text completions, Responses): each request counts.
GENERATION_SUFFIXES = ("/completions", "/responses")


@dataclass(frozen=True)
class Transcript:
    """The events of qwen-code's `--output-format stream-json` stdout that classification reads."""

    events: tuple[dict[str, Any], ...]
    bad_lines: int = 0

    @classmethod
    def parse(cls, text: str) -> Transcript:
        """One JSON object per line; lines that are not JSON objects are counted, not fatal (a killed agent can
        leave half a line behind)."""
        events: list[dict[str, Any]] = []
        bad = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                event = loads_untrusted(line, what="agent stream", max_bytes=len(line))
            except UntrustedInputError:
                bad += 1
                continue
            if isinstance(event, dict):
                events.append(event)
            else:
                bad += 1
        return cls(tuple(events), bad)

    @property
    def results(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == "result"]

    def has_success_result(self) -> bool:
        return any(r.get("subtype") == "success" and r.get("is_error") is False for r in self.results)

    def assistant_blocks(self) -> Iterable[dict[str, Any]]:
        """Content blocks of every assistant event in order (a string content is one text block)."""
        for event in self.events:
            if event.get("type") != "assistant":
                continue
            content = (event.get("message") or {}).get("content")
            if isinstance(content, str):
                yield {"type": "text", "text": content}
            elif isinstance(content, list):
                yield from (block for block in content if isinstance(block, dict))

    def last_assistant_text(self) -> str | None:
        """The last non-empty text an assistant emitted (orchestrator or subagent)."""
        last = None
        for block in self.assistant_blocks():
            text = block.get("text") if block.get("type") == "text" else None
            if isinstance(text, str) and text.strip():
                last = text
        return last

    def last_tool_calls(self, limit: int = LAST_TOOL_CALLS) -> list[dict[str, str]]:
        """The last `limit` tool calls, most recent first, arguments as JSON cut to `TOOL_ARGS_CHARS`."""
        calls = [
            {"name": str(block.get("name")), "args": _clip(_json_text(block.get("input")), TOOL_ARGS_CHARS)}
            for block in self.assistant_blocks()
            if block.get("type") == "tool_use"
        ]
        return calls[::-1][:limit]


@dataclass(frozen=True)
class UsageTotals:
    """Token accounting of one episode's generation requests (chat and text completions, Responses; subagents
    included)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    max_prompt_tokens: int = 0
    # usage.prompt_tokens_details.cached_tokens summed over the requests whose server reported it (prompt-cache hits)
    cached_prompt_tokens: int = 0

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> UsageTotals:
        counter = UsageCounter()
        for record in records:
            response = record.get("response")
            counter.count(record.get("path"), response.get("usage") if isinstance(response, dict) else None)
        return counter.totals()

    @classmethod
    def from_mapping(cls, data: Any) -> UsageTotals:
        """The totals `as_dict()` wrote (e.g. in a proxy's answer); a missing or malformed field counts 0."""
        fields = data if isinstance(data, Mapping) else {}
        return cls(**{name: _count(fields.get(name)) for name in cls.__dataclass_fields__})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class UsageCounter:
    """Running `UsageTotals` of one proxy session, fed where the proxy settles each exchange's usage: the row's
    counts come from here (the proxy's own memory), not from a log file the agent could have touched. Thread-safe."""

    def __init__(self, totals: UsageTotals | None = None) -> None:
        self._lock = threading.Lock()
        self._totals = totals or UsageTotals()

    def count(self, path: Any, usage: Any) -> None:
        """Add one exchange on `path` whose response reported `usage` (None when it reported none)."""
        if not str(path or "").endswith(GENERATION_SUFFIXES):
            return
        prompt = completion = cached = 0
        if isinstance(usage, dict):
            # The Responses API names them input and output tokens.
            prompt = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
            completion = _count(usage.get("completion_tokens", usage.get("output_tokens")))
            details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
            cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        with self._lock:
            now = self._totals
            self._totals = UsageTotals(
                now.prompt_tokens + prompt,
                now.completion_tokens + completion,
                now.requests + 1,
                max(now.max_prompt_tokens, prompt),
                now.cached_prompt_tokens + cached,
            )

    def totals(self) -> UsageTotals:
        with self._lock:
            return self._totals


def proxy_failures(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Proxy records that show an API failure (rule 4): proxy error, HTTP status ≥ 400, or an error body."""
    found = []
    for record in records:
        if record.get("budget_exhausted") or record.get("rejected"):
            # Refused by the proxy on purpose (a budget, a route, a body, a token): what the agent did, not a failure
            # of the API — counting it would let an agent turn its own episode into infrastructure retries.
            continue
        status = record.get("status")
        response = record.get("response")
        error = response.get("error") if isinstance(response, dict) else None
        bad_status = isinstance(status, int) and status >= 400
        if record.get("proxy_error") or bad_status or error:
            found.append(
                {
                    "seq": record.get("seq"),
                    "path": record.get("path"),
                    "status": status,
                    "proxy_error": record.get("proxy_error"),
                    "error": _clip(_json_text(error), INFRA_MESSAGE_CHARS) if error else None,
                }
            )
    return found


def budget_refusals(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The `budget_exhausted` documents of the requests the episode's proxy refused because of a budget."""
    return [
        {"seq": record.get("seq"), **record["budget_exhausted"]}
        for record in records
        if isinstance(record.get("budget_exhausted"), dict)
    ]


@dataclass(frozen=True)
class Classification:
    """What an attempt amounted to: `status`, the reference's success flag, and the failure document."""

    status: EpisodeStatus
    success: bool
    failure: dict[str, Any] | None
    proxy_failures: tuple[dict[str, Any], ...] = ()

    @property
    def infrastructure(self) -> bool:
        return self.status == "infra_failure"


def classify(
    transcript: Transcript,
    records: Sequence[Mapping[str, Any]],
    *,
    backend: str,
    terminated_by: str | None = None,
    wall_clock_s: int | None = None,
) -> Classification:
    """Apply MASS_SPEC §4's rules (module docstring) to one attempt's transcript and proxy records."""
    refusals = budget_refusals(records)
    if refusals:
        first = refusals[0]
        message = (
            f"the episode proxy refused request {first.get('seq')}: {first.get('setting')} = {first.get('limit')} "
            f"would be exceeded ({first.get('spent')} spent, up to {first.get('need')} needed)"
        )
        refused = {"subtype": BUDGET_SUBTYPE, "message": message, "budget": first, "refused_requests": len(refusals)}
        return Classification("budget_exhausted", False, refused, tuple(proxy_failures(records)))
    success = transcript.has_success_result()
    failure: dict[str, Any] | None = None

    last_text = transcript.last_assistant_text()
    api_error = last_text is not None and last_text.startswith(API_ERROR_PREFIX)
    if (
        last_text is not None
        and api_error
        and (backend == "openrouter" or any(marker in last_text for marker in INFRA_ERROR_MARKERS))
    ):
        success = False
        failure = {"subtype": INFRA_SUBTYPE, "message": _clip(last_text, INFRA_MESSAGE_CHARS)}

    if failure is None and not success:
        failure = _model_failure(transcript, terminated_by, wall_clock_s)

    failures = proxy_failures(records)
    if failures:
        success = False
        if failure is None or failure.get("subtype") != INFRA_SUBTYPE:
            failure = {"subtype": INFRA_SUBTYPE, "message": PROXY_FAILURE_MESSAGE}
        failure = {**failure, "proxy_failures": failures[:MAX_PROXY_FAILURES]}

    if success:
        status: EpisodeStatus = "succeeded"
    elif failure is not None and failure.get("subtype") == INFRA_SUBTYPE:
        status = "infra_failure"
    else:
        status = "model_failure"
    return Classification(status, success, failure, tuple(failures))


def _model_failure(transcript: Transcript, terminated_by: str | None, wall_clock_s: int | None) -> dict[str, Any]:
    results = transcript.results
    if results:
        last = results[-1]
        error = last.get("error")
        reported = error.get("message") if isinstance(error, dict) else None
        result = last.get("result")
        message = reported if isinstance(reported, str) and reported else result if isinstance(result, str) else ""
        subtype = str(last.get("subtype") or "error")
    elif terminated_by == "wall_clock":
        subtype = WALL_CLOCK_SUBTYPE
        message = f"the episode exceeded its wall-clock limit of {wall_clock_s} s and was stopped"
    else:
        subtype = NO_RESULT_SUBTYPE
        message = "qwen-code ended without a result event"
    return {
        "subtype": subtype,
        "message": _clip(message, FAILURE_MESSAGE_CHARS),
        "last_tool_calls_most_recent_first": transcript.last_tool_calls(),
    }


@dataclass(frozen=True)
class StatusContext:
    """Facts of one attempt that the status record reports besides the classification."""

    unit_key: str
    attempt: int
    condition: str
    seed: int
    model: str
    endpoint: str
    client_endpoint: str
    qwen_code_version: str
    exit_code: int | None
    started_at: datetime
    finished_at: datetime
    prompt_source: str
    api_log: str
    api_requests: int
    env_policy: str
    operational_limits: dict[str, Any]
    durations: dict[str, float]
    terminated_by: str | None = None
    execution_mode: str = EXECUTION_MODE


def status_record(context: StatusContext, classification: Classification, usage: UsageTotals) -> dict[str, Any]:
    """The attempt's `status.json`: the reference `run_status.json` fields, then mass-ops' additions."""
    return {
        "started_at": context.started_at.isoformat(),
        "finished_at": context.finished_at.isoformat(),
        "model": context.model,
        "endpoint": context.endpoint,
        "seed": context.seed,
        "qwen_code_version": context.qwen_code_version,
        "exit_code": context.exit_code,
        "trace_has_success_result": classification.success,
        "failure": classification.failure,
        "execution_mode": context.execution_mode,
        "operational_limits": dict(context.operational_limits),
        "hiw": {
            "condition": context.condition,
            "prompt_source": context.prompt_source,
            "client_endpoint": context.client_endpoint,
            "api_log": context.api_log,
            "api_requests": context.api_requests,
            "mass": True,
            "env_policy": context.env_policy,
        },
        "status": classification.status,
        "unit": context.unit_key,
        "attempt": context.attempt,
        "usage": usage.as_dict(),
        "durations": {name: round(value, 3) for name, value in context.durations.items()},
        "terminated_by": context.terminated_by,
        "proxy_failures": list(classification.proxy_failures),
    }


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
