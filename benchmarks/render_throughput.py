"""Render throughput vs raw tokenisation of the same text (goal: ratio ≥ 0.5).

Generates realistic teacher episodes — an orchestrator delegating to several workers, each running many tool turns
with long command outputs, one orchestrator follow-up user message (a second segment) — as proxy-log records, then
times `render_dataset` (paper window 49152 / overlap 8192, strict) against one batch call of the same tokenizer
(`tokenizer(texts)`) on the full rendered text of every conversation; both count the same tokens. The ids-only
backend call (`encode_batch_fast`, no offsets) is printed too: rendering tokenises every text twice (blocks, then
the whole text as a check), so against that floor the ratio tops out near 0.5. Parsing the gzipped log is timed
separately (input-format work, not rendering).

    .venv/bin/python benchmarks/render_throughput.py [--episodes 2] [--workers 3] [--turns 20] [--repeat 2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mass_ops.models.tokenizer import load_qwen3_tokenizer
from mass_ops.render import EpisodeSource, iter_proxy_records, render_dataset
from mass_ops.render.masks import vllm_messages
from mass_ops.render.proxy_log import exchanges
from mass_ops.render.substitution import find_teacher_prompt, substitute
from mass_ops.render.threads import conversations

WORDS = [
    "model", "data", "split", "baseline", "metric", "precision", "recall", "loss", "seed", "fold", "config",
    "pipeline", "result", "table", "figure", "ablation", "variance", "estimate", "robust", "leakage", "protein",
    "interface", "residue", "contact", "score", "threshold", "curve", "sample", "batch", "epoch",
]  # fmt: skip
RULES = "\n".join(f"- Rule {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(18)) for i in range(120))
ORCHESTRATOR_SYSTEM = "You are Qwen Code, a non-interactive CLI agent.\n\n# Core Mandates\n" + RULES
WORKER_SYSTEM = "You are a general-purpose subagent working for a parent agent.\n\n" + RULES[: len(RULES) // 3]
TASK = "Build a protein-interface retrieval benchmark; report precision@k and recall@k with confidence intervals."
BARE = TASK + "\n\nUse uv for all Python workflows."
TEACHER = TASK + "\n\nCreate an agent team with following agent candidates ...\n\nUse uv for all Python workflows."


def _tools() -> list[dict[str, Any]]:
    names = ["agent", "read_file", "write_file", "edit", "glob", "grep_search", "run_shell_command", "todo_write"]
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name}: " + " ".join(WORDS[i : i + 40]),
                "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
            },
        }
        for i, name in enumerate(names)
    ]


def _prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _output(rng: random.Random, lines: int) -> str:
    return "\n".join(
        f"[step {i:05d}] loss={rng.uniform(0, 3):.4f} p@5={rng.random():.3f} r@10={rng.random():.3f} "
        f"path=/workspace/results/run_{rng.randrange(999):03d}.json"
        for i in range(lines)
    )


class _Log:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], reply: dict[str, Any]) -> None:
        calls = reply.get("tool_calls")
        message = {
            "role": "assistant",
            "content": reply.get("content"),
            "reasoning_content": reply.get("reasoning"),
            "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)] if calls else None,
        }
        self.records.append(
            {
                "path": "/v1/chat/completions",
                "seq": len(self.records) + 1,
                "status": 200,
                "stream": True,
                "request": {"model": "m", "messages": list(messages), "tools": tools, "stream": True},
                "response": {
                    "object": "chat.completion.reassembled",
                    "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
                },
            }
        )


def _turn(log: _Log, messages: list[dict[str, Any]], tools: list[dict[str, Any]], reply: dict[str, Any]) -> None:
    log.chat(messages, tools, reply)
    sent: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("tool_calls"):
        sent["tool_calls"] = reply["tool_calls"]
    if reply.get("reasoning"):
        sent["reasoning_content"] = reply["reasoning"]
    messages.append(sent)


def _call(call_id: str, name: str, arg: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps({"arg": arg})}}


def build_episode(seed: int, workers: int, turns: int) -> list[dict[str, Any]]:
    """Proxy-log records of one synthetic teacher episode."""
    rng = random.Random(seed)
    log = _Log()
    tools = _tools()
    reminder = {"type": "text", "text": "<system-reminder>\n" + RULES[:3000] + "\n</system-reminder>"}
    sent_teacher = {"type": "text", "text": TEACHER.replace("@k", " @k")}  # qwen-code's "@k" rewrite
    main = [{"role": "system", "content": ORCHESTRATOR_SYSTEM}, {"role": "user", "content": [reminder, sent_teacher]}]
    for w in range(workers):
        _turn(log, main, tools, {"reasoning": _prose(rng, 150), "tool_calls": [_call(f"o{w}", "agent", f"stage {w}")]})
        task = {"type": "text", "text": f"Stage {w}: {_prose(rng, 80)}"}
        worker = [{"role": "system", "content": WORKER_SYSTEM}, {"role": "user", "content": [reminder, task]}]
        for t in range(turns):
            if rng.random() < 0.3:
                call = _call(f"w{w}-{t}", "write_file", _output(rng, rng.randrange(20, 80)))
            else:
                call = _call(f"w{w}-{t}", "run_shell_command", "uv run python run_pipeline.py --stage " + str(t))
            # Every intermediate turn reasons: the Qwen3 template drops the think block of an intermediate turn
            # without reasoning, and the renderer refuses such a turn (not what the model generated). The empty
            # reasoning case is the orchestrator's last turn, whose think block the template keeps.
            reasoning = _prose(rng, rng.randrange(20, 300))
            _turn(log, worker, tools, {"reasoning": reasoning, "tool_calls": [call]})
            output = {"type": "text", "text": _output(rng, rng.randrange(10, 300))}
            worker.append({"role": "tool", "tool_call_id": call["id"], "content": [output]})
        _turn(log, worker, tools, {"reasoning": _prose(rng, 100), "content": "Report: " + _prose(rng, 200)})
        report = {"type": "text", "text": worker[-1]["content"]}
        main.append({"role": "tool", "tool_call_id": f"o{w}", "content": [report]})
    main.append({"role": "user", "content": [{"type": "text", "text": "<system-reminder>Wrap up.</system-reminder>"}]})
    _turn(log, main, tools, {"reasoning": "", "content": "Final: " + _prose(rng, 300)})
    return log.records


def conversation_texts(records: list[dict[str, Any]], tokenizer: Any) -> list[str]:
    """The full rendered text of every conversation: the baseline tokenises exactly this."""
    texts = []
    for conversation in conversations(exchanges(records)):
        messages = vllm_messages(conversation.messages)
        match = find_teacher_prompt(messages[1]["content"], TEACHER, BARE)
        if match:
            messages[1] = {**messages[1], "content": substitute(messages[1]["content"], match)}
        texts.append(
            tokenizer.apply_chat_template(
                messages, tools=conversation.tools, add_generation_prompt=False, tokenize=False, enable_thinking=True
            )
        )
    return texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--window", type=int, default=49152)
    parser.add_argument("--overlap", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=2, help="best of N timings for each side")
    args = parser.parse_args(argv)

    tokenizer = load_qwen3_tokenizer()
    tokenizer.model_max_length = sys.maxsize  # long conversations are the point here; silence the length warning
    logs = [build_episode(seed, args.workers, args.turns) for seed in range(args.episodes)]
    gz_logs = [gzip.compress("\n".join(json.dumps(r) for r in records).encode(), 6) for records in logs]
    sources = [
        EpisodeSource(f"t202_L0_s{7100 + i}", 202, "t202_L0", 7100 + i, True, records, TEACHER, BARE)
        for i, records in enumerate(logs)
    ]
    texts = [text for records in logs for text in conversation_texts(records, tokenizer)]

    baseline_s = ids_only_s = render_s = parse_s = float("inf")
    for _ in range(args.repeat):
        started = time.perf_counter()
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        baseline_s = min(baseline_s, time.perf_counter() - started)
        started = time.perf_counter()
        tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        ids_only_s = min(ids_only_s, time.perf_counter() - started)
        started = time.perf_counter()
        _, stats = render_dataset(sources, tokenizer, window=args.window, overlap=args.overlap, strict=True)
        render_s = min(render_s, time.perf_counter() - started)
        started = time.perf_counter()
        for blob in gz_logs:
            sum(1 for _ in iter_proxy_records(blob))
        parse_s = min(parse_s, time.perf_counter() - started)

    tokens = sum(len(ids) for ids in encoded)
    rendered_tokens = sum(t["n_tokens"] for e in stats["episodes"] for t in e["threads"])
    if rendered_tokens != tokens:
        raise SystemExit(f"renderer covered {rendered_tokens} tokens but the conversations hold {tokens}")
    aggregate = stats["aggregate"]
    log_mib = sum(len(blob) for blob in gz_logs) / 2**20
    print(f"episodes={args.episodes} conversations={len(texts)} tokens={tokens} windows={aggregate['windows']} "
          f"loss_tokens={aggregate['loss_tokens']}")  # fmt: skip
    print(f"raw batch tokenisation : {tokens / baseline_s:12,.0f} tokens/s ({baseline_s:.3f} s)  tokenizer(texts)")
    print(f"ids-only backend batch : {tokens / ids_only_s:12,.0f} tokens/s ({ids_only_s:.3f} s)  encode_batch_fast")
    print(f"render_dataset         : {tokens / render_s:12,.0f} tokens/s ({render_s:.3f} s)")
    print(f"log parse (gz JSONL)   : {log_mib / parse_s:12,.1f} MiB/s   ({parse_s:.3f} s for {log_mib:.1f} MiB)")
    ratio = baseline_s / render_s
    print(f"ratio render/ids-only = {ids_only_s / render_s:.2f}")
    print(f"ratio render/raw = {ratio:.2f} (target >= 0.5) {'OK' if ratio >= 0.5 else 'BELOW TARGET'}")


if __name__ == "__main__":
    main()
