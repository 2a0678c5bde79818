"""Budget overshoot at the episode proxy: how far past a token budget an agent gets on every generation path.

A metered upstream (written here) serves chat completions, completions and responses the way a model server does
at its worst for a budget: every sequence runs to its output cap, `n` / `best_of` / a batch of prompts multiply the
sequences, a request without a cap generates the server's own default (much more than the episode's), and a stream
reports usage only when asked (`stream_options.include_usage`). The upstream counts every token it serves: that is
the truth the budget is measured against, not what the proxy or the agent say.

For each attack (streams without include_usage, n>1, best_of over a batch of prompts, the Responses API, no cap,
float and string caps, parallel requests) and each scope (the episode's own budget, held in the proxy; the task's,
held in the cycle's shared ledger and spent by two episodes' proxies at once), the agent sends requests until the
proxy refuses one (HTTP 402). Printed per row: the limit, the tokens served, the tokens the budget counted, the
overshoot (served - limit) and its bound, one request's allowance per request in flight (the largest need the proxy
computed for one request x the requests in flight at most). The verdict holds when every overshoot is within its
bound and no budget counted less than was served.

    .venv/bin/python benchmarks/budget_overshoot.py [--budget 5000] [--max-tokens 256] [--parallel 4] [--n 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository is importable

from mass_ops.runtime.proxy import (
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    RESPONSES_ROUTE,
    EpisodeBudget,
    LoggingProxy,
    prepare_generation,
)
from mass_ops.store.budgets import BudgetLedger, BudgetLimits, task_scope

MODEL = "metered"
TOKENS_PER_CHUNK = 16


class MeteredUpstream:
    """An OpenAI-compatible stand-in that generates every sequence to its cap and counts what it serves; `seen`
    lists every request that reached it (method, path as sent), whichever route it asked for."""

    def __init__(self, *, server_default_tokens: int, prefix: str = "/v1") -> None:
        self.prefix = prefix  # where its OpenAI routes are (an endpoint's client path)
        self.server_default_tokens = server_default_tokens  # what a request without a cap gets (vLLM: the context)
        self.served = 0
        self.requests = 0
        self.seen: list[tuple[str, str]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> MeteredUpstream:
        @web.middleware
        async def note(request: web.Request, handler: Any) -> web.StreamResponse:
            self.seen.append((request.method, request.raw_path))
            return await handler(request)

        app = web.Application(client_max_size=1 << 30, middlewares=[note])
        app.router.add_get(f"{self.prefix}/models", self._models)
        app.router.add_get(f"{self.prefix}/models/{{model}}", self._models)
        for route in (CHAT_ROUTE, COMPLETIONS_ROUTE, RESPONSES_ROUTE):
            app.router.add_post(f"{self.prefix}{route}", self._generate)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        route = request.path[len(self.prefix) :]
        cap_names = {"/chat/completions": ("max_completion_tokens", "max_tokens")}.get(
            route, ("max_output_tokens",) if route == RESPONSES_ROUTE else ("max_tokens",)
        )
        caps = [math.ceil(float(body[name])) for name in cap_names if body.get(name) is not None]
        cap = max(caps) if caps else self.server_default_tokens
        sequences = max([1, *(int(body[name]) for name in ("n", "best_of") if body.get(name) is not None)])
        prompt = body.get("messages") or body.get("prompt") or body.get("input") or ""
        prompts = len(prompt) if route == COMPLETIONS_ROUTE and isinstance(prompt, list) else 1
        prompt_tokens = math.ceil(len(json.dumps(prompt)) / 4)
        completion_tokens = prompts * sequences * cap
        self.served += prompt_tokens + completion_tokens
        self.requests += 1
        if route == RESPONSES_ROUTE:
            usage = {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}
            usage["total_tokens"] = prompt_tokens + completion_tokens
        else:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
            usage["total_tokens"] = prompt_tokens + completion_tokens
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "response", "choices": [], "output": [], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(math.ceil(completion_tokens / TOKENS_PER_CHUNK)):
            delta = {"content": "tok " * TOKENS_PER_CHUNK}
            await response.write(_event({"id": "x", "choices": [{"index": 0, "delta": delta}]}))
        if route == RESPONSES_ROUTE:
            await response.write(_event({"type": "response.completed", "response": {"id": "x", "usage": usage}}))
        elif (body.get("stream_options") or {}).get("include_usage"):
            await response.write(_event({"id": "x", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@dataclass
class _Row:
    spend: int = 0
    cost: float = 0.0
    refused: int = 0

    @property
    def tokens(self) -> int:
        return self.spend

    @property
    def cost_usd(self) -> float:
        return self.cost

    @property
    def refused_need(self) -> int:
        return self.refused


class MemoryLedgerStore:
    """The three metadata-store calls a `BudgetLedger` makes, in memory (the store's atomic increments: a lock)."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self._lock = threading.Lock()

    def budget_spend(self, cycle_id: int, scopes: Any = None) -> dict[str, _Row]:
        with self._lock:
            return {scope: _Row(row.spend, row.cost) for scope, row in self.rows.items()}

    def add_budget_spend(self, cycle_id: int, scopes: Any, *, tokens: int, cost_usd: float = 0.0, **_: Any) -> bool:
        with self._lock:
            for scope in scopes:
                row = self.rows.setdefault(scope, _Row())
                row.spend += tokens
                row.cost += cost_usd
        return True

    def note_budget_refusal(self, cycle_id: int, scope: str, need: int) -> None:
        with self._lock:
            self.rows.setdefault(scope, _Row()).refused = need


@dataclass(frozen=True)
class Attack:
    """One way to spend: a route, a request body, and how many of the agent's requests are in flight at once."""

    name: str
    route: str
    body: Callable[[int], dict[str, Any]]
    parallel: int = 1


@dataclass
class Result:
    attack: str
    scope: str
    limit: int
    served: int
    counted: int
    allowance: int
    in_flight: int
    requests: int
    refused: bool

    @property
    def overshoot(self) -> int:
        return max(0, self.served - self.limit)

    @property
    def bound(self) -> int:
        return self.allowance * self.in_flight

    @property
    def ok(self) -> bool:
        return self.refused and self.overshoot <= self.bound and self.counted >= self.served


@dataclass
class Settings:
    budget: int = 5000
    max_tokens: int = 256
    default_max_tokens: int = 512  # the episode's configured max output per response (what the proxy holds)
    parallel: int = 4
    n: int = 50
    max_requests: int = 400  # per attack: a safety stop should a budget never refuse
    results: list[Result] = field(default_factory=list)


def attacks(settings: Settings) -> list[Attack]:
    """The spend paths of ISSUE #25.1, as a hostile agent takes them."""
    cap = settings.max_tokens

    def chat(**extra: Any) -> Callable[[int], dict[str, Any]]:
        return lambda i: {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}], **extra}

    return [
        Attack("chat stream without include_usage", CHAT_ROUTE, chat(stream=True, max_tokens=cap)),
        Attack(f"chat n={settings.n}", CHAT_ROUTE, chat(n=settings.n, max_tokens=cap)),
        Attack("chat n=2 stream", CHAT_ROUTE, chat(n=2, stream=True, max_tokens=cap)),
        Attack("chat without max_tokens", CHAT_ROUTE, chat(stream=True)),
        Attack("chat max_tokens as a string", CHAT_ROUTE, chat(max_tokens=str(cap))),
        Attack("chat max_completion_tokens float", CHAT_ROUTE, chat(max_completion_tokens=cap - 0.5)),
        Attack(
            "completions best_of=3, 2 prompts, stream",
            COMPLETIONS_ROUTE,
            lambda i: {"model": MODEL, "prompt": [f"a {i}", f"b {i}"], "best_of": 3, "max_tokens": cap, "stream": True},
        ),
        Attack(
            "responses stream",
            RESPONSES_ROUTE,
            lambda i: {"model": MODEL, "input": f"request {i}", "max_output_tokens": cap, "stream": True},
        ),
        Attack(
            f"chat stream x{settings.parallel} in parallel",
            CHAT_ROUTE,
            chat(stream=True, max_tokens=cap),
            parallel=settings.parallel,
        ),
    ]


