"""What the publisher hands to the sandbox before any agent starts: the unit's prompt and a workspace seed.

The sandbox reaches no store, so the publisher fetches both from the cycle's content-addressed keys of the hashes the
operator computed, refuses a URI other than that key's, checks the bytes and writes them into the folder (the seed
first: the sandbox starts once prompt.txt is there and finds its seed beside it). A refusal stops the pod before
its agent runs: `PromptDeliveryError`, `SeedDeliveryError`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from mass_ops.context import CycleContext
from mass_ops.layout import episode_prompt_key
from mass_ops.runtime.episode import WorkspaceSeed, workspace_seed_key
from mass_ops.runtime.handoff.folder import PROMPT_FILE, SEED_FILE, Handoff, IncompleteHandoffError
from mass_ops.store.artifacts import ArtifactIntegrityError, ArtifactNotFoundError


@dataclass(frozen=True)
class PromptDelivery:
    """The prompt the publisher hands to the sandbox: its artifact URI and the SHA-256 the operator computed."""

    uri: str
    sha256: str


class PromptDeliveryError(IncompleteHandoffError):
    """The prompt the publisher was given cannot be handed over (not the cycle's prompt artifact of that hash, missing,
    or other bytes): no agent starts, nothing is published."""


class SeedDeliveryError(IncompleteHandoffError):
    """The workspace seed the publisher was given cannot be handed over (not the cycle's seed artifact of that hash,
    missing, or other bytes): no agent starts, nothing is published."""


def deliver_prompt(ctx: CycleContext, handoff: Handoff, prompt: PromptDelivery) -> None:
    """Fetch the prompt from the cycle's content-addressed key of its hash, check the bytes, write prompt.txt."""
    try:
        key = episode_prompt_key(ctx.cycle_name, prompt.sha256)
    except ValueError as exc:
        raise PromptDeliveryError(f"--prompt-sha256: {exc}") from None
    if ctx.artifacts.uri(key) != prompt.uri:
        raise PromptDeliveryError(
            f"--prompt-uri: {prompt.uri} is not the prompt artifact of cycle {ctx.cycle_name} with SHA-256 "
            f"{prompt.sha256[:12]}… (expected {ctx.artifacts.uri(key)})"
        )
    try:
        data = ctx.artifacts.get_bytes(key)
    except ArtifactNotFoundError:
        raise PromptDeliveryError(f"--prompt-uri: {prompt.uri} does not exist") from None
    if hashlib.sha256(data).hexdigest() != prompt.sha256:
        raise PromptDeliveryError(f"--prompt-uri: {prompt.uri} does not hold the prompt of SHA-256 {prompt.sha256}")
    handoff.write_bytes(handoff.path(PROMPT_FILE), data)


def deliver_seed(ctx: CycleContext, handoff: Handoff, seed: WorkspaceSeed) -> None:
    """Fetch the workspace seed from the cycle's content-addressed key of its hash, checked, into `SEED_FILE`."""
    key = workspace_seed_key(ctx.cycle_name, seed.sha256)
    if ctx.artifacts.uri(key) != seed.uri:
        raise SeedDeliveryError(
            f"--workspace-seed-uri: {seed.uri} is not the workspace seed of cycle {ctx.cycle_name} with SHA-256 "
            f"{seed.sha256[:12]}… (expected {ctx.artifacts.uri(key)})"
        )
    target = handoff.path(SEED_FILE)
    try:
        ctx.artifacts.get_file(key, target, sha256=seed.sha256)  # atomic, and only when the bytes check
    except ArtifactNotFoundError:
        raise SeedDeliveryError(f"--workspace-seed-uri: {seed.uri} does not exist") from None
    except ArtifactIntegrityError:
        raise SeedDeliveryError(
            f"--workspace-seed-uri: {seed.uri} does not hold the seed of SHA-256 {seed.sha256}"
        ) from None
