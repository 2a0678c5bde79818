"""Golden tests: a realistic teacher episode rendered end to end with the real Qwen3 tokenizer."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from mass_ops.render import (
    IGNORE_INDEX,
    EpisodeSource,
    RenderError,
    RenderOptions,
    TrainingWindow,
    dataset_stats,
    ensure_every_episode_has_windows,
    iter_episode_renders,
    render_dataset,
    render_episode,
)
from tests.render.proxy_logs import ORCHESTRATOR_SYSTEM, ORCHESTRATOR_TOOLS, Agent, Call, ProxyLog, Reply, tool_output
from tests.render.scenarios import (
    BARE_PROMPT,
    DIRECTIVE,
    TEACHER_PROMPT,
    TeacherEpisode,
    build_teacher_episode,
    expected_label_text,
    sent_form,
)

WINDOW = 4096
OVERLAP = 1024


def source(
    log: ProxyLog | bytes | list[Any],
    *,
    episode: str = "t202_L0_s710000",
    success: bool = True,
    teacher: str | None = TEACHER_PROMPT,
    bare: str | None = BARE_PROMPT,
) -> EpisodeSource:
    records = log.records if isinstance(log, ProxyLog) else log
    return EpisodeSource(
        episode=episode,
        task=202,
        condition="t202_L0",
        seed=710000,
        success=success,
        log_records=records,
        teacher_prompt=teacher,
        bare_prompt=bare,
        weight=1.0,
    )


@pytest.fixture(scope="module")
def teacher_episode() -> TeacherEpisode:
    return build_teacher_episode()


@pytest.fixture(scope="module")
def rendered(teacher_episode: TeacherEpisode, qwen3_tokenizer: Any):
    return render_episode(source(teacher_episode.log), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP)


def by_thread(windows: list[TrainingWindow]) -> dict[str, list[TrainingWindow]]:
    grouped: dict[str, list[TrainingWindow]] = defaultdict(list)
    for window in windows:
        grouped[window.thread].append(window)
    return grouped


def labelled_runs(window: TrainingWindow, tokenizer: Any) -> list[str]:
    """Decoded maximal runs of trained positions, in order."""
    runs: list[list[int]] = []
    previous_trained = False
    for token, label in zip(window.input_ids, window.labels, strict=True):
        trained = label != IGNORE_INDEX
        if trained:
            if not previous_trained:
                runs.append([])
            runs[-1].append(token)
        previous_trained = trained
    return [tokenizer.decode(run) for run in runs]


def test_threads_roles_and_conversations_match_the_episode(rendered, teacher_episode):
    threads = rendered.stats["threads"]
    assert rendered.errors == []
    assert len(threads) == len(teacher_episode.threads)
    for info, expected in zip(threads, teacher_episode.threads, strict=True):
        assert info["error"] is None
        assert info["role"] == expected.role
        assert info["is_main"] == expected.is_main
        assert info["match_mode"] == ("at_path" if expected.is_main else None)
        assert info["final_truncated"] == expected.final_truncated
        assert info["n_segments"] == expected.segments
    main_keys = {info["thread"].split(".")[0] for info in threads if info["is_main"]}
    # The history rewrite split the orchestrator's thread into two conversations of one key.
    assert len(main_keys) == 1
    key = main_keys.pop()
    assert sorted(info["thread"] for info in threads if info["is_main"]) == [f"{key}.0", f"{key}.1"]


def test_every_assistant_reply_is_trained_exactly_once_per_conversation(rendered, teacher_episode, qwen3_tokenizer):
    grouped = by_thread(rendered.windows)
    for info, expected in zip(rendered.stats["threads"], teacher_episode.threads, strict=True):
        windows = sorted(grouped[info["thread"]], key=lambda w: (w.segment, w.window))
        runs = [run for window in windows for run in labelled_runs(window, qwen3_tokenizer)]
        assert runs == [expected_label_text(reply, think=think) for reply, think in expected.trained]


def test_labels_are_input_ids_or_ignored_and_windows_fit(rendered):
    assert rendered.windows
    for window in rendered.windows:
        assert window.n_tokens == len(window.input_ids) == len(window.labels) <= WINDOW
        assert window.n_loss_tokens == sum(label != IGNORE_INDEX for label in window.labels) > 0
        assert all(label in (IGNORE_INDEX, token) for token, label in zip(window.input_ids, window.labels, strict=True))
        assert window.labels[: window.header_tokens] == [IGNORE_INDEX] * window.header_tokens


def test_system_user_and_tool_text_is_never_trained(rendered, teacher_episode, qwen3_tokenizer):
    for window in rendered.windows:
        for run in labelled_runs(window, qwen3_tokenizer):
            assert "<|im_start|>" not in run
            assert "<tool_response>" not in run
            assert "You are" not in run
            assert "Deliverables" not in run
            assert "epoch 00 step" not in run  # long tool output


def test_long_tool_outputs_force_several_windows_with_context(rendered, qwen3_tokenizer):
    worker_b = rendered.stats["threads"][2]
    assert worker_b["n_windows"] >= 2
    windows = [w for w in rendered.windows if w.thread == worker_b["thread"]]
    assert [w.window for w in windows] == list(range(len(windows)))
    assert all(w.n_windows == len(windows) for w in windows)
    # Body ranges never overlap and the trained blocks are disjoint across windows.
    trained = [block for w in windows for block in w.loss_blocks]
    assert len(trained) == len(set(trained))
    text = qwen3_tokenizer.decode(windows[-1].input_ids)
    assert text.startswith("<|im_start|>system\nYou are a general-purpose subagent")


def test_main_thread_learns_from_the_bare_prompt(rendered, qwen3_tokenizer):
    main = [w for w in rendered.windows if w.is_main]
    assert main and all(w.match_mode == "at_path" for w in main)
    for window in main:
        text = qwen3_tokenizer.decode(window.input_ids)
        assert sent_form(BARE_PROMPT) in text
        assert DIRECTIVE.splitlines()[0] not in text
        assert "Create an agent team" not in text
    others = [w for w in rendered.windows if not w.is_main]
    assert others and all(w.match_mode is None for w in others)


def test_window_records_carry_every_field(rendered):
    record = rendered.windows[0].as_record()
    assert set(record) == {
        "input_ids", "labels", "n_tokens", "n_loss_tokens", "blocks", "ctx_blocks", "loss_blocks", "header_tokens",
        "segment", "episode", "condition", "seed", "thread", "task", "is_main", "role", "match_mode", "window",
        "n_windows", "success", "weight",
    }  # fmt: skip
    assert record["episode"] == "t202_L0_s710000" and record["task"] == 202 and record["seed"] == 710000
    json.dumps(record)


def test_stats_count_truncation_empty_reasoning_and_tokens(rendered, teacher_episode):
    stats = rendered.stats
    assert stats["n_windows"] == len(rendered.windows)
    assert stats["loss_tokens"] == sum(w.n_loss_tokens for w in rendered.windows)
    assert stats["total_tokens"] == sum(w.n_tokens for w in rendered.windows)
    empty = sum(1 for t in teacher_episode.threads for reply, think in t.trained if think and not reply.reasoning)
    assert sum(t["empty_reasoning_turns"] for t in stats["threads"]) == empty == 2
    assert [t["n_requests"] for t in stats["threads"]] == [2, 2, 3, 1, 1]


def test_record_order_in_the_file_does_not_matter(teacher_episode, rendered, qwen3_tokenizer):
    shuffled = list(reversed(teacher_episode.log.records))
    again = render_episode(source(shuffled), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP)
    assert [w.input_ids for w in again.windows] == [w.input_ids for w in rendered.windows]


def test_gzipped_jsonl_gives_the_same_windows(teacher_episode, rendered, qwen3_tokenizer):
    again = render_episode(source(teacher_episode.log.gz()), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP)
    assert [w.labels for w in again.windows] == [w.labels for w in rendered.windows]


def test_strict_mode_accepts_a_clean_episode(teacher_episode, qwen3_tokenizer):
    result = render_episode(source(teacher_episode.log), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, strict=True)
    assert result.windows and result.errors == []


def ambiguous_log() -> ProxyLog:
    log = ProxyLog()
    twice = sent_form(TEACHER_PROMPT) + "\n\n(repeated)\n\n" + sent_form(TEACHER_PROMPT)
    Agent(log, ORCHESTRATOR_SYSTEM, twice, ORCHESTRATOR_TOOLS).turn(Reply(reasoning="Go.", content="Done."))
    return log


def test_ambiguous_double_match_is_an_error(qwen3_tokenizer):
    result = render_episode(source(ambiguous_log()), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP)
    assert result.windows == []
    assert any("occurs 2 times" in error and "t202_L0_s710000" in error for error in result.errors)
    with pytest.raises(RenderError, match="occurs 2 times"):
        render_episode(source(ambiguous_log()), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, strict=True)


def test_strict_mode_refuses_an_episode_without_main_thread(teacher_episode, qwen3_tokenizer):
    other_teacher = TEACHER_PROMPT.replace("protein-interface", "ligand-pocket")
    other = source(teacher_episode.log, teacher=other_teacher)
    lenient = render_episode(other, qwen3_tokenizer, window=WINDOW, overlap=OVERLAP)
    assert lenient.windows and not any(w.is_main for w in lenient.windows)
    assert any("no main thread" in error for error in lenient.errors)
    with pytest.raises(RenderError, match="no main thread"):
        render_episode(other, qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, strict=True)


def test_strict_mode_refuses_skipped_blocks(qwen3_tokenizer):
    log = ProxyLog()
    agent = Agent(log, ORCHESTRATOR_SYSTEM, TEACHER_PROMPT, ORCHESTRATOR_TOOLS)
    huge = {"file_path": "/work/ws/log.txt", "content": tool_output(3, 300)}
    agent.turn(Reply(reasoning="Dump the whole log.", calls=[Call("c1", "write_file", huge)]))
    agent.results(("c1", "written"))
    agent.turn(Reply(reasoning="Done.", content="Wrote the log."))
    lenient = render_episode(source(log), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP)
    (thread,) = lenient.stats["threads"]
    assert [entry["block"] for entry in thread["skipped"]] == [2]
    assert thread["skipped"][0]["n_tokens"] > WINDOW
    assert any("does not fit any window" in error for error in lenient.errors)
    # The reply after the oversize one is still trained, in its own window.
    assert [w.loss_blocks for w in lenient.windows] == [(4,)]
    with pytest.raises(RenderError, match="does not fit any window"):
        render_episode(source(log), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, strict=True)


def test_header_larger_than_the_window_share_is_a_thread_error(teacher_episode, qwen3_tokenizer):
    result = render_episode(source(teacher_episode.log), qwen3_tokenizer, window=300, overlap=32)
    errors = {info["role"]: info["error"] for info in result.stats["threads"]}
    assert "header" in errors["orchestrator"] and "header" in errors["worker"]
    # The title call has no tools: its header fits, so only that thread yields windows.
    assert errors["auxiliary"] is None
    assert {w.role for w in result.windows} == {"auxiliary"}
    assert all(w.n_tokens <= 300 for w in result.windows)


def test_truncated_final_reply_can_be_kept(teacher_episode, qwen3_tokenizer):
    kept = render_episode(
        source(teacher_episode.log), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, keep_truncated_final=True
    )
    worker_b = kept.stats["threads"][2]
    runs = [run for w in kept.windows if w.thread == worker_b["thread"] for run in labelled_runs(w, qwen3_tokenizer)]
    assert runs[-1].endswith("The evaluation shows<|im_end|>")


def test_require_success_skips_failed_episodes_and_the_stage_check_fails(teacher_episode, qwen3_tokenizer):
    ok = source(teacher_episode.log, episode="t202_L0_s710001")
    failed = source(teacher_episode.log, episode="t202_L0_s710002", success=False)
    windows, stats = render_dataset([ok, failed], qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, require_success=True)
    assert {w.episode for w in windows} == {"t202_L0_s710001"}
    assert stats["aggregate"]["episodes"] == 1 and stats["aggregate"]["episodes_skipped"] == 1
    assert stats["episodes"][1]["skip_reason"] == "not successful"
    with pytest.raises(RenderError, match="t202_L0_s710002"):
        ensure_every_episode_has_windows([ok.episode, failed.episode], (w.episode for w in windows))
    with pytest.raises(RenderError, match="produced no training window"):
        render_dataset(
            [ok, failed], qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, require_success=True, require_windows=True
        )


def test_dataset_aggregate_adds_up(teacher_episode, rendered, qwen3_tokenizer):
    episodes = [source(teacher_episode.log, episode=f"t202_L0_s71000{i}") for i in range(2)]
    windows, stats = render_dataset(episodes, qwen3_tokenizer, window=WINDOW, overlap=OVERLAP)
    aggregate = stats["aggregate"]
    assert aggregate["windows"] == len(windows) == 2 * len(rendered.windows)
    assert aggregate["threads"] == 2 * len(rendered.stats["threads"])
    assert aggregate["loss_tokens"] == 2 * rendered.stats["loss_tokens"]
    assert aggregate["empty_reasoning_turns"] == 4
    assert stats["args"]["window"] == WINDOW
    json.dumps(stats)
    with pytest.raises(RenderError, match="listed twice"):
        render_dataset([episodes[0], episodes[0]], qwen3_tokenizer, window=WINDOW, overlap=OVERLAP)


def test_without_substitution_the_teacher_prompt_stays(teacher_episode, qwen3_tokenizer):
    kept = render_episode(
        source(teacher_episode.log), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, substitute=False
    )
    main = [w for w in kept.windows if w.is_main]
    assert main and all("Create an agent team" in qwen3_tokenizer.decode(w.input_ids) for w in main)


def test_a_teacher_prompt_needs_its_bare_prompt(teacher_episode, qwen3_tokenizer):
    with pytest.raises(RenderError, match="without the bare prompt"):
        render_episode(source(teacher_episode.log, bare=None), qwen3_tokenizer)


def test_exact_match_replaces_the_prompt_verbatim(qwen3_tokenizer):
    log = ProxyLog()
    agent = Agent(log, ORCHESTRATOR_SYSTEM, TEACHER_PROMPT, ORCHESTRATOR_TOOLS)
    agent.turn(Reply(reasoning="Plan.", calls=[Call("c1", "run_shell_command", {"command": "ls"})]))
    agent.results(("c1", "README.md"))
    agent.turn(Reply(reasoning="", content="Done."))
    result = render_episode(source(log), qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, strict=True)
    assert [w.match_mode for w in result.windows] == ["exact"]
    assert BARE_PROMPT in qwen3_tokenizer.decode(result.windows[0].input_ids)


def test_streamed_renders_equal_the_dataset_render(teacher_episode, qwen3_tokenizer):
    episodes = [source(teacher_episode.log, episode=f"t202_L0_s72000{i}") for i in range(2)]
    options = RenderOptions(window=WINDOW, overlap=OVERLAP, strict=True)
    renders = list(iter_episode_renders(episodes, qwen3_tokenizer, options))
    windows, stats = render_dataset(episodes, qwen3_tokenizer, window=WINDOW, overlap=OVERLAP, strict=True)
    assert [w.as_record() for r in renders for w in r.windows] == [w.as_record() for w in windows]
    assert dataset_stats([r.stats for r in renders], options) == stats
    assert stats["args"]["strict"] is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window": 0}, "window must be positive"),
        ({"window": 100, "overlap": 100}, "overlap must be in"),
        ({"max_header_frac": 0.0}, "max_header_frac"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str):
    with pytest.raises(RenderError, match=message):
        RenderOptions(**options)