async def _spend_until_refused(
    proxies: list[LoggingProxy], attack: Attack, settings: Settings, allowance: list[int]
) -> tuple[int, bool]:
    """Every proxy's agent sends `attack` requests (`attack.parallel` at once each) until one is refused."""
    refused = asyncio.Event()
    sent = 0

    async def agent(proxy: LoggingProxy, client: aiohttp.ClientSession) -> None:
        nonlocal sent
        while not refused.is_set() and sent < settings.max_requests:
            sent += 1
            body = attack.body(sent)
            allowance.append(_need(attack.route, body, settings))
            async with client.post(f"{proxy.url}/v1{attack.route}", json=body) as response:
                await response.read()
                if response.status == 402:
                    refused.set()
                elif response.status != 200:
                    raise RuntimeError(f"{attack.name}: HTTP {response.status}: {await response.text()}")

    async with aiohttp.ClientSession() as client:
        await asyncio.gather(*(agent(proxy, client) for proxy in proxies for _ in range(attack.parallel)))
    return sent, refused.is_set()


def _need(route: str, body: dict[str, Any], settings: Settings) -> int:
    """The allowance the proxy holds for `body` (its own computation, with the episode's default output)."""
    prepared = prepare_generation(
        route, json.dumps(body).encode(), default_max_tokens=settings.default_max_tokens, priority=None
    )
    assert prepared.need is not None
    return prepared.need


