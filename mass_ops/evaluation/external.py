"""Judges for reporting: external models (OpenAI-compatible, Anthropic) and the in-loop self-judge (MASS_SPEC §5, §10).

External judges are used only for reporting, never for selection. Every judge speaks the chat contract of
`mass_ops.llm.LLMClient` (`chat(system, user, *, purpose, sampling, json_mode) -> ChatResult`, a `recorder`), so
the in-loop `PairwiseJudge` drives all of them: same evidence bundles and prompts, bounded retries of unusable
answers, every attempt in the call ledger, optional swap-consistent judging.

* OpenAI-compatible, ``api: responses`` (the reference's gpt-5.5 judge): `ResponsesClient` on the judge's base URL,
  ``POST /responses`` with ``reasoning.effort`` and no output cap unless one is configured.
* OpenAI-compatible, ``api: chat``: `LLMClient` on the judge's base URL; a configured `reasoning_effort` (e.g.
  ``xhigh``) is sent as the chat-completions ``reasoning_effort`` field.
* Anthropic: the `anthropic` SDK, ``messages.stream`` with adaptive thinking and ``output_config.effort``;
  the verdict JSON is taken from the final text (fenced or bare; strict: as the reference reads it).

Keys are read from the environment variable the config names, at call time, and never stored: not on objects, not
in call records, not in the ledger. The presentation seed is not a sampling seed for external judges (the reference
sends none); the self-judge samples with it like any in-loop call.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from mass_ops.config import CycleConfig, ExternalJudgeConfig
from mass_ops.errors import InputError
from mass_ops.judge.evidence import EvidenceBundle
from mass_ops.judge.pairwise import JudgeOutcome, PairwiseCase, PairwiseJudge
from mass_ops.judge.prompts import CANDIDATE_A_LABEL, CANDIDATE_B_LABEL
from mass_ops.judge.verdicts import VerdictParsing
from mass_ops.llm import (
    CallRecord,
    CallRecorder,
    ChatResult,
    JsonMode,
    JsonParsing,
    LLMClient,
    LLMConfigError,
    LLMEndpoint,
    LLMOutputError,
    LLMRequestError,
    ResponsesClient,
    RetryPolicy,
    SamplingParams,
    extract_json_object,
    fenced_json_object,
    send_with_retries,
)
from mass_ops.llm.calls import CallLedger, CallUnit, in_loop_sampling
from mass_ops.prompts import PromptSet
from mass_ops.seeds import presentation_swapped

if TYPE_CHECKING:
    import anthropic

SELF_JUDGE = "self"
ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_FLIP = {"A": "B", "B": "A", "tie": "tie", "invalid": "invalid"}


class ExternalJudgeError(InputError):
    """A report judge is misconfigured (missing key, unknown effort, bad name) or cannot be used."""


class ChatClient(Protocol):
    """What `PairwiseJudge` needs of a client (the `LLMClient` contract)."""

    recorder: CallRecorder | None

    def chat(
        self,
        system: str,
        user: str,
        *,
        purpose: str,
        sampling: SamplingParams | None = None,
        json_mode: JsonMode | None = None,
        schema: dict[str, Any] | None = None,
        json_parsing: JsonParsing = "lenient",
    ) -> ChatResult: ...

    def close(self) -> None: ...


def read_judge_key(env_name: str, judge: str) -> str:
    """The judge's API key from the environment, now; a missing or blank key is an error naming the variable."""
    key = os.environ.get(env_name, "")
    if not key.strip():
        raise ExternalJudgeError(f"judge {judge}: environment variable {env_name} is empty or unset")
    if any(ch.isspace() for ch in key):
        raise ExternalJudgeError(f"judge {judge}: environment variable {env_name} contains whitespace")
    return key


