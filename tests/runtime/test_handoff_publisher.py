"""The hand-off protocol driven in-process: the publisher on a thread against a sandbox written by hand or the real
`SandboxHandoff`. What it refuses, what it delivers before the agent starts (prompt, workspace seed), what it charges
to the budgets, and the documents both sides exchange.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from mass_ops.context import CycleContext
from mass_ops.layout import EPISODE_FILES, EpisodeUnit
from mass_ops.runtime import handoff as hand
from mass_ops.runtime.episode import EpisodeRequest
from mass_ops.runtime.handoff import spend as spend_module
from tests.support.handoff import SEED, ScriptedSandbox, finished_publication, serve_in_thread
from tests.support.runtime import (
    TASK,
    episode_config,
    open_episode_cycle,
)

# --- the protocol, in-process --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("unfinished attempt", "attempt a1 of reference-t51-s450051 was never finished (no publication.json)"),
        ("changed prompt", "the prompt of reference-t51-s450051/a1 differs from the one announced"),
        ("stray folder", "attempts/reference-t51-s450051/a7 is not an attempt the episode container announced"),
    ],
)
def test_the_publisher_refuses_what_was_not_handed_over_whole(tmp_path: Path, scenario: str, message: str) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    ledger = sandbox.announce()
    assert ledger.cycle_id == ctx.cycle_id and ledger.artifact_url == ctx.artifacts.url
    if scenario == "unfinished attempt":
        sandbox.attempt(1, finished=False)
    elif scenario == "changed prompt":
        finished_publication(sandbox.attempt(1, prompt="another prompt"), 1)
    else:
        finished_publication(sandbox.attempt(7), 7)
    sandbox.complete()
    thread.join(timeout=60)
    error = result.get("error")
    assert isinstance(error, hand.IncompleteHandoffError), result
    assert message in str(error) and "\n" not in str(error)
    assert ctx.repo.episodes(ctx.cycle_id) == [] and ctx.artifacts.list("cycles/") == []
    failure = sandbox.handoff.read(sandbox.handoff.path(hand.PUBLISHER_FAILED_FILE), hand.PublisherFailure)
    assert message in failure.error


def test_what_the_publisher_writes_to_the_folder_carries_no_credential(tmp_path: Path) -> None:
    config = episode_config(tmp_path, "http://127.0.0.1:9/v1", metadata_url="postgresql://mass:pg-pass-9f3@db/mass")
    environ = {"AWS_SECRET_ACCESS_KEY": "wJalr-secret-71", "AWS_ACCESS_KEY_ID": "AKIA-id-55"}
    publisher = hand.HandoffPublisher(config, tmp_path / "handoff", environ=environ)
    leaked = "could not connect to postgresql://mass:pg-pass-9f3@db/mass as AKIA-id-55 / wJalr-secret-71 (pg-pass-9f3)"
    scrubbed = publisher.scrubbed(leaked)
    assert not {"pg-pass-9f3", "wJalr-secret-71", "AKIA-id-55"} & set(scrubbed.replace("/", " ").split())
    assert "pg-pass-9f3" not in scrubbed and scrubbed.startswith("could not connect to [REDACTED] as [REDACTED]")


def _publish_to_a_full_disk(tmp_path: Path) -> tuple[Any, Any, Any, dict[str, Any]]:
    """One attempt published through a store whose disk is full for the stream file: (ctx, sandbox, publisher,
    the publisher's result)."""
    import dataclasses

    from mass_ops.store.artifacts import ArtifactError
    from mass_ops.store.local_artifacts import LocalArtifactStore

    class FullDisk(LocalArtifactStore):
        def _publish(self, key: str, staged: Path, sha256: str, size: int) -> Any:
            if key.endswith("stream.jsonl"):
                raise ArtifactError(f"cannot store {key}: no space left on device")
            return super()._publish(key, staged, sha256, size)

    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    broken = dataclasses.replace(ctx, artifacts=FullDisk(str(tmp_path / "artifacts")))
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: broken)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    finished_publication(sandbox.attempt(1), 1)
    sandbox.complete()
    thread.join(timeout=60)
    return ctx, sandbox, publisher, result


def test_a_failed_upload_is_acknowledged_as_an_error_and_no_row_is_written(tmp_path: Path) -> None:
    ctx, sandbox, publisher, result = _publish_to_a_full_disk(tmp_path)
    assert result == {"code": 1} and publisher.failures == 1
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED)
    ack = sandbox.handoff.read(sandbox.handoff.ack_path(unit.slug, 1), hand.Ack)
    assert ack.episode_id is None
    assert ack.error == f"ArtifactError: cannot store {unit.artifact_key('stream')}: no space left on device"
    assert ctx.repo.episodes(ctx.cycle_id) == [], "the row comes only after every artifact"
    assert not ctx.artifacts.exists(unit.artifact_key("status"))


