"""The API key never lands in an artifact, a log line or a database row — even when the agent tries to print it.

The agent never holds the key (its proxy adds it upstream), so what it can print is its per-episode token. The runs:
real qwen-code whose scripted model makes it `printenv` the key into a file and into its transcript, and the light
stand-in agent writing its credential into its workspace and its answer (its first request hits a 503, so an
infrastructure failure and its retry are published too). Then everything the test run produced is scanned:
every artifact (gzip and tar members opened), the scratch folder, every row of every table, every log record.
"""

from __future__ import annotations

import gzip
import io
import logging
import tarfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from mass_ops.runtime.pool import EpisodePool
from mass_ops.runtime.qwen_install import QwenInstall
from tests.policy_server import ChatRequest, FaultRule, PolicyReply, RequestKind, ResearchTeamPolicy, ToolCall
from tests.support.runtime import API_KEY, KEY_VAR, PolicyHost, open_episode_cycle, request, runner_environ


class CarelessPolicy(ResearchTeamPolicy):
    """An orchestrator that dumps its API key to a file and to its output, then stops."""

    def respond(self, request: ChatRequest) -> PolicyReply:
        if request.kind is not RequestKind.ORCHESTRATOR:
            return super().respond(request)
        if request.tool_results == 0:
            command = f"printenv {KEY_VAR} > leaked.txt && printenv {KEY_VAR} && echo key=${KEY_VAR}"
            return PolicyReply(
                content="Let me check my credentials.",
                tool_calls=(ToolCall("run_shell_command", {"command": command, "description": "Show the key"}),),
            )
        return PolicyReply(content="Done: leaked.txt written.")


def _contents(data: bytes, name: str) -> list[tuple[str, bytes]]:
    """The bytes of an artifact and of everything inside it (gzip streams, tar members)."""
    found = [(name, data)]
    if name.endswith(".gz"):
        inner = gzip.decompress(data)
        found.append((f"{name}!gunzip", inner))
        if name.endswith(".tar.gz"):
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                for member in tar.getmembers():
                    if member.isfile():
                        extracted = tar.extractfile(member)
                        assert extracted is not None
                        found.append((f"{name}!{member.name}", extracted.read()))
    return found


@pytest.mark.slow
def test_the_key_is_nowhere(
    policy_host: PolicyHost,
    tmp_path: Path,
    qwen_install: QwenInstall,
    stand_in_install: QwenInstall,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    scratch = tmp_path / "scratch"
    with policy_host.serve(CarelessPolicy(), faults=[FaultRule.parse("http_503:requests=1")]) as server:
        ctx = open_episode_cycle(tmp_path / "cycle", f"{server.base_url}/v1")
        options = {"environ": runner_environ(), "scratch_dir": scratch, "retry_backoff_s": 0}
        # The light agent goes first and meets the 503 (request 1): an infrastructure failure, then its retry.
        with EpisodePool(ctx, install=stand_in_install, **options) as pool:
            [light] = pool.run([request(ctx, "@agent requests=1 leak=1", seed=4)])
        with EpisodePool(ctx, install=qwen_install, **options) as pool:
            [real] = pool.run([request(ctx, "Check your environment, then stop.", seed=3)])

    # The runs did what the scan must cover: a retried infrastructure failure, and leaks that were caught.
    assert (light.status, light.attempt) == ("succeeded", 2) and real.status == "succeeded"
    statuses = sorted(row.status for row in ctx.repo.episodes(ctx.cycle_id))
    assert statuses == ["infra_failure", "succeeded", "succeeded"]
    # The agent never held the key (ISSUE #13.4): `printenv` finds no such variable, so nothing needed redacting.
    workspace = tmp_path / "ws"
    EpisodePool(ctx, install=stand_in_install).workspace(real, workspace)
    assert (workspace / "leaked.txt").read_text() == ""
    stream = ctx.artifacts.get_bytes("cycles/episode-test/episodes/reference-t51-s3/a1/stream.jsonl").decode()
    assert "printenv" in stream and "[REDACTED]" not in stream
    light_workspace = tmp_path / "light-ws"
    EpisodePool(ctx, install=stand_in_install).workspace(light, light_workspace)
    leaked = (light_workspace / "leak.txt").read_text()  # what the careless agent used as its key: the token
    assert leaked.startswith("the key is ") and "[REDACTED]" not in leaked

    secret = API_KEY.encode()
    scanned = 0
    artifact_root = Path(ctx.artifacts.url.removeprefix("file://"))
    for path in sorted(p for p in artifact_root.rglob("*") if p.is_file()):
        for name, data in _contents(path.read_bytes(), str(path.relative_to(artifact_root))):
            scanned += 1
            assert secret not in data, f"API key found in artifact {name}"
    assert scanned > 30
    for path in (p for p in scratch.rglob("*") if p.is_file()):
        assert secret not in path.read_bytes(), f"API key found in scratch file {path}"

    engine = sa.create_engine(ctx.config.storage.metadata_url)
    with engine.connect() as connection:
        tables = sa.inspect(connection).get_table_names()
        rows = 0
        for table in tables:
            for row in connection.execute(sa.text(f'SELECT * FROM "{table}"')):
                rows += 1
                assert API_KEY not in repr(tuple(row)), f"API key found in table {table}"
    engine.dispose()
    assert rows > 3
    db_file = Path(ctx.config.storage.metadata_url.removeprefix("sqlite:///"))
    for path in db_file.parent.glob(db_file.name + "*"):  # the database and its WAL
        assert secret not in path.read_bytes()

    assert caplog.records and API_KEY not in caplog.text
    assert not any(API_KEY in repr(record.__dict__) for record in caplog.records)
