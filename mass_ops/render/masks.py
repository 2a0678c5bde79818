"""Chat-template rendering of one conversation into token blocks with assistant-only loss masks (MASS_SPEC §7).

Messages are normalised as vLLM does before templating; the conversation is cut into one segment per user message,
each rendered by `apply_chat_template` exactly as the model saw it while generating that segment. The text is split
on `<|im_start|>` into blocks that must match the planned messages; tokenised one by one, they must concatenate
to the tokenisation of the whole text. Loss covers only the segment's assistant blocks, from after the generation
prefix through the last `<|im_end|>`; a trained turn rendered without that prefix is a `RenderError`, as in the
reference.
Normalisation, content parts and the loss span in depth: docs/render.md (`mass_ops.render.masks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mass_ops.render.errors import RenderError
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_PREFIX = "<|im_start|>assistant\n<think>\n"
PLAIN_PREFIX = "<|im_start|>assistant\n"
EMPTY_REASONING_PREFIX = "<|im_start|>assistant\n<think>\n\n</think>"
IGNORE_INDEX = -100

# Planned block kind → how its rendered text must begin.
_BLOCK_HEADS = {
    "system": "<|im_start|>system\n",
    "user": "<|im_start|>user\n",
    "assistant": PLAIN_PREFIX,
    "tool": "<|im_start|>user\n<tool_response>",
}


@dataclass(frozen=True)
class Block:
    """One `<|im_start|>` block of a segment: its kind, first message index, token ids and trained span.

    `loss_span` is the [start, end) token range trained in this segment, or None for a masked block.
    """

    kind: str
    message_index: int
    input_ids: list[int]
    loss_span: tuple[int, int] | None
    empty_reasoning: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def n_loss_tokens(self) -> int:
        return 0 if self.loss_span is None else self.loss_span[1] - self.loss_span[0]

    def labels(self) -> list[int]:
        """Labels aligned with `input_ids`: token ids inside the loss span, IGNORE_INDEX elsewhere."""
        if self.loss_span is None:
            return [IGNORE_INDEX] * len(self.input_ids)
        start, end = self.loss_span
        n = len(self.input_ids)
        return [IGNORE_INDEX] * start + self.input_ids[start:end] + [IGNORE_INDEX] * (n - end)


@dataclass(frozen=True)
class Segment:
    """The blocks rendered for one user turn; `query_block` is the index of that user message's block."""

    index: int
    query_block: int
    blocks: list[Block]

    @property
    def n_tokens(self) -> int:
        return sum(block.n_tokens for block in self.blocks)

    @property
    def n_loss_tokens(self) -> int:
        return sum(block.n_loss_tokens for block in self.blocks)


@dataclass(frozen=True)
class _Tokenized:
    ids: list[int]
    # For assistant-looking blocks: [start, end) of the trainable span and whether the reasoning is empty.
    span: tuple[int, int] | None
    empty_reasoning: bool


STRING_FORMAT_SEPARATOR = "\n"
# Probe texts for `content_part_separator`: plain words no template rewrites.
_PROBE_PARTS = ("mass-ops-probe-part-one", "mass-ops-probe-part-two")


def vllm_messages(
    messages: Sequence[dict[str, Any]],
    *,
    where: str = "conversation",
    part_separator: str = STRING_FORMAT_SEPARATOR,
) -> list[dict[str, Any]]:
    """Copies of `messages` as vLLM hands them to the chat template.

    Content lists become their text parts joined by `part_separator` (what the template in use puts between parts:
    `ChatRenderer.part_separator`), null content becomes "", and tool-call arguments given as JSON strings become
    objects (an empty string becomes {}; a string that is not JSON is kept verbatim, which the template then emits
    as-is).
    """
    normalised = []
    for position, message in enumerate(messages):
        out = dict(message)
        out["content"] = _content_text(message.get("content"), f"{where} message {position}", part_separator)
        calls = message.get("tool_calls")
        if calls:
            out["tool_calls"] = [_parsed_call(call) for call in calls]
        normalised.append(out)
    return normalised


def _content_text(content: Any, where: str, separator: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RenderError(f"{where}: content part of type {kind!r} is not text; only text can be rendered")
        return separator.join(texts)
    raise RenderError(f"{where}: content is a {type(content).__name__}, not a string or a list of parts")


def content_part_separator(tokenizer: Any) -> str:
    """What the tokenizer's chat template puts between the text parts of a list content: rendered on a probe
    conversation. A template that cannot render a list (it concatenates `message.content` as a string) gets "\\n",
    which is how vLLM flattens parts for such templates before rendering."""
    probe = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": text} for text in _PROBE_PARTS]},
    ]
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False)
    except Exception:  # any template error on a list means: the template takes strings only
        return STRING_FORMAT_SEPARATOR
    if not isinstance(text, str):
        return STRING_FORMAT_SEPARATOR
    first, second = text.find(_PROBE_PARTS[0]), text.find(_PROBE_PARTS[1])
    if first < 0 or second < first:
        return STRING_FORMAT_SEPARATOR
    return text[first + len(_PROBE_PARTS[0]) : second]