def test_a_rollout_runs_on_the_server_the_publisher_looks_up(tmp_path: Path) -> None:
    from mass_ops.compute.kubernetes import inference_url
    from mass_ops.config import validate_config
    from tests.inner_loop_fakes import open_test_cycle

    data = episode_config(tmp_path, "http://127.0.0.1:9/v1").model_dump(mode="json")
    data["compute"]["backend"] = "kubernetes"
    ctx = open_test_cycle(validate_config(data))
    ctx.repo.register_generation("L1", 1, bf16_uri="models/L1-bf16", served_name="L1")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    unit = EpisodeUnit(ctx.cycle_name, TASK, "rollout", SEED, candidate=2, generation="L1")
    with hand.SandboxHandoff(tmp_path / "handoff") as session:
        sandbox_ctx = session.open(ctx.config, [EpisodeRequest(unit=unit, condition=f"t{TASK}_bare", prompt="p")])
    thread.join(timeout=60)
    assert result == {"code": 0}
    assert sandbox_ctx.config.inference.endpoint == inference_url(ctx.config, ctx.cycle_name, "L1")
    assert sandbox_ctx.config.models.served_name == "L1"
    assert (
        sandbox_ctx.repo.episode_attempts(0, task_id=TASK, kind="rollout", seed=SEED, candidate=2, generation="L1")
        == []
    )


def delivering_publisher(
    ctx: CycleContext, root: Path, prompt: str, *, stored: bytes | None = None, uri: str | None = None
) -> hand.HandoffPublisher:
    """A publisher told to deliver `prompt`: stored as the operator stores it (or `stored` bytes under its key, or
    nothing when `stored` is b""), announced under `uri` (default: the artifact's own)."""
    from mass_ops.layout import episode_prompt_key

    sha = hashlib.sha256(prompt.encode()).hexdigest()
    key = episode_prompt_key(ctx.cycle_name, sha)
    data = prompt.encode() if stored is None else stored
    if data:
        ctx.artifacts.put_bytes(key, data)
    delivery = hand.PromptDelivery(uri or ctx.artifacts.uri(key), sha)
    return hand.HandoffPublisher(ctx.config, root, attach=lambda _config: ctx, prompt=delivery)


def test_the_publisher_writes_the_prompt_before_the_sandbox_reads_it(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    prompt = "the prompt of the unit\n"
    thread, result = serve_in_thread(delivering_publisher(ctx, tmp_path / "handoff", prompt))
    sandbox = hand.SandboxHandoff(tmp_path / "handoff")
    with sandbox:
        sandbox.await_prompt(tmp_path / "handoff" / hand.PROMPT_FILE)
        assert (tmp_path / "handoff" / hand.PROMPT_FILE).read_text() == prompt
        sandbox.await_prompt(tmp_path / "elsewhere.txt")  # a prompt file of its own: nothing to wait for
        unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED)
        sandbox.open(ctx.config, [EpisodeRequest(unit=unit, condition=f"t{TASK}_bare", prompt=prompt)])
    thread.join(timeout=60)
    assert result == {"code": 0}


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("missing", "does not exist"),
        ("other bytes", "does not hold the prompt of SHA-256"),
        ("another uri", "is not the prompt artifact of cycle episode-test with SHA-256"),
    ],
)
def test_a_prompt_the_publisher_cannot_vouch_for_stops_the_pod(tmp_path: Path, scenario: str, message: str) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    options: dict[str, Any] = {
        "missing": {"stored": b""},
        "other bytes": {"stored": b"a prompt the operator never computed"},
        "another uri": {"uri": ctx.artifacts.uri("cycles/elsewhere/prompt.txt")},
    }[scenario]
    thread, result = serve_in_thread(delivering_publisher(ctx, tmp_path / "handoff", "the prompt", **options))
    sandbox = hand.SandboxHandoff(tmp_path / "handoff")
    with pytest.raises(hand.HandoffError) as caught, sandbox:
        sandbox.await_prompt(tmp_path / "handoff" / hand.PROMPT_FILE)
    thread.join(timeout=60)
    assert isinstance(result.get("error"), hand.PromptDeliveryError) and message in str(result["error"])
    assert "the publisher gave up" in str(caught.value) and message in str(caught.value)
    assert not (tmp_path / "handoff" / hand.PROMPT_FILE).exists()


