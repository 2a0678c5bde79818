"""The episode a stage runs for one unit of its work, as a request an episode pod can run ahead of the stage.

Contract: `episode_request` returns exactly the request the stage itself would run for the unit (same identity, seed,
condition and prompt) by asking the stage's domain module, so a pod's recorded episode is reused by the stage;
`publish_prompt` stores its prompt content-addressed for the pod's publisher. A benchmark unit is rebuilt only from
the identity, prompt and workspace seed its stage bound to the pod; an unbound one is refused.
Why and how: docs/architecture.md (`mass_ops.stages.units`).
"""

from __future__ import annotations

from mass_ops.context import CycleContext
from mass_ops.errors import InputError
from mass_ops.evaluation.rollouts import RolloutError
from mass_ops.layout import EpisodeUnit, episode_prompt_key
from mass_ops.runtime.episode import EpisodeIdentity, EpisodeRequest, WorkspaceSeed, describe, workspace_seed_key
from mass_ops.search.driver import SearchError, reference_request, search_episode_request
from mass_ops.stages.collect import CollectionError, candidate_request
from mass_ops.stages.evaluate import rollout_unit_request


class EpisodeUnitError(InputError):
    """No request for this unit: its prompt is not known yet (a search version not proposed, a search not finished),
    the task is not collected, or the identity names no unit of the cycle. The message is one line."""


def _required(identity: EpisodeIdentity, field: str) -> int:
    value = getattr(identity, field)
    if value is None:
        raise EpisodeUnitError(f"{describe(identity)}: a {identity.kind} episode needs {field}")
    return int(value)


def _catalogue_task(identity: EpisodeIdentity) -> int:
    # Only benchmark episodes name their task; every other kind numbers a catalogue task.
    task = identity.task_id
    if isinstance(task, bool) or not isinstance(task, int):
        raise EpisodeUnitError(f"{describe(identity)}: a {identity.kind} episode needs a catalogue task number")
    return task


def episode_request(ctx: CycleContext, identity: EpisodeIdentity) -> EpisodeRequest:
    """The request the stage of `identity` runs for it — reference and search: the RHI step's (v_k's prompt exists
    once step k-1 has proposed it); collection: the candidate's, teacher prompt frozen on first use as collection
    does; rollout: the cycle's rollout of that generation. EpisodeUnitError when there is none (yet)."""
    kind = identity.kind
    try:
        if kind == "reference":
            return reference_request(ctx, _catalogue_task(identity))
        if kind == "search":
            return search_episode_request(ctx, _catalogue_task(identity), _required(identity, "version"))
        if kind == "collection":
            return candidate_request(ctx, _catalogue_task(identity), _required(identity, "candidate"))
        if kind == "benchmark":
            return benchmark_request(ctx, identity)
        if kind == "rollout":
            if not identity.generation:
                raise EpisodeUnitError(f"{describe(identity)}: a rollout episode needs the generation it evaluates")
            replicate = _required(identity, "replicate")
            return rollout_unit_request(ctx, identity.generation, _catalogue_task(identity), replicate)
    except (SearchError, CollectionError, RolloutError) as exc:
        raise EpisodeUnitError(f"{describe(identity)}: {exc}") from None
    raise EpisodeUnitError(f"{describe(identity)}: {kind} episodes are not run one unit at a time by a stage")


def benchmark_request(ctx: CycleContext, identity: EpisodeIdentity) -> EpisodeRequest:
    """The request of a benchmark episode bound by its stage (seed, condition and prompt hash on the identity, the
    prompt stored under that hash); EpisodeUnitError for an unbound one or a prompt that is not stored."""
    seed = getattr(identity, "seed", None)
    condition = getattr(identity, "condition", None)
    sha256 = getattr(identity, "prompt_sha256", None)
    if seed is None or condition is None or sha256 is None:
        raise EpisodeUnitError(
            f"{describe(identity)}: a benchmark episode is bound by its benchmark stage, which reads the dataset"
        )
    key = episode_prompt_key(ctx.cycle_name, sha256)
    if not ctx.artifacts.exists(key):
        raise EpisodeUnitError(f"{describe(identity)}: its prompt {sha256[:12]}… is not stored; bind it first")
    unit = EpisodeUnit(
        ctx.cycle_name,
        identity.task_id,  # type: ignore[arg-type]  # benchmark tasks are named; the store keeps ids as text
        "benchmark",
        int(seed),
        candidate=identity.candidate,
        generation=identity.generation,
    )
    request = EpisodeRequest(
        unit,
        str(condition),
        ctx.artifacts.get_bytes(key).decode("utf-8"),
        workspace_seed=_bound_seed(ctx, identity),
    )
    if request.prompt_sha256 != sha256:
        raise EpisodeUnitError(f"{describe(identity)}: the stored prompt does not have SHA-256 {sha256[:12]}…")
    return request


def _bound_seed(ctx: CycleContext, identity: EpisodeIdentity) -> WorkspaceSeed | None:
    """The workspace seed a benchmark episode was bound with (None: none), which must be the cycle's stored seed
    of that SHA-256."""
    uri = getattr(identity, "workspace_seed_uri", None)
    sha256 = getattr(identity, "workspace_seed_sha256", None)
    if uri is None and sha256 is None:
        return None
    try:
        key = workspace_seed_key(ctx.cycle_name, str(sha256))
    except ValueError as exc:
        raise EpisodeUnitError(f"{describe(identity)}: {exc}") from None
    if ctx.artifacts.uri(key) != uri or not ctx.artifacts.exists(key):
        raise EpisodeUnitError(
            f"{describe(identity)}: its workspace seed {uri} is not the cycle's stored seed of SHA-256 "
            f"{str(sha256)[:12]}…; bind it again"
        )
    return WorkspaceSeed(str(uri), str(sha256))


def publish_prompt(ctx: CycleContext, request: EpisodeRequest) -> str:
    """Store the request's prompt under its content-addressed key (once) and return its URI."""
    key = episode_prompt_key(ctx.cycle_name, request.prompt_sha256)
    if ctx.artifacts.exists(key):
        return ctx.artifacts.uri(key)
    return ctx.artifacts.put_bytes(key, request.prompt.encode("utf-8")).uri
