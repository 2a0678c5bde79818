"""Containment in a pod (ISSUE #25.4-6): the agent against the pod's proxy control, the publisher and the records.

The sandbox side is the agent's to write, swap or delete; what is published, counted and charged stays the proxy's
and the publisher's own.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest

from mass_ops.layout import EPISODE_FILES, EpisodeUnit
from mass_ops.runtime import handoff as hand
from mass_ops.runtime.handoff import publisher as publisher_module
from mass_ops.runtime.outcome import UsageTotals
from mass_ops.runtime.qwen_install import QwenInstall
from tests.runtime.hostile_agent import hostile_findings
from tests.support.handoff import SEED, ScriptedSandbox, finished_publication, proxied_pod, serve_in_thread
from tests.support.runtime import API_KEY, TASK, PolicyHost, open_episode_cycle


def test_a_hostile_agent_in_a_pod_reaches_no_proxy_control_and_the_records_stay_the_proxy_s(
    policy_host: PolicyHost, tmp_path: Path, hostile_install: QwenInstall
) -> None:
    """The agent, in the sandbox with the runner, tries every door to the proxy's control: the control routes on its
    TCP listener (open a session elsewhere, close and discard the runner's, health), sessions through the hand-off
    (its next attempt, a second one for this attempt, another unit), and it forges the runner's close answer and log
    copy with fabricated records and no tokens. Every door is shut, and the row and the published log are the
    proxy's own: four requests, the server's tokens."""
    from tests.runtime.pod import run_pod
    from tests.support.runtime import MODEL, hostile_prompt, request

    handoff = tmp_path / "pod" / "handoff"
    slug = EpisodeUnit("episode-test", TASK, "reference", 7).slug
    attack = f"""
        import json, pathlib, time
        sessions = pathlib.Path({str(handoff)!r}) / "sessions"
        root = base_url.rsplit("/v1", 1)[0]
        auth = {{"Authorization": "Bearer " + token}}
        chat = {{"model": {MODEL!r}, "messages": [{{"role": "user", "content": "hello"}}]}}
        real = [http("POST", base_url + "/chat/completions", chat, auth)[0] for _ in range(4)]
        control = {{}}
        for name, method, path, body in [
            ("open_elsewhere", "POST", "/_mass_proxy/sessions", {{"upstream": "http://attacker.example"}}),
            ("close_and_discard", "POST", "/_mass_proxy/sessions/x/close", {{"discard": True}}),
            ("health", "GET", "/_mass_proxy/health", None),
        ]:
            control[name] = [http(method, root + path, body, headers)[0] for headers in ({{}}, auth)]
        asks = {{"next_attempt": "{slug}-a2-t1", "second_session": "{slug}-a1-t9"}}
        asks["other_unit"] = "reference-t9-s1-a1-t1"
        for name in asks.values():
            (sessions / (name + ".open")).write_text('{{"upstream": "http://attacker.example"}}')
        answers = {{}}
        deadline = time.monotonic() + 60
        for ask, name in asks.items():
            answer = sessions / (name + ".session.json")
            while not answer.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            answers[ask] = json.loads(answer.read_text())
        usage = {{"prompt_tokens": 0, "completion_tokens": 0}}
        fake = {{"seq": 99, "path": "/v1/chat/completions", "status": 200, "response": {{"usage": usage}}}}
        (sessions / "{slug}-a1-t1.log").write_text(json.dumps(fake) + "\\n")
        (sessions / "{slug}-a1-t1.closed.json").write_text(json.dumps({{"records": 1, "usage": {{"requests": 1}}}}))
        report(real=real, control=control, answers=answers)
    """
    with policy_host.serve(require_key=API_KEY) as server:
        ctx = open_episode_cycle(tmp_path / "cycle", f"{server.base_url}/v1")
        pod = run_pod(
            policy_host,
            ctx,
            [request(ctx, hostile_prompt(attack))],
            install=hostile_install,
            upstream=server.base_url,
            tmp=tmp_path / "pod",
        )
        served = server.stats.chat_requests
    assert pod.sandbox_error is None and pod.publisher == {"code": 0}, (pod.sandbox_error, pod.publisher)
    assert [outcome.attempt for outcome in pod.outcomes] == [1]
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", 7, attempt=1)
    stream = ctx.artifacts.get_bytes(unit.artifact_key("stream")).decode()
    [found] = hostile_findings(stream)
    assert found["real"] == [200] * 4 and served == 4
    assert found["control"] == {door: [404, 404] for door in ("open_elsewhere", "close_and_discard", "health")}
    for ask, why in (
        ("next_attempt", "attempt 2 is not the next attempt"),
        ("second_session", "attempt 1 of " + slug + " already has its session"),
        ("other_unit", "is not a unit this pod announced"),
    ):
        answer = found["answers"][ask]
        assert answer["token"] is None and why in answer["error"], (ask, answer)
    # One session was opened for the attempt (the preflight's was discarded), and its log is what was published.
    [session_log] = pod.session_logs
    proxy_records = [json.loads(line) for line in session_log.read_text().splitlines()]
    published = gzip.decompress(ctx.artifacts.get_bytes(unit.artifact_key("api_log"))).decode()
    assert published == session_log.read_text() and len(proxy_records) == 4
    truth = UsageTotals.from_records(proxy_records)
    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (4, truth.prompt_tokens, truth.completion_tokens)
    assert truth.prompt_tokens > 0 and truth.completion_tokens > 0
    status = json.loads(ctx.artifacts.get_bytes(unit.artifact_key("status")))
    assert status["usage"] == truth.as_dict() and status["hiw"]["api_requests"] == 4


def test_a_pod_s_row_and_published_log_are_the_proxy_s_whatever_the_sandbox_hands_over(
    policy_host: PolicyHost, tmp_path: Path
) -> None:
    """ISSUE #25.6: a sandbox that used its session for three requests, then handed over a record of none and a log
    of fabricated records (the agent shares its container): the row's counts, the status document's usage and the
    published log are what the proxy counted and wrote."""
    from tests.runtime.hostile_agent import http
    from tests.support.runtime import MODEL

    with (
        policy_host.serve(require_key=API_KEY) as server,
        proxied_pod(policy_host, tmp_path, upstream=server.base_url, endpoint=f"{server.base_url}/v1") as pod,
    ):
        sandbox = pod.sandbox
        assert sandbox.announce().proxy_sessions
        grant = pod.open_session()
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
        auth = {"Authorization": f"Bearer {grant.token}"}
        statuses = [http("POST", f"{grant.proxy_url}/v1/chat/completions", chat, auth)[0] for _ in range(3)]
        folder = sandbox.attempt(1, finished=False)
        fake = {"seq": 1, "path": "/v1/chat/completions", "status": 200, "response": {"usage": {"prompt_tokens": 1}}}
        (folder / EPISODE_FILES["api_log"]).write_bytes(gzip.compress((json.dumps(fake) + "\n").encode()))
        finished_publication(folder, 1)  # a record of one request, one prompt and one completion token
        os.rename(folder, sandbox.handoff.attempt_dir(sandbox.slug, 1))
        sandbox.complete()
        pod.thread.join(timeout=60)
    ctx = pod.ctx
    assert pod.result == {"code": 0} and statuses == [200] * 3
    [session_log] = pod.session_logs
    truth = UsageTotals.from_records(json.loads(line) for line in session_log.read_text().splitlines())
    [row] = ctx.repo.episodes(ctx.cycle_id)
    counts = (row.requests, row.prompt_tokens, row.completion_tokens, row.max_prompt_tokens)
    assert counts == (3, truth.prompt_tokens, truth.completion_tokens, truth.max_prompt_tokens)
    assert truth.requests == 3 and truth.completion_tokens > 1
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED, attempt=1)
    assert gzip.decompress(ctx.artifacts.get_bytes(unit.artifact_key("api_log"))) == session_log.read_bytes()
    assert json.loads(ctx.artifacts.get_bytes(unit.artifact_key("status")))["usage"] == truth.as_dict()
    # Charged once, by its row (the session's own charge is only for an attempt that has none).
    from mass_ops.store.budgets import task_scope

    [spend] = ctx.repo.budget_spend(ctx.cycle_id, [task_scope(TASK)]).values()
    assert (spend.tokens, spend.requests) == (truth.prompt_tokens + truth.completion_tokens, 3)


def _handed_over(sandbox: ScriptedSandbox, contents: dict[str, bytes]) -> Path:
    """Attempt 1 handed over whole (built under its temporary name, then renamed), each file with `contents`."""
    folder = sandbox.attempt(1, finished=False)
    for name, data in contents.items():
        (folder / EPISODE_FILES[name]).write_bytes(data)
    finished_publication(folder, 1)
    final = sandbox.handoff.attempt_dir(EpisodeUnit(sandbox.config.cycle_name, TASK, "reference", SEED).slug, 1)
    os.rename(folder, final)
    return final


@pytest.mark.parametrize("swap", ["symlink to /proc/self/environ", "hard link to a file outside"])
def test_a_file_swapped_after_the_publisher_s_check_publishes_the_bytes_it_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    """ISSUE #25.5: the agent swaps attempt files for a link the moment the publisher has checked them (the publish
    step is where the old publisher re-opened them by name): the store gets the files that were checked."""
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    outside = tmp_path / "publisher-secret.txt"
    outside.write_text("AWS_SECRET_ACCESS_KEY=wJalr-outside-71")
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    contents = {"workspace": b"the agent's workspace", "stream": b'{"type": "result"}\n'}
    real_publish = publisher_module.publish_episode

    def swapped_then_published(*args: Any, **kwargs: Any) -> Any:
        for name in contents:
            path = folder / EPISODE_FILES[name]
            path.unlink()
            if swap.startswith("symlink"):
                path.symlink_to("/proc/self/environ")
            else:
                os.link(outside, path)
        return real_publish(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "publish_episode", swapped_then_published)
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    folder = _handed_over(sandbox, contents)
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 0}, result
    unit = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED, attempt=1)
    for name, data in contents.items():
        assert ctx.artifacts.get_bytes(unit.artifact_key(name)) == data


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_an_attempt_file_linked_to_a_file_outside_is_refused_and_nothing_is_published(
    tmp_path: Path, link: str
) -> None:
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    outside = tmp_path / "publisher-secret.txt"
    outside.write_text("AWS_SECRET_ACCESS_KEY=wJalr-outside-71")
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    folder = sandbox.attempt(1, finished=False)
    target = folder / EPISODE_FILES["stream"]
    target.unlink()
    if link == "symlink":
        target.symlink_to(outside)
    else:
        os.link(outside, target)
    finished_publication(folder, 1)
    os.rename(folder, sandbox.handoff.attempt_dir(EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED).slug, 1))
    sandbox.complete()
    thread.join(timeout=60)
    error = result.get("error")
    assert isinstance(error, hand.IncompleteHandoffError), result
    assert "stream.jsonl is missing or not a regular file of its own" in str(error)
    assert ctx.repo.episodes(ctx.cycle_id) == [] and ctx.artifacts.list("cycles/") == []


def test_the_publisher_writes_through_no_link_the_sandbox_planted(tmp_path: Path) -> None:
    """The sandbox plants a link at the temporary name of the ack the publisher will write (and the sessions/ folder
    as a link): the publisher's writes land in the hand-off folder and nowhere else."""
    ctx = open_episode_cycle(tmp_path, "http://127.0.0.1:9/v1", artifact_url=str(tmp_path / "artifacts"))
    outside = tmp_path / "publisher-file.txt"
    outside.write_text("the publisher's own")
    sandbox = ScriptedSandbox(tmp_path / "handoff", ctx.config, "the prompt")
    publisher = hand.HandoffPublisher(ctx.config, tmp_path / "handoff", attach=lambda _config: ctx)
    thread, result = serve_in_thread(publisher)
    sandbox.announce()
    slug = EpisodeUnit(ctx.cycle_name, TASK, "reference", SEED).slug
    (tmp_path / "handoff" / "acks").mkdir()
    (tmp_path / "handoff" / "acks" / f".{slug}-a1.json.partial").symlink_to(outside)
    _handed_over(sandbox, {})
    sandbox.complete()
    thread.join(timeout=60)
    assert result == {"code": 0}, result
    assert outside.read_text() == "the publisher's own"
    assert sandbox.handoff.read(sandbox.handoff.ack_path(slug, 1), hand.Ack).episode_id is not None
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "handoff" / "sessions").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(hand.IncompleteHandoffError, match="sessions/ is a link or not a folder"):
        sandbox.handoff.write_bytes(sandbox.handoff.path("sessions") / "x.json", b"{}")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_the_publisher_checks_the_endpoint_before_it_opens_a_session_and_opens_none_when_it_fails(
    policy_host: PolicyHost, tmp_path: Path
) -> None:
    """The preflight is the publisher's: an endpoint that does not answer is a transient refusal (the runner waits
    and asks again), and no session is left for the attempt, whose next ask can still have one."""
    with proxied_pod(policy_host, tmp_path, upstream="http://127.0.0.1:9", endpoint="http://127.0.0.1:9/v1") as pod:
        pod.sandbox.announce()
        grants = [pod.open_session(attempt_try=n) for n in (1, 2)]
        pod.sandbox.complete()
        pod.thread.join(timeout=60)
    assert pod.result == {"code": 0}
    for grant in grants:
        assert grant.token is None and grant.transient, grant
        # through the pod's proxy, which answers 502 for an upstream that does not
        assert grant.error and grant.error.startswith("episode preflight: GET http://127.0.0.1:"), grant.error
        assert grant.error.endswith("/v1/models answered HTTP 502")
    assert [path.name for path in (pod.proxy_dir / "sessions").iterdir()] == ["rejected.jsonl"]