def test_a_request_announcing_another_prompt_is_refused(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    publisher = delivering_publisher(ctx, tmp_path / "handoff", "the delivered prompt")
    thread, result = serve_in_thread(publisher)
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "a prompt of its own")
    sandbox.announce_only()
    thread.join(timeout=60)
    error = result.get("error")
    assert isinstance(error, hand.IncompleteHandoffError), result
    assert "request.json announces reference-t51-s450051 with prompt" in str(error)
    assert "not the prompt" in str(error) and not (tmp_path / "handoff" / hand.LEDGER_FILE).exists()


# --- budgets: a pod's spend reaches the ledger at ingest; the sandbox sees the scopes' spend -------------------------


def api_log_with_costs(folder: Path, *costs: float) -> None:
    """The attempt's proxy log (gzip JSON lines) with one completion per cost, as a server reporting `usage.cost`."""
    lines = [
        json.dumps({"seq": i, "path": "/v1/chat/completions", "response": {"usage": {"prompt_tokens": 1, "cost": c}}})
        for i, c in enumerate(costs)
    ]
    (folder / EPISODE_FILES["api_log"]).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def spend(ctx: CycleContext) -> dict[str, tuple[int, float, int]]:
    return {s: (r.tokens, round(r.cost_usd, 6), r.requests) for s, r in ctx.repo.budget_spend(ctx.cycle_id).items()}


def test_a_pods_spend_is_charged_once_when_its_attempt_is_recorded(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    ctx.repo.add_budget_spend(ctx.cycle_id, ["cycle"], tokens=10, requests=1)  # spent before, elsewhere
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    folder = sandbox.attempt(1)
    api_log_with_costs(folder, 0.0125, 0.0025)
    finished_publication(folder, 1)  # 1 prompt + 1 completion token, 1 request
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 0}
    charged = {"task:51": (2, 0.015, 1), "cycle": (12, 0.015, 2)}
    assert spend(ctx) == charged

    # The ingest retried (a publisher started again on the same folder, the operator's retry): the row exists, so
    # its spend was charged by the ingest that recorded it; nothing is added.
    announced = hand.HandoffUnit(
        task_id=TASK, kind="reference", seed=SEED, condition=f"t{TASK}_bare",
        prompt_sha256=hashlib.sha256(b"the prompt").hexdigest(),
    )  # fmt: skip
    for _ in range(2):
        publisher._publish(ctx, ctx.cycle_name, announced, 1)
    assert publisher.failures == 0 and len(ctx.repo.episodes(ctx.cycle_id)) == 1
    assert spend(ctx) == charged


def test_an_ingest_that_failed_before_the_row_charges_when_it_is_retried(tmp_path: Path) -> None:
    ctx, _sandbox, publisher, result = _publish_to_a_full_disk(tmp_path)
    assert result == {"code": 1} and spend(ctx) == {}, "no row, no charge"
    announced = hand.HandoffUnit(
        task_id=TASK, kind="reference", seed=SEED, condition=f"t{TASK}_bare",
        prompt_sha256=hashlib.sha256(b"the prompt").hexdigest(),
    )  # fmt: skip
    for _ in range(2):
        publisher._publish(ctx, ctx.cycle_name, announced, 1)
    assert len(ctx.repo.episodes(ctx.cycle_id)) == 1
    assert spend(ctx) == {"task:51": (2, 0.0, 1), "cycle": (2, 0.0, 1)}


def test_a_charge_lost_after_the_row_was_recorded_is_made_once_by_the_retried_ingest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crash window between committing the attempt's row and charging it: the retry charges, exactly once."""
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    real_charge = spend_module.charge_episode

    def killed(*args: Any, **kwargs: Any) -> bool:
        raise ConnectionError("the publisher's connection dropped after the row was committed")

    monkeypatch.setattr(spend_module, "charge_episode", killed)
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    finished_publication(sandbox.attempt(1), 1)
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 0} and len(ctx.repo.episodes(ctx.cycle_id)) == 1, "the row is durable"
    assert spend(ctx) == {}, "its charge was lost"

    monkeypatch.setattr(spend_module, "charge_episode", real_charge)
    announced = hand.HandoffUnit(
        task_id=TASK, kind="reference", seed=SEED, condition=f"t{TASK}_bare",
        prompt_sha256=hashlib.sha256(b"the prompt").hexdigest(),
    )  # fmt: skip
    for _ in range(3):  # the operator's retries ingest the same attempt again
        publisher._publish(ctx, ctx.cycle_name, announced, 1)
    assert publisher.failures == 0 and len(ctx.repo.episodes(ctx.cycle_id)) == 1
    assert spend(ctx) == {"task:51": (2, 0.0, 1), "cycle": (2, 0.0, 1)}, "charged once, by the first retry"


