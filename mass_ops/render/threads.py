"""Exchanges grouped into agent threads, and threads cut into conversations (MASS_SPEC §7).

A thread is every request one agent made: the same system prompt and the same first user message, keyed by
md5(system content + NUL + json(first user content))[:10]. Within a thread, requests sorted by `seq` form one
conversation as long as each request's message list extends the previous one; when it does not (context compression,
a history rewrite, a restart), a new conversation begins. A conversation is replayed as its last request's messages
plus the model's final reply, which is dropped when generation stopped at the token limit (finish_reason "length").
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mass_ops.render.proxy_log import Exchange


@dataclass(frozen=True)
class Conversation:
    """One replayable conversation of one agent thread."""

    key: str
    index: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    n_requests: int
    first_seq: int
    final_truncated: bool

    @property
    def thread_id(self) -> str:
        """Stable id: the thread key and the conversation's position within the thread."""
        return f"{self.key}.{self.index}"


def thread_key(messages: Sequence[dict[str, Any]]) -> str:
    """md5(system content + NUL + json(first user content))[:10]; an absent part counts as empty."""
    system = ""
    if messages and messages[0].get("role") == "system":
        content = messages[0].get("content")
        system = content if isinstance(content, str) else json.dumps(content)
    first_user: Any = ""
    for message in messages:
        if message.get("role") == "user":
            first_user = message.get("content")
            break
    material = system + "\0" + json.dumps(first_user)
    return hashlib.md5(material.encode("utf-8"), usedforsecurity=False).hexdigest()[:10]


def extends(previous: Sequence[dict[str, Any]], following: Sequence[dict[str, Any]]) -> bool:
    """True when `previous` is an exact prefix of `following`, message by message.

    Structural equality of the parsed messages (dict key order ignored) is what comparing their sort_keys JSON
    would say, without serialising every message of every request again.
    """
    return len(previous) <= len(following) and all(a == b for a, b in zip(previous, following, strict=False))


def conversations(exchanges: Iterable[Exchange], *, keep_truncated_final: bool = False) -> list[Conversation]:
    """Group exchanges into threads, split each thread at prefix breaks; conversations ordered by first seq."""
    threads: dict[str, list[Exchange]] = {}
    for exchange in exchanges:
        threads.setdefault(thread_key(exchange.messages), []).append(exchange)
    result: list[Conversation] = []
    for key, members in threads.items():
        members.sort(key=lambda exchange: exchange.seq)
        chains: list[list[Exchange]] = [[members[0]]]
        for previous, following in itertools.pairwise(members):
            if extends(previous.messages, following.messages):
                chains[-1].append(following)
            else:
                chains.append([following])
        for index, chain in enumerate(chains):
            result.append(_replay(key, index, chain, keep_truncated_final))
    result.sort(key=lambda conversation: conversation.first_seq)
    return result


def _replay(key: str, index: int, chain: list[Exchange], keep_truncated_final: bool) -> Conversation:
    last = chain[-1]
    truncated = last.finish_reason == "length"
    messages = list(last.messages)
    if keep_truncated_final or not truncated:
        messages.append(last.reply)
    return Conversation(
        key=key,
        index=index,
        messages=messages,
        tools=last.tools,
        n_requests=len(chain),
        first_seq=chain[0].seq,
        final_truncated=truncated,
    )
