"""Where a registered generation is served during an evaluation, and the local servers that serve it.

An evaluation talks to two generations at once (L(k+1) and its parent L(k)), each behind its own OpenAI-compatible
server. A *serving scope* names such a group of servers (`<cycle>-evaluation` for a cycle, `nightly-<date>` for a
nightly run):

* Kubernetes backend: the inference-server operator runs one vLLM Deployment + Service per generation in the scope;
  a generation is reached at that Service's URL under its registered served name.
* Local backend: `serve_generations` starts one `transformers serve` per generation on a free port, loading its
  registered BF16 weights (fetched from the artifact store when they are not a
  local folder); each server's state file says where it listens and what it lists.

`serving_context` is the cycle context whose config points the runner and the in-loop client at one generation's
server; the cycle itself (name, id, hash) is unchanged, so its episodes and calls are recorded in the same cycle.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.compute.backend import LocalBackend, ModelRequest, backend_for
from mass_ops.compute.local import SERVERS_DIR
from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.errors import InputError
from mass_ops.store.schema import ModelGeneration

LOCAL_MODELS_DIR = Path("runs") / "models"


class ServingError(InputError):
    """A generation cannot be served or reached (not registered, no server started for it in this scope)."""


@dataclass(frozen=True)
class GenerationServer:
    """One generation's server: the base URL and the model name `/v1/models` lists for it."""

    generation: str
    endpoint: str
    served_name: str

    def as_dict(self) -> dict[str, str]:
        return {"generation": self.generation, "endpoint": self.endpoint, "served_name": self.served_name}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def evaluation_scope(config: CycleConfig) -> str:
    """The serving scope of a cycle's evaluation servers (the inference operator's default scope: the cycle)."""
    return config.cycle_name


def state_file(scope: str, generation: str) -> Path:
    """The local server state file of `generation` in `scope`."""
    return SERVERS_DIR / _slug(scope) / f"{_slug(generation)}.json"


def registered(ctx: CycleContext, name: str) -> ModelGeneration:
    """The registered generation `name`, or ServingError."""
    row = ctx.repo.get_generation(name)
    if row is None:
        raise ServingError(f"generation {name!r} is not registered in the metadata store")
    return row


def local_weights(ctx: CycleContext, row: ModelGeneration) -> Path:
    """A local folder with the generation's BF16 weights (the registered folder itself, or a verified download)."""
    from mass_ops.store.model_folders import fetch_model

    if not row.bf16_uri:
        raise ServingError(f"generation {row.name} has no BF16 weights registered")
    return fetch_model(ctx.artifacts, row.bf16_uri, LOCAL_MODELS_DIR / _slug(ctx.cycle_name) / f"{row.name}-bf16")


def serve_generations(ctx: CycleContext, names: Sequence[str], scope: str) -> list[GenerationServer]:
    """Local backend: start (or find running) one `transformers serve` per generation and wait until each is ready
    (`/health` answers and `/v1/models` lists it); a server that never becomes ready stops them all.

    Each server listens on a port that is free when it starts (on the endpoint's host): the in-loop endpoint's port
    may still be taken (by your own server, or a stand-in in tests), and the state file records where each one is.
    """
    config = ctx.config
    backend = backend_for(config)
    if not backend.runs_in_process:
        raise ServingError("serve_generations runs the local backend only; Kubernetes uses the inference operator")
    servers, started = [], []
    try:
        for name in dict.fromkeys(names):
            folder = str(local_weights(ctx, registered(ctx, name)))
            request = ModelRequest(
                folder, folder, config.inference.endpoint, state_file(scope, name), reuse="served_name"
            )
            server = backend.start_model(config, request)
            started.append(server)
            servers.append(GenerationServer(name, server.endpoint, server.served_name))
        for server in started:
            backend.wait_ready(config, server)
    except BaseException:
        stop_generations(scope)
        raise
    return servers


def stop_generations(scope: str) -> list[str]:
    """Local backend: stop every server of `scope` (a no-op for servers already gone); returns the generations."""
    folder = SERVERS_DIR / _slug(scope)
    stopped = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        LocalBackend().stop_model(path)  # what the local backend recorded (none on Kubernetes)
        stopped.append(path.stem)
    return stopped


def generation_server(ctx: CycleContext, name: str, scope: str) -> GenerationServer:
    """Where generation `name` is served in `scope` on the configured backend; ServingError when it is not
    registered (on either backend: no server serves an unregistered generation) or, locally, was never started."""
    row = registered(ctx, name)
    found = backend_for(ctx.config).locate_model(
        ctx.config, scope=scope, served_name=row.served_name or name, state_file=state_file(scope, name)
    )
    if found is None:
        raise ServingError(f"no local server of {name} was started in scope {scope!r}; start the evaluation servers")
    return GenerationServer(name, found.endpoint, found.served_name)


def serving_config(config: CycleConfig, server: GenerationServer) -> CycleConfig:
    """`config` with its endpoint and served model pointed at `server`, and the inference fields that server's
    backend dictates (`ComputeBackend.serving_update`: locally `transformers serve`, an OpenAI-compatible backend
    scheduling first come, first served, whatever the in-loop endpoint is). Nothing else changes."""
    update: dict[str, Any] = {"endpoint": server.endpoint, **backend_for(config).serving_update(config)}
    inference = config.inference.model_copy(update=update)
    models = config.models.model_copy(update={"served_name": server.served_name})
    return config.model_copy(update={"inference": inference, "models": models})


def serving_context(ctx: CycleContext, server: GenerationServer) -> CycleContext:
    """The same cycle, with the runner and in-loop client pointed at one generation's server."""
    return dataclasses.replace(ctx, config=serving_config(ctx.config, server))