async def run_attack(attack: Attack, scope: str, settings: Settings) -> Result:
    """One attack against one scope's budget; the result compares what was served with the limit."""
    server_default = 8 * settings.default_max_tokens
    async with MeteredUpstream(server_default_tokens=server_default) as upstream:
        with tempfile.TemporaryDirectory(prefix="budget-overshoot-") as tmp:
            store = MemoryLedgerStore()
            ledger = None
            episodes = 1
            if scope == "task":
                # Two episodes of one task spend from the task's budget at once, each through its own proxy.
                limits = BudgetLimits(task_tokens=settings.budget)
                ledger = BudgetLedger(store, 1, limits)  # type: ignore[arg-type]  # the store's three calls
                episodes = 2
            budgets = [
                EpisodeBudget(
                    episode_tokens=settings.budget if scope == "episode" else None,
                    default_max_tokens=settings.default_max_tokens,
                    ledger=ledger,
                    scopes=(task_scope(1),),
                )
                for _ in range(episodes)
            ]
            proxies = [
                LoggingProxy(upstream.url, Path(tmp) / f"api-{i}.jsonl", budget=budget)
                for i, budget in enumerate(budgets)
            ]
            for proxy in proxies:
                await proxy.start()
            allowance: list[int] = []
            try:
                _sent, refused = await _spend_until_refused(proxies, attack, settings, allowance)
            finally:
                for proxy in proxies:
                    await proxy.stop()
            counted = store.rows[task_scope(1)].spend if scope == "task" else budgets[0].spent
    return Result(
        attack=attack.name,
        scope=scope,
        limit=settings.budget,
        served=upstream.served,
        counted=counted,
        allowance=max(allowance, default=0),
        in_flight=attack.parallel * episodes,
        requests=upstream.requests,
        refused=refused,
    )


def run(settings: Settings) -> list[Result]:
    """Every attack against the episode's and the task's budget."""

    async def everything() -> list[Result]:
        return [
            await run_attack(attack, scope, settings) for scope in ("episode", "task") for attack in attacks(settings)
        ]

    settings.results = asyncio.run(everything())
    return settings.results


def report(results: list[Result]) -> str:
    lines = [
        f"{'attack':<42} {'scope':<8} {'limit':>6} {'served':>7} {'counted':>8} {'overshoot':>9} {'bound':>7} "
        f"{'ratio':>5}  ok"
    ]
    for r in results:
        ratio = r.overshoot / r.bound if r.bound else 0.0
        lines.append(
            f"{r.attack:<42} {r.scope:<8} {r.limit:>6} {r.served:>7} {r.counted:>8} {r.overshoot:>9} {r.bound:>7} "
            f"{ratio:>5.2f}  {'OK' if r.ok else 'FAIL'}"
        )
    worst = max((r.overshoot / r.bound if r.bound else 0.0) for r in results)
    verdict = "OK" if all(r.ok for r in results) else "FAIL"
    lines.append(
        f"verdict: overshoot <= one request's allowance per request in flight, and no spend counted below what was "
        f"served, on every attack and scope: {verdict} (worst overshoot/bound {worst:.2f})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=5000, help="tokens of the episode's / the task's budget")
    parser.add_argument("--max-tokens", type=int, default=256, help="the agent's output cap per request")
    parser.add_argument("--parallel", type=int, default=4, help="requests in flight at once in the parallel attack")
    parser.add_argument("--n", type=int, default=50, help="n of the n>1 attack")
    args = parser.parse_args(argv)
    settings = Settings(budget=args.budget, max_tokens=args.max_tokens, parallel=args.parallel, n=args.n)
    results = run(settings)
    print(report(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