def _parsed_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        if not arguments.strip():
            function["arguments"] = {}
        else:
            # Text that is not JSON (or nests past the depth limit) stays verbatim: it is what the model generated.
            with contextlib.suppress(UntrustedInputError):
                function["arguments"] = loads_untrusted(arguments, what="tool-call arguments")
    return {**call, "function": function}


def plan_blocks(messages: Sequence[dict[str, Any]], *, where: str = "conversation") -> list[tuple[str, int]]:
    """(kind, first message index) per expected `<|im_start|>` block; consecutive tool messages share one block."""
    plan: list[tuple[str, int]] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            if index > 0 and messages[index - 1].get("role") == "tool":
                continue
            plan.append(("tool", index))
        elif role in ("system", "user", "assistant"):
            plan.append((role, index))
        else:
            raise RenderError(f"{where}: message {index} has unsupported role {role!r}")
    return plan


@dataclass(frozen=True)
class _Prepared:
    """A conversation after templating and splitting, waiting for tokenisation."""

    where: str
    users: list[int]
    texts: list[str]
    plans: list[list[tuple[str, int]]]
    pieces: list[list[str]]


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template.

    Block tokenisations are cached by text (a block recurs in every later segment of its conversation), and the
    texts of many conversations are tokenised in shared batches so the tokenizer's threads stay busy.
    """

    # Characters per tokenizer batch: bounds the memory of the encodings alive at once (~1 M tokens).
    batch_chars = 4_000_000

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise RenderError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer (no offsets available)")
        self._tokenizer = tokenizer
        self._backend = backend
        self._im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        if not isinstance(self._im_end_id, int) or self._im_end_id < 0:
            raise RenderError(f"tokenizer {type(tokenizer).__name__} has no {IM_END} token")
        self._cache: dict[str, _Tokenized] = {}
        self.part_separator = content_part_separator(tokenizer)
        """How this template joins list content (pass it to `vllm_messages`)."""

    def clear_cache(self) -> None:
        """Forget cached block tokenisations (blocks repeat only within an episode)."""
        self._cache.clear()

    def segments(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *, where: str
    ) -> list[Segment]:
        """Render vLLM-normalised `messages` into one `Segment` per user message; `RenderError` on any mismatch."""
        (result,) = self.render_many([(messages, tools, where)])
        if isinstance(result, RenderError):
            raise result
        return result

    def render_many(
        self, conversations: Sequence[tuple[Sequence[dict[str, Any]], list[dict[str, Any]] | None, str]]
    ) -> list[list[Segment] | RenderError]:
        """`segments` for many (messages, tools, where) at once; a failing conversation yields its `RenderError`
        in its place without affecting the others."""
        prepared: list[_Prepared | RenderError] = []
        for messages, tools, where in conversations:
            try:
                prepared.append(self._prepare(messages, tools, where))
            except RenderError as exc:
                prepared.append(exc)
        ready = [item for item in prepared if isinstance(item, _Prepared)]
        self._tokenize_blocks([piece for item in ready for pieces in item.pieces for piece in pieces])
        wholes = iter(self._encode_ids([text for item in ready for text in item.texts]))
        results: list[list[Segment] | RenderError] = []
        for item in prepared:
            if isinstance(item, RenderError):
                results.append(item)
                continue
            whole_ids = [next(wholes) for _ in item.texts]
            try:
                results.append(self._assemble(item, whole_ids))
            except RenderError as exc:
                results.append(exc)
        return results

    def _prepare(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, where: str) -> _Prepared:
        if len(messages) < 2 or messages[0].get("role") != "system" or messages[1].get("role") != "user":
            roles = [message.get("role") for message in messages[:2]]
            raise RenderError(f"{where}: conversation must start with system, user messages (starts with {roles})")
        users = [index for index, message in enumerate(messages) if message.get("role") == "user"]
        ends = [*users[1:], len(messages)]
        texts = [self._template(messages[:end], tools, where) for end in ends]
        plans, pieces = [], []
        for end, text in zip(ends, texts, strict=True):
            plan, piece_texts = self._split(messages[:end], text, where)
            plans.append(plan)
            pieces.append(piece_texts)
        return _Prepared(where=where, users=users, texts=texts, plans=plans, pieces=pieces)

    def _assemble(self, item: _Prepared, whole_ids: list[list[int]]) -> list[Segment]:
        result = []
        for number, (user_index, plan, piece_texts, whole) in enumerate(
            zip(item.users, item.plans, item.pieces, whole_ids, strict=True)
        ):
            blocks = []
            query_block = -1
            concatenated: list[int] = []
            for block_number, ((kind, message_index), text) in enumerate(zip(plan, piece_texts, strict=True)):
                tokenized = self._cache[text]
                concatenated.extend(tokenized.ids)
                trained = kind == "assistant" and message_index >= user_index
                if trained and not text.startswith(THINK_PREFIX):
                    raise RenderError(
                        f"{item.where}: assistant message {message_index} (segment {number}) renders without the "
                        f"generation prefix {THINK_PREFIX!r}: the template dropped its think block, so the tokens "
                        "are not what the model generated"
                    )
                if trained and tokenized.span is None:
                    raise RenderError(f"{item.where}: assistant block {text[:60]!r} has no {IM_END} after its prefix")
                if message_index == user_index:
                    query_block = block_number
                blocks.append(
                    Block(
                        kind=kind,
                        message_index=message_index,
                        input_ids=tokenized.ids,
                        loss_span=tokenized.span if trained else None,
                        empty_reasoning=trained and tokenized.empty_reasoning,
                    )
                )
            if whole != concatenated:
                raise RenderError(
                    f"{item.where}: segment {number} block-wise tokenisation differs from whole-text tokenisation "
                    f"({len(concatenated)} vs {len(whole)} tokens)"
                )
            result.append(Segment(index=number, query_block=query_block, blocks=blocks))
        return result

    def _template(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, where: str) -> str:
        try:
            text = self._tokenizer.apply_chat_template(
                list(messages),
                tools=tools or None,
                add_generation_prompt=False,
                tokenize=False,
                enable_thinking=True,
            )
        except Exception as exc:  # jinja errors surface as many types; name the conversation, keep one line
            raise RenderError(f"{where}: chat template failed ({type(exc).__name__}: {exc})") from exc
        if not isinstance(text, str):
            raise RenderError(f"{where}: chat template returned {type(text).__name__}, not text")
        return text

    def _split(
        self, messages: Sequence[dict[str, Any]], text: str, where: str
    ) -> tuple[list[tuple[str, int]], list[str]]:
        plan = plan_blocks(messages, where=where)
        if not text.startswith(IM_START):
            raise RenderError(f"{where}: rendered text does not start with {IM_START}")
        piece_texts = [IM_START + piece for piece in text.split(IM_START)[1:]]
        if len(piece_texts) != len(plan):
            raise RenderError(
                f"{where}: template produced {len(piece_texts)} blocks for {len(plan)} planned messages "
                f"(a message may contain {IM_START})"
            )
        for (kind, index), piece in zip(plan, piece_texts, strict=True):
            if not piece.startswith(_BLOCK_HEADS[kind]):
                raise RenderError(f"{where}: block for message {index} ({kind}) renders as {piece[:40]!r}")
        return plan, piece_texts

    def _batches(self, texts: list[str]) -> Iterator[list[str]]:
        batch: list[str] = []
        size = 0
        for text in texts:
            if batch and size + len(text) > self.batch_chars:
                yield batch
                batch, size = [], 0
            batch.append(text)
            size += len(text)
        if batch:
            yield batch

    def _encode_ids(self, texts: list[str]) -> list[list[int]]:
        # Token ids only: the tokenizer skips computing character offsets, about twice as fast.
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        ids: list[list[int]] = []
        for batch in self._batches(texts):
            ids.extend(encoding.ids for encoding in encode(batch, add_special_tokens=False))
        return ids

    def _tokenize_blocks(self, texts: list[str]) -> None:
        fresh = list(dict.fromkeys(text for text in texts if text not in self._cache))
        # Only assistant blocks need offsets (to place the loss start); the rest, most of the text, needs ids only.
        assistant = [text for text in fresh if text.startswith(PLAIN_PREFIX)]
        other = [text for text in fresh if not text.startswith(PLAIN_PREFIX)]
        for text, ids in zip(other, self._encode_ids(other), strict=True):
            self._cache[text] = _Tokenized(ids=ids, span=None, empty_reasoning=False)
        for batch in self._batches(assistant):
            for text, encoding in zip(batch, self._backend.encode_batch(batch, add_special_tokens=False), strict=True):
                self._cache[text] = self._assistant_block(text, encoding)

    def _assistant_block(self, text: str, encoding: Any) -> _Tokenized:
        ids = encoding.ids
        prefix = len(THINK_PREFIX) if text.startswith(THINK_PREFIX) else len(PLAIN_PREFIX)
        start = encoding.char_to_token(prefix)
        # A token straddling the prefix end (the merged "\n\n" of empty reasoning) belongs to the prompt.
        if start is None:
            start = len(ids)
        elif encoding.token_to_chars(start)[0] < prefix:
            start += 1
        end = _last_index(ids, self._im_end_id) + 1
        span = (start, end) if end > start else None  # None: reported when the block is to be trained
        return _Tokenized(ids=ids, span=span, empty_reasoning=text.startswith(EMPTY_REASONING_PREFIX))


def _last_index(ids: list[int], token: int) -> int:
    for position in range(len(ids) - 1, -1, -1):
        if ids[position] == token:
            return position
    return -1