def test_a_session_whose_attempt_is_never_handed_over_is_charged_to_the_budgets_all_the_same(
    policy_host: PolicyHost, tmp_path: Path
) -> None:
    """The agent spends through its session, then stops its runner before the hand-over (no attempt, no row): the
    publisher charges what the proxy counted to the task and the cycle, once."""
    from mass_ops.store.budgets import CYCLE_SCOPE, task_scope
    from tests.runtime.hostile_agent import http
    from tests.support.runtime import MODEL

    with (
        policy_host.serve(require_key=API_KEY) as server,
        proxied_pod(policy_host, tmp_path, upstream=server.base_url, endpoint=f"{server.base_url}/v1") as pod,
    ):
        pod.sandbox.announce()
        grant = pod.open_session()
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
        auth = {"Authorization": f"Bearer {grant.token}"}
        for _ in range(2):
            assert http("POST", f"{grant.proxy_url}/v1/chat/completions", chat, auth)[0] == 200
        pod.sandbox.complete(code=137)  # the runner was killed: nothing handed over
        pod.thread.join(timeout=60)
    ctx = pod.ctx
    assert pod.result == {"code": 0} and ctx.repo.episodes(ctx.cycle_id) == []
    [session_log] = pod.session_logs
    truth = UsageTotals.from_records(json.loads(line) for line in session_log.read_text().splitlines())
    spend = ctx.repo.budget_spend(ctx.cycle_id, [task_scope(TASK), CYCLE_SCOPE])
    assert truth.requests == 2 and truth.prompt_tokens + truth.completion_tokens > 0
    for scope in (task_scope(TASK), CYCLE_SCOPE):
        assert (spend[scope].tokens, spend[scope].requests) == (truth.prompt_tokens + truth.completion_tokens, 2)