def test_the_sandbox_checks_the_task_and_cycle_spend_the_publisher_read(tmp_path: Path) -> None:
    from mass_ops.config import validate_config
    from mass_ops.store.budgets import BudgetLedger, BudgetLimits, episode_scopes

    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    data = ctx.config.model_dump(mode="json")
    data["budgets"] = {"task_tokens": 1_000, "cycle_tokens": 50_000, "episode_tokens": 400}
    config = validate_config(data)
    ctx.repo.add_budget_spend(ctx.cycle_id, episode_scopes(TASK), tokens=1_000)
    ctx.repo.add_budget_spend(ctx.cycle_id, episode_scopes(202), tokens=7)  # another task's: not handed over
    publisher = hand.HandoffPublisher(config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED)
    with hand.SandboxHandoff(tmp_path / "handoff") as session:
        sandbox_ctx = session.open(config, [EpisodeRequest(unit=unit, condition=f"t{TASK}_bare", prompt="p")])
    thread.join(timeout=60)
    assert result == {"code": 0}
    seen = sandbox_ctx.repo.budget_spend(sandbox_ctx.cycle_id)
    assert {scope: row.tokens for scope, row in seen.items()} == {"task:51": 1_000, "cycle": 1_007}
    # The pod's pool asks this before each attempt, as it asks the store on the local backend.
    ledger = BudgetLedger(sandbox_ctx.repo, sandbox_ctx.cycle_id, BudgetLimits.from_mapping(data["budgets"]))
    refused = ledger.exhausted(episode_scopes(TASK))
    assert refused is not None and refused.setting == "budgets.task_tokens"


@pytest.mark.parametrize("task_id", ["tb2_hello-world", "swe_django__django-11099", 51])
def test_a_unit_names_a_cycle_task_by_number_and_a_benchmark_task_by_name(tmp_path: Path, task_id: Any) -> None:
    handoff = hand.Handoff(tmp_path)
    unit = hand.HandoffUnit(
        task_id=task_id, kind="benchmark", seed=1, candidate=0, generation="L1", condition="c", prompt_sha256="0" * 64
    )
    request = hand.HandoffRequest(cycle="c", config_hash="0" * 64, units=[unit])
    handoff.write(handoff.path(hand.REQUEST_FILE), request)
    assert handoff.read(handoff.path(hand.REQUEST_FILE), hand.HandoffRequest).units[0].task_id == task_id


@pytest.mark.parametrize("task_id", ["../tb2_x", "tb2_x/../y", "tb2_", "TB2_x", "", 0, -3])
def test_a_task_name_that_could_climb_out_of_a_key_is_refused(task_id: Any) -> None:
    with pytest.raises(ValidationError):
        hand.HandoffUnit(task_id=task_id, kind="benchmark", seed=1, condition="c", prompt_sha256="0" * 64)


# --- a benchmark task's workspace seed (ISSUE #18) -----------------------------------------------------------------


def stored_seed(ctx: CycleContext, files: dict[str, bytes], *, stored: bytes | None = None) -> Any:
    """A workspace seed archived as the benchmark stage archives one, stored under its SHA-256 (or `stored` bytes
    under that key, nothing when b"")."""
    from mass_ops.runtime.episode import WorkspaceSeed, workspace_seed_key
    from mass_ops.store.artifacts import write_tarball

    tree = Path(ctx.config.storage.artifact_url.removeprefix("file://")).parent / "seed-tree"
    for name, data in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(data)
    buffer = io.BytesIO()
    write_tarball(tree, buffer)
    sha = hashlib.sha256(buffer.getvalue()).hexdigest()
    key = workspace_seed_key(ctx.cycle_name, sha)
    data = buffer.getvalue() if stored is None else stored
    if data:
        ctx.artifacts.put_bytes(key, data)
    return WorkspaceSeed(ctx.artifacts.uri(key), sha)


def seeding_publisher(ctx: CycleContext, root: Path, prompt: str, seed: Any) -> hand.HandoffPublisher:
    publisher = delivering_publisher(ctx, root, prompt)
    publisher.workspace_seed = seed
    return publisher


