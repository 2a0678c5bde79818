"""When an OpenAI-compatible model server is ready: `/health` answers 200, `/v1/models` lists the served name **and**
a one-token smoke generation under that name succeeds.

vLLM answers `/health` as soon as its HTTP server is up, before or while the model loads in some versions, and a
server started with the wrong `--served-model-name` is healthy but useless; a server can also list the model and
still fail every generation (a checkpoint whose weights load but whose kernels do not run, a chat template that
does not render, `transformers serve` loading the model only on the first request). All three checks together are
what "ready" means for a cycle. The same rule serves the local backend (`transformers serve`), the Airflow
readiness trigger and the CLI. The API key is read from the environment variable the config names and sent only as
a bearer header.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import httpx


@dataclass(frozen=True)
class ReadinessReport:
    """One probe of one server: `problem` is None when ready, else one line saying what is missing."""

    endpoint: str
    served_name: str
    problem: str | None

    @property
    def ready(self) -> bool:
        return self.problem is None


def server_root(endpoint: str) -> str:
    """`http://host:port/v1` → `http://host:port` (where `/health` lives)."""
    parts = urlsplit(endpoint.rstrip("/"))
    path = parts.path[: -len("/v1")] if parts.path.endswith("/v1") else parts.path
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def health_url(endpoint: str) -> str:
    return f"{server_root(endpoint)}/health"


def models_url(endpoint: str) -> str:
    return f"{endpoint.rstrip('/')}/models"


def smoke_url(endpoint: str) -> str:
    return f"{endpoint.rstrip('/')}/chat/completions"


# The first generation may load the model (`transformers serve`) or warm kernels up: longer than a status probe.
SMOKE_TIMEOUT_S = 120.0


def smoke_request(served_name: str) -> dict[str, Any]:
    """The one-token chat completion that proves the served model generates (greedy, not streamed)."""
    return {
        "model": served_name,
        "messages": [{"role": "user", "content": "Reply with one word: ready?"}],
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": False,
    }


def smoke_problem(status: int, payload: Any) -> str | None:
    """None when the smoke generation answered with a choice; else what went wrong."""
    if status != 200:
        detail = ""
        if isinstance(payload, Mapping):
            error = payload.get("error")
            message = error.get("message") if isinstance(error, Mapping) else error
            detail = f": {str(message)[:200]}" if message else ""
        return f"smoke generation answered HTTP {status}{detail}"
    choices = payload.get("choices") if isinstance(payload, Mapping) else None
    if not isinstance(choices, list) or not choices:
        return "smoke generation answered without a choice"
    return None


def listed_models(payload: Any) -> list[str]:
    """Model ids of an OpenAI `/v1/models` answer (`{"data": [{"id": ...}, ...]}`); [] for anything else."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), list):
        return []
    return [str(item["id"]) for item in payload["data"] if isinstance(item, Mapping) and "id" in item]


def readiness_problem(health_status: int | None, models_payload: Any, served_name: str) -> str | None:
    """None when ready; else what is missing (the health status, or the served names the server lists)."""
    if health_status is None:
        return "/health did not answer"
    if health_status != 200:
        return f"/health answered HTTP {health_status}"
    names = listed_models(models_payload)
    if served_name not in names:
        return f"/v1/models lists {names} but not {served_name!r}"
    return None


def auth_headers(api_key_env: str | None) -> dict[str, str]:
    """Bearer header from the named environment variable (vLLM guards /v1/* with VLLM_API_KEY); none if unset."""
    key = os.environ.get(api_key_env) if api_key_env else None
    return {"Authorization": f"Bearer {key}"} if key else {}


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


@dataclass(frozen=True)
class _Call:
    """One request of a probe; `failure` starts the problem line when it cannot be sent or answered."""

    method: Literal["GET", "POST"]
    url: str
    failure: str
    options: dict[str, Any] = field(default_factory=dict)


def _probe_calls(
    endpoint: str, served_name: str, headers: dict[str, str], smoke: bool, smoke_timeout_s: float
) -> Generator[_Call, httpx.Response, str | None]:
    """The probe's requests in order, each sent back its response; returns the problem (None when ready)."""
    health = (yield _Call("GET", health_url(endpoint), "/health unreachable")).status_code
    payload: Any = None
    if health == 200:
        models = yield _Call("GET", models_url(endpoint), "/v1/models unreachable", {"headers": headers})
        if models.status_code != 200:
            return f"/v1/models answered HTTP {models.status_code}"
        payload = _json_or_none(models)
    problem = readiness_problem(health, payload, served_name)
    if problem is None and smoke:
        options = {"json": smoke_request(served_name), "headers": headers, "timeout": smoke_timeout_s}
        answer = yield _Call("POST", smoke_url(endpoint), "smoke generation failed", options)
        problem = smoke_problem(answer.status_code, _json_or_none(answer))
    return problem


class _ProbeRun:
    """One probe without its transport, so `probe` and `probe_async` share every step and message: send `call`
    (None once done), pass its response or transport error to `answer`, then read `report()`."""

    def __init__(
        self, endpoint: str, served_name: str, api_key_env: str | None, smoke: bool, smoke_timeout_s: float
    ) -> None:
        self.endpoint, self.served_name = endpoint, served_name
        self._calls = _probe_calls(endpoint, served_name, auth_headers(api_key_env), smoke, smoke_timeout_s)
        self.call: _Call | None = next(self._calls)
        self._problem: str | None = None

    def answer(self, outcome: httpx.Response | httpx.HTTPError) -> None:
        call = self.call
        if call is None:
            raise RuntimeError("the probe is done: no call awaits an answer")
        if isinstance(outcome, httpx.HTTPError):
            self.call, self._problem = None, f"{call.failure} ({type(outcome).__name__})"
            return
        try:
            self.call = self._calls.send(outcome)
        except StopIteration as done:
            self.call, self._problem = None, done.value

    def report(self) -> ReadinessReport:
        return ReadinessReport(self.endpoint, self.served_name, self._problem)


def probe(
    endpoint: str,
    served_name: str,
    *,
    api_key_env: str | None = None,
    timeout_s: float = 5.0,
    smoke: bool = True,
    smoke_timeout_s: float = SMOKE_TIMEOUT_S,
) -> ReadinessReport:
    """Probe a server once (blocking); `smoke=False` skips the generation (liveness only)."""
    run = _ProbeRun(endpoint, served_name, api_key_env, smoke, smoke_timeout_s)
    with httpx.Client(timeout=timeout_s) as client:
        while (call := run.call) is not None:
            try:
                response = client.request(call.method, call.url, **call.options)
            except httpx.HTTPError as exc:
                run.answer(exc)
            else:
                run.answer(response)
    return run.report()


async def probe_async(
    endpoint: str,
    served_name: str,
    *,
    api_key_env: str | None = None,
    timeout_s: float = 5.0,
    smoke: bool = True,
    smoke_timeout_s: float = SMOKE_TIMEOUT_S,
) -> ReadinessReport:
    """Probe a server once without blocking the event loop (used by the Airflow triggerer)."""
    run = _ProbeRun(endpoint, served_name, api_key_env, smoke, smoke_timeout_s)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        while (call := run.call) is not None:
            try:
                response = await client.request(call.method, call.url, **call.options)
            except httpx.HTTPError as exc:
                run.answer(exc)
            else:
                run.answer(response)
    return run.report()
