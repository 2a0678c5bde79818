"""Episode preflight: the API key is usable and the endpoint serves the model, checked before anything is created.

`resolve_api_key` reads the variable `inference.api_key_env` names (local backends default it to a placeholder);
`check_endpoint` asks `GET <endpoint>/models` for the served model (OpenRouter: without `:nitro`). Every failure is
an `EpisodePreflightError` of one line that never holds the key; `EndpointUnreachableError` marks the transient kind
(worth waiting for), `ModelNotListedError` an endpoint that answers without the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

import aiohttp

from mass_ops.config import CycleConfig
from mass_ops.errors import InputError
from mass_ops.runtime.proxy import DEFAULT_KEY_VALUE
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

PREFLIGHT_TIMEOUT_S = 30.0
MODEL_LIST_MAX_BYTES = 8 << 20  # a served-model list is kilobytes; a larger answer is not one


class EpisodePreflightError(InputError):
    """An episode cannot start: the key, the endpoint or the served model is not usable. Nothing was created."""


class EndpointUnreachableError(EpisodePreflightError):
    """The endpoint did not answer `/models` (connection failure, timeout, 5xx): transient, worth waiting for."""


class ModelNotListedError(EpisodePreflightError):
    """The endpoint answers but does not serve the configured model."""


def resolve_api_key(config: CycleConfig, environ: Mapping[str, str]) -> str:
    """The key value from the variable named by `inference.api_key_env` (MASS_SPEC §4 preflight rules).

    Local backends default an unset/empty variable to "EMPTY"; OpenRouter needs a real key. A key with whitespace
    is refused (it would break the Authorization header). Messages name the variable, never the value.
    """
    name = config.inference.api_key_env
    value = environ.get(name, "")
    if not value:
        if config.inference.backend == "openrouter":
            raise EpisodePreflightError(f"episode preflight: environment variable {name} (the API key) is not set")
        value = DEFAULT_KEY_VALUE
    if any(char.isspace() for char in value):
        raise EpisodePreflightError(f"episode preflight: environment variable {name} (the API key) contains whitespace")
    return value


def discovery_model_id(config: CycleConfig) -> str:
    """The id `/models` must list: the served name, without OpenRouter's `:nitro` routing suffix."""
    name = config.models.served_name
    if config.inference.backend == "openrouter":
        return name.removesuffix(":nitro")
    return name


async def check_endpoint(
    config: CycleConfig, api_key: str, *, via: str | None = None, timeout_s: float = PREFLIGHT_TIMEOUT_S
) -> None:
    """`GET <endpoint>/models` must list the served model; raises `ModelNotListedError` or
    `EndpointUnreachableError` (one line, no key). `via`: the base URL of an episode proxy to ask through (then
    `api_key` is the proxy's token)."""
    endpoint = config.inference.endpoint.rstrip("/")
    url = f"{endpoint}/models"
    if via is not None:
        url = f"{via.rstrip('/')}{split_endpoint(endpoint)[1]}/models"
    wanted = discovery_model_id(config)
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url, headers={"Authorization": f"Bearer {api_key}"}) as response,
        ):
            status = response.status
            body = await response.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise EndpointUnreachableError(f"episode preflight: GET {url} failed: {type(exc).__name__}") from None
    if status >= 500:
        raise EndpointUnreachableError(f"episode preflight: GET {url} answered HTTP {status}")
    if status >= 400:
        raise EpisodePreflightError(f"episode preflight: GET {url} answered HTTP {status} (check the key variable)")
    try:
        document = loads_untrusted(body, what=f"GET {url}", max_bytes=MODEL_LIST_MAX_BYTES)
        listed = [str(item.get("id")) for item in document.get("data") or [] if isinstance(item, dict)]
    except (UntrustedInputError, AttributeError):
        raise EpisodePreflightError(f"episode preflight: GET {url} did not return a model list") from None
    if wanted not in listed:
        shown = ", ".join(listed[:10]) or "none"
        raise ModelNotListedError(
            f"episode preflight: endpoint {endpoint} does not serve model {wanted!r} (it lists: {shown})"
        )


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """`https://host:port/api/v1` → (`https://host:port`, `/api/v1`): the proxy's upstream and the client path."""
    parts = urlsplit(endpoint.rstrip("/"))
    return f"{parts.scheme}://{parts.netloc}", parts.path