class ReasoningEffortClient(LLMClient):
    """`LLMClient` for an external OpenAI-compatible judge: adds ``reasoning_effort`` and sends the output ceiling as
    ``max_completion_tokens``.

    `SamplingParams` only knows the in-loop efforts (low/medium/high, OpenRouter only); external reasoning models
    take more (``xhigh``), so the judge's configured value is set on the request itself. Reasoning models refuse the
    legacy ``max_tokens``; ``max_completion_tokens`` is accepted by OpenAI and by vLLM alike.
    """

    def __init__(self, endpoint: LLMEndpoint, *, reasoning_effort: str | None, **options: Any) -> None:
        super().__init__(endpoint, **options)
        self.reasoning_effort = reasoning_effort

    def build_request(
        self,
        system: str,
        user: str,
        sampling: SamplingParams,
        json_mode: JsonMode | None = None,
        schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        request = super().build_request(system, user, sampling, json_mode, schema)
        if "max_tokens" in request:
            request["max_completion_tokens"] = request.pop("max_tokens")
        if self.reasoning_effort:
            request["reasoning_effort"] = self.reasoning_effort
        return request


class AnthropicChatClient:
    """The chat contract over Anthropic's Messages API (streamed, adaptive thinking, effort).

    Transient failures (connection, timeout, 5xx, 529 overloaded) are retried by `retry`; 4xx are not. The SDK's own
    retries are off (``max_retries=0``) so that every attempt is counted here.
    """

    def __init__(
        self,
        *,
        model: str,
        api_key_env: str,
        judge: str,
        base_url: str | None = None,
        effort: str | None = None,
        request_timeout_s: float = 3600.0,
        retry: RetryPolicy | None = None,
        http_client: Any = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if effort is not None and effort not in ANTHROPIC_EFFORTS:
            raise ExternalJudgeError(f"judge {judge}: reasoning_effort must be one of {list(ANTHROPIC_EFFORTS)}")
        self.model = model
        self.api_key_env = api_key_env
        self.judge = judge
        self.base_url = base_url.rstrip("/") if base_url else None
        self.effort = effort
        self.request_timeout_s = request_timeout_s
        self.retry = retry or RetryPolicy()
        self.recorder: CallRecorder | None = None
        self._http = http_client
        self._lock = threading.Lock()
        self._sleep = sleep

    def __repr__(self) -> str:
        return f"AnthropicChatClient(model={self.model!r}, base_url={self.base_url!r})"

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    def _sdk(self) -> anthropic.Anthropic:
        import anthropic  # deferred: the SDK is large and only report judging needs it

        with self._lock:
            if self._http is None:
                # No redirects: a redirect could forward the key to another host. One pool for every call.
                self._http = anthropic.DefaultHttpxClient(follow_redirects=False)
        # A fresh SDK object per call keeps the key out of long-lived state.
        return anthropic.Anthropic(
            api_key=read_judge_key(self.api_key_env, self.judge),
            base_url=self.base_url,
            max_retries=0,
            timeout=self.request_timeout_s,
            http_client=self._http,
        )

    def build_request(self, system: str, user: str, sampling: SamplingParams) -> dict[str, Any]:
        """Keyword arguments of ``messages.stream`` (also what gets recorded; never the key)."""
        request: dict[str, Any] = {
            "model": self.model,
            "max_tokens": sampling.max_tokens or 4096,
            "system": system,
            "messages": [{"role": "user", "content": user}],
            "thinking": {"type": "adaptive"},
        }
        if self.effort:
            request["output_config"] = {"effort": self.effort}
        return request

    def _send(
        self, sdk: anthropic.Anthropic, request: dict[str, Any], purpose: str
    ) -> tuple[Any, int, Exception | None]:
        import anthropic
        import httpx2  # the SDK's HTTP layer: a stream cut mid-message surfaces as its transport error

        def final_message() -> Any:
            with sdk.messages.stream(**request) as stream:
                return stream.get_final_message()

        def classify(error: Exception) -> LLMRequestError | str | None:
            if isinstance(error, anthropic.APIStatusError):
                if error.status_code < 500 and error.status_code != 429:  # 429: rate limited, worth a retry
                    detail = json.dumps(error.body, default=str) if error.body is not None else str(error)
                    return LLMRequestError(
                        f"{purpose} rejected: HTTP {error.status_code}: {detail}"[:2000], error.status_code
                    )
                return f"HTTP {error.status_code}"
            if isinstance(error, anthropic.APIConnectionError | httpx2.TransportError):
                return f"{type(error).__name__}: {error}"
            return None

        return send_with_retries(
            final_message, classify, self.retry, self._sleep, what=purpose, where=self.base_url or "the Anthropic API"
        )

    def chat(
        self,
        system: str,
        user: str,
        *,
        purpose: str,
        sampling: SamplingParams | None = None,
        json_mode: JsonMode | None = None,
        schema: dict[str, Any] | None = None,
        json_parsing: JsonParsing = "lenient",
    ) -> ChatResult:
        """One streamed message; JSON calls (`json_mode` set) return the object found in the final text: leniently,
        or (`json_parsing` strict) as the reference reads it — its text blocks trimmed and joined by newlines, then
        `fenced_json_object`."""
        sampling = sampling or SamplingParams()
        request = self.build_request(system, user, sampling)
        sdk = self._sdk()
        started = time.monotonic()
        message, attempts, error = self._send(sdk, request, purpose)
        latency = time.monotonic() - started
        base_url = self.base_url or str(sdk.base_url).rstrip("/")

        def record(status: Literal["ok", "error"], usage: dict[str, Any] | None, raw: Any, failure: str | None) -> None:
            if self.recorder is not None:
                self.recorder(
                    CallRecord(
                        purpose=purpose,
                        backend="anthropic",
                        base_url=base_url,
                        model=self.model,
                        seed=None,
                        status=status,
                        attempts=attempts,
                        latency_s=latency,
                        usage=usage,
                        cost_usd=None,  # the Messages API reports no price
                        request=request,
                        response=raw,
                        error=failure,
                    )
                )

        if error is not None:
            record("error", None, None, str(error))
            raise error
        raw = message.model_dump(mode="json")
        usage = _anthropic_usage(raw.get("usage") or {})
        blocks = raw.get("content") or []
        text = "".join(block.get("text", "") for block in blocks if block.get("type") == "text")
        thinking = "".join(block.get("thinking", "") for block in blocks if block.get("type") == "thinking") or None
        try:
            if not text.strip():
                reason = "output ceiling consumed by thinking" if thinking else "no text block"
                raise LLMOutputError(f"empty final content: {reason} (stop_reason {raw.get('stop_reason')})")
            if raw.get("stop_reason") == "refusal":
                raise LLMOutputError(f"model refused: {text[:500]}")
            parsed = None
            if json_mode is not None and json_parsing == "strict":
                parsed = fenced_json_object(_reference_text(blocks))
            elif json_mode is not None:
                parsed = extract_json_object(text)
        except LLMOutputError as output_error:
            record("error", usage, raw, str(output_error))
            raise
        record("ok", usage, raw, None)
        return ChatResult(
            content=text,
            reasoning_content=thinking,
            parsed_json=parsed,
            usage=usage,
            cost_usd=None,
            latency_s=latency,
            model=self.model,
            served_model=raw.get("model"),
            attempts=attempts,
            request=request,
            finish_reason=raw.get("stop_reason"),
            provider="anthropic",
            response_id=raw.get("id"),
        )


def _reference_text(blocks: list[dict[str, Any]]) -> str:
    """The reference's answer text of a Messages response: each non-blank text block trimmed, joined by newlines."""
    texts = (str(block.get("text", "")).strip() for block in blocks if block.get("type") == "text")
    return "\n".join(text for text in texts if text)


def _anthropic_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic usage with the OpenAI-style counters the ledger and reports read."""
    prompt = int(usage.get("input_tokens") or 0)
    prompt += int(usage.get("cache_read_input_tokens") or 0) + int(usage.get("cache_creation_input_tokens") or 0)
    completion = int(usage.get("output_tokens") or 0)
    return {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class ReportJudge:
    """A judge of the report: its ledger name, identity, client and how its calls are sampled and recorded."""

    name: str
    provider: str
    model: str
    client: ChatClient
    purpose: Literal["external_judge", "self_judge"]
    sampling: Callable[[int | None], SamplingParams]

    @property
    def is_self(self) -> bool:
        return self.purpose == "self_judge"


def _check_name(name: str) -> str:
    if not name or "/" in name or any(ch.isspace() for ch in name) or len(name) > 60:
        raise ExternalJudgeError(f"judge name {name!r} must be 1-60 characters without '/' or spaces")
    return name


def open_external_judge(
    judge: ExternalJudgeConfig,
    *,
    retry: RetryPolicy | None = None,
    request_timeout_s: float = 3600.0,
    http_client: Any = None,
    max_tokens: int | None = None,
) -> ReportJudge:
    """A report judge for one configured external judge; its key must be set now (checked, not kept).

    `max_tokens` overrides the configured output ceiling (the MLR rubric judge uses 16000); with neither, no cap is
    sent (Anthropic: its required cap defaults to 4096, as in the reference).
    """
    name = _check_name(judge.name)
    read_judge_key(judge.api_key_env, name)
    ceiling = max_tokens or judge.max_tokens
    client: ChatClient
    if judge.provider == "anthropic":
        client = AnthropicChatClient(
            model=judge.model,
            api_key_env=judge.api_key_env,
            judge=name,
            base_url=judge.base_url,
            effort=judge.reasoning_effort,
            request_timeout_s=request_timeout_s,
            retry=retry,
            http_client=http_client,
        )
    else:
        if judge.base_url is None:
            raise ExternalJudgeError(f"judge {name}: an openai-compatible judge needs base_url")
        try:
            endpoint = LLMEndpoint(
                base_url=judge.base_url,
                model=judge.model,
                api_key_env=judge.api_key_env,
                backend="openai-compatible",
                request_timeout_s=request_timeout_s,
            )
        except LLMConfigError as exc:
            raise ExternalJudgeError(f"judge {name}: {exc}") from None
        if judge.api == "responses":
            client = ResponsesClient(endpoint, reasoning_effort=judge.reasoning_effort, retry=retry)
        else:
            client = ReasoningEffortClient(endpoint, reasoning_effort=judge.reasoning_effort, retry=retry)
    return ReportJudge(
        name=name,
        provider=judge.provider,
        model=judge.model,
        client=client,
        purpose="external_judge",
        # The presentation seed decides the order only; external judges get no sampling seed (MASS_SPEC §10).
        sampling=lambda _seed: SamplingParams(max_tokens=ceiling),
    )


@contextlib.contextmanager
def external_judges(
    config: CycleConfig,
    *,
    names: Sequence[str] | None = None,
    retry: RetryPolicy | None = None,
    max_tokens: int | None = None,
) -> Iterator[list[ReportJudge]]:
    """The configured external judges (all, or those named), closed when the block ends."""
    configured = {judge.name: judge for judge in config.evaluation.judges}
    wanted = list(configured) if names is None else list(names)
    unknown = [name for name in wanted if name not in configured]
    if unknown:
        raise ExternalJudgeError(f"judges {unknown} are not configured (evaluation.judges: {sorted(configured)})")
    judges: list[ReportJudge] = []
    try:
        for name in wanted:
            judges.append(open_external_judge(configured[name], retry=retry, max_tokens=max_tokens))
        yield judges
    finally:
        for judge in judges:
            judge.client.close()


def self_judge(config: CycleConfig, client: LLMClient, *, name: str = SELF_JUDGE) -> ReportJudge:
    """The in-loop judge (the model being served, with the in-loop sampling and the seed) as a report judge."""
    return ReportJudge(
        name=_check_name(name),
        provider=config.inference.backend,
        model=config.models.served_name,
        client=client,
        purpose="self_judge",
        sampling=lambda seed: in_loop_sampling(config, seed),
    )


@dataclass(frozen=True)
class PresentedVerdict:
    """A verdict in the pair's own orientation (A = side A), with how it was presented."""

    verdict: str
    swapped: bool
    outcome: JudgeOutcome


def judge_presentation(
    judge: ReportJudge,
    ledger: CallLedger,
    unit: CallUnit,
    *,
    task_id: int,
    task_text: str,
    bundle_a: EvidenceBundle,
    bundle_b: EvidenceBundle,
    seed: int,
    invalid_retries: int = 2,
    swap_consistent: bool = False,
    position_bias_sample: float = 0.0,
    prompts: PromptSet | None = None,
    verdict_parsing: VerdictParsing = "lenient",
) -> PresentedVerdict:
    """Judge side A against side B under presentation seed `seed`.

    If `presentation_swapped(seed)`, B's bundle is shown as workspace A (and A's as B) and the verdict is mapped
    back. Labels are neutral (candidate-a / candidate-b) so that no generation name can sway the judge. A pair in the
    `position_bias_sample` is judged once more in the other presentation, recorded only (`PairwiseJudge`).
    """
    swapped = presentation_swapped(seed)
    shown_a, shown_b = (bundle_b, bundle_a) if swapped else (bundle_a, bundle_b)
    case = PairwiseCase(
        unit=unit,
        task_id=task_id,
        task_text=task_text,
        label_a=CANDIDATE_A_LABEL,
        label_b=CANDIDATE_B_LABEL,
        bundle_a=shown_a,
        bundle_b=shown_b,
        seed=seed,
    )
    pairwise = PairwiseJudge(
        judge.client,  # type: ignore[arg-type]  # any ChatClient honours the LLMClient contract
        ledger,
        judge.sampling,
        invalid_retries=invalid_retries,
        swap_consistent=swap_consistent,
        position_bias_sample=position_bias_sample,
        prompts=prompts,
        verdict_parsing=verdict_parsing,
    )
    outcome = pairwise.judge(case)
    verdict = _FLIP[outcome.verdict] if swapped else outcome.verdict
    return PresentedVerdict(verdict=verdict, swapped=swapped, outcome=outcome)
