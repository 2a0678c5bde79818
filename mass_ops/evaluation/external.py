"""Judges for reporting: external models (OpenAI-compatible, Anthropic) and the in-loop self-judge (MASS_SPEC §5, §10).

External judges are used only for reporting, never for selection. Every judge's client is an `mass_ops.llm.LLMClient`
(chat completions, `ResponsesClient` or `MessagesClient` by the judge's provider and API), so one retry policy, call
record and budget gate serve them all and the in-loop `PairwiseJudge` drives them: same evidence bundles and prompts,
bounded retries of unusable answers, every attempt in the call ledger, optional swap-consistent judging.

Keys are read from the environment variable the config names, at call time, and never stored: not on objects, not
in call records, not in the ledger. External judges get no sampling seed (the presentation seed decides the order
only); the self-judge samples with it like any in-loop call. Routes and request fields: docs/evaluation.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.config import CycleConfig, ExternalJudgeConfig
from mass_ops.errors import InputError
from mass_ops.judge.evidence import EvidenceBundle
from mass_ops.judge.pairwise import JudgeOutcome, PairwiseCase, PairwiseJudge
from mass_ops.judge.prompts import CANDIDATE_A_LABEL, CANDIDATE_B_LABEL
from mass_ops.judge.verdicts import VerdictParsing
from mass_ops.llm import (
    JsonMode,
    LLMClient,
    LLMConfigError,
    LLMEndpoint,
    MessagesClient,
    ResponsesClient,
    RetryPolicy,
    SamplingParams,
)
from mass_ops.llm.calls import CallLedger, CallUnit, in_loop_sampling
from mass_ops.llm.messages import ANTHROPIC_API_URL
from mass_ops.prompts import PromptSet
from mass_ops.seeds import presentation_swapped

SELF_JUDGE = "self"
ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_FLIP = {"A": "B", "B": "A", "tie": "tie", "invalid": "invalid"}


class ExternalJudgeError(InputError):
    """A report judge is misconfigured (missing key, unknown effort, bad name) or cannot be used."""


# What `PairwiseJudge` needs of a judge's client: every report judge's client is an `LLMClient`.
ChatClient = LLMClient


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


class AnthropicChatClient(MessagesClient):
    """`MessagesClient` for a configured Anthropic judge: its errors name the judge, and its key is read (and
    checked) by `read_judge_key` at each call. Without `base_url` it calls the Anthropic API."""

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
        try:
            endpoint = LLMEndpoint(base_url=base_url or ANTHROPIC_API_URL, model=model, api_key_env=api_key_env,
                                   backend="anthropic", request_timeout_s=request_timeout_s)  # fmt: skip
        except LLMConfigError as exc:
            raise ExternalJudgeError(f"judge {judge}: {exc}") from None
        super().__init__(endpoint, effort=effort, retry=retry, http_client=http_client, sleep=sleep)
        self.judge = judge

    def _api_key(self) -> str:
        return read_judge_key(self.endpoint.api_key_env, self.judge)


@dataclass(frozen=True)
class ReportJudge:
    """A judge of the report: its ledger name, identity, client and how its calls are sampled and recorded."""

    name: str
    provider: str
    model: str
    client: LLMClient
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
    client: LLMClient
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
        judge.client,
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