def test_the_publisher_delivers_the_seed_before_the_prompt_and_the_sandbox_runner_reads_it_there(
    tmp_path: Path,
) -> None:
    from mass_ops.runtime.runner import WorkspaceSeedError, extract_workspace_seed, fetch_workspace_seed

    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    seed = stored_seed(ctx, {"repo/calc.py": b"def add(a, b): return abs(a) + b\n", "data.csv": b"a,b\n"})
    prompt = "the prompt of the unit\n"
    thread, result = serve_in_thread(seeding_publisher(ctx, tmp_path / "handoff", prompt, seed))
    sandbox = hand.SandboxHandoff(tmp_path / "handoff")
    with sandbox:
        sandbox.await_prompt(tmp_path / "handoff" / hand.PROMPT_FILE)
        assert (tmp_path / "handoff" / hand.SEED_FILE).is_file()  # written before the prompt the sandbox waits for
        unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED)
        request = EpisodeRequest(unit=unit, condition=f"t{TASK}_bare", prompt=prompt, workspace_seed=seed)
        pod_ctx = sandbox.open(ctx.config, [request])
        # The sandbox reaches no store: its runner's fetch is answered from the hand-off folder, checked.
        workspace = tmp_path / "attempt" / "workspace"
        workspace.mkdir(parents=True)
        fetch_workspace_seed(pod_ctx.artifacts, seed, tmp_path / "attempt" / "seed.tar.gz")
        extract_workspace_seed(tmp_path / "attempt" / "seed.tar.gz", workspace, seed)
        assert (workspace / "repo" / "calc.py").read_bytes().startswith(b"def add")
        assert (workspace / "data.csv").read_bytes() == b"a,b\n"
        other = dataclasses_replace(seed, sha256="0" * 64)
        with pytest.raises(WorkspaceSeedError, match="does not exist"):
            fetch_workspace_seed(pod_ctx.artifacts, other, tmp_path / "attempt" / "other.tar.gz")
    thread.join(timeout=60)
    assert result == {"code": 0}


def dataclasses_replace(seed: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(seed, **changes)


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("missing", "does not exist"),
        ("other bytes", "does not hold the seed of SHA-256"),
        ("another uri", "is not the workspace seed of cycle episode-test with SHA-256"),
    ],
)
def test_a_seed_the_publisher_cannot_vouch_for_stops_the_pod_before_its_prompt(
    tmp_path: Path, scenario: str, message: str
) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    files = {"a.txt": b"a"}
    seed = {
        "missing": lambda: stored_seed(ctx, files, stored=b""),
        "other bytes": lambda: stored_seed(ctx, files, stored=b"not the archive the stage stored"),
        "another uri": lambda: dataclasses_replace(stored_seed(ctx, files), uri=ctx.artifacts.uri("cycles/x.tar.gz")),
    }[scenario]()
    thread, result = serve_in_thread(seeding_publisher(ctx, tmp_path / "handoff", "the prompt", seed))
    sandbox = hand.SandboxHandoff(tmp_path / "handoff")
    with pytest.raises(hand.HandoffError) as caught, sandbox:
        sandbox.await_prompt(tmp_path / "handoff" / hand.PROMPT_FILE)
    thread.join(timeout=60)
    assert isinstance(result.get("error"), hand.SeedDeliveryError) and message in str(result["error"])
    assert "the publisher gave up" in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "handoff" / hand.PROMPT_FILE).exists()
    assert not (tmp_path / "handoff" / hand.SEED_FILE).exists()


def test_a_request_announcing_another_seed_than_the_delivered_one_is_refused(tmp_path: Path) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    seed = stored_seed(ctx, {"a.txt": b"a"})
    thread, result = serve_in_thread(seeding_publisher(ctx, tmp_path / "handoff", "the prompt", seed))
    ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt").announce_only()  # announces no seed
    thread.join(timeout=60)
    error = result.get("error")
    assert isinstance(error, hand.IncompleteHandoffError), result
    assert "announces reference-t51-s450051 with workspace seed none" in str(error)
    assert not (tmp_path / "handoff" / hand.LEDGER_FILE).exists()


def test_the_cost_of_a_log_skips_a_line_nested_past_the_parser_s_stack(tmp_path: Path) -> None:
    """A record the proxy wrote around an agent's deeply nested request cannot break the spend account."""
    path = tmp_path / "api.jsonl.gz"
    lines = [
        json.dumps({"seq": 1, "response": {"usage": {"cost": 0.25}}}),
        "[" * 100_000 + "]" * 100_000,
        json.dumps({"seq": 3, "response": {"usage": {"cost": 0.5}}}),
    ]
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    assert hand.api_log_cost(path) == 0.75
