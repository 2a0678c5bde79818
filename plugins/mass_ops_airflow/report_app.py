"""The plugin's web app: cycle reports, served by the Airflow API server under `/mass-ops`.

Contract: routes below `mass_ops_airflow.reports.URL_PREFIX` — `GET /reports/{cycle}` (307 to the folder URL),
`GET /reports/{cycle}/` (its `report.html`), `GET /reports/{cycle}/figures/{name}.png`, and `GET /estimate` (the
cost estimate per stage for trigger-form values, `&format=json` for JSON). Every route requires an Airflow user
(`get_user`: no credential 401, invalid token 403); any signed-in user may read every report. Names are checked
before any artifact key is built; trigger values are a trigger's (a preset name, experiment settings only). Errors
are one line of text: 400 bad input, 404 missing, 503 store unreachable. No OpenAPI schema or docs page. The store
is the deployment's artifact store, opened once per API-server process on first use (retried after a failed
open). Why the routes authenticate themselves: docs/operations.md (`mass_ops_airflow.report_app`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response

from mass_ops.errors import InputError
from mass_ops.layout import report_prefix
from mass_ops_airflow import CYCLE_DAG_ID
from mass_ops_airflow.reports import ReportNameError, check_cycle, check_figure

if TYPE_CHECKING:
    from mass_ops.store.artifacts import ArtifactStore

log = logging.getLogger(__name__)

# The page is self-contained (inline CSS, data: images, links to its figure files): nothing to fetch, no script.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; img-src data: 'self'; style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # a rerun of the report step rewrites it
}
FIGURE_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
# One query value of the estimate page (a knob's value: a number, a task list); far above any real one.
QUERY_VALUE_MAX_BYTES = 16 * 1024


class StoreUnavailable(RuntimeError):
    """The artifact store could not be opened or read (not a missing report)."""


def deployment_store() -> ArtifactStore:
    """The artifact store the deployment's tasks write to, opened with the `mass_artifacts` connection's
    credentials exported for the duration of the open."""
    from mass_ops.store.artifact_backends import open_artifact_store
    from mass_ops_airflow.cycle import cycle_config
    from mass_ops_airflow.hooks import MassArtifactHook

    with MassArtifactHook().credentials_env():
        return open_artifact_store(cycle_config({}).storage.artifact_url)


class ReportReader:
    """Reads report artifacts from a store opened on first use; `None` for a missing artifact."""

    def __init__(self, open_store: Callable[[], ArtifactStore]) -> None:
        self._open_store = open_store
        self._store: ArtifactStore | None = None
        self._lock = threading.Lock()

    def _opened(self) -> ArtifactStore:
        with self._lock:
            if self._store is None:
                try:
                    self._store = self._open_store()
                except Exception as exc:
                    log.exception("mass-ops reports: cannot open the artifact store")
                    raise StoreUnavailable(f"the artifact store cannot be opened: {_one_line(exc)}") from exc
            return self._store

    def read(self, key: str) -> bytes | None:
        from mass_ops.store.artifacts import ArtifactError, ArtifactNotFoundError

        store = self._opened()
        try:
            return store.get_bytes(key)
        except ArtifactNotFoundError:
            return None
        except (ArtifactError, OSError) as exc:
            log.exception("mass-ops reports: cannot read %s", key)
            raise StoreUnavailable(f"{key} cannot be read from the artifact store: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def estimate_params(query: Mapping[str, str], overrides: list[str]) -> dict[str, Any]:
    """Trigger-form params from a query string: each value read as JSON when it is JSON (`3`, `[51, 202]`,
    `true`), else kept as text (a preset name); repeated `set=key=value` become `overrides`. A value meant as a
    list or object (it starts with `[` or `{`) that is not JSON within the page's size and depth limits is an
    `UntrustedInputError` of one line."""
    from mass_ops.config import MAX_CONFIG_DEPTH
    from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted

    params: dict[str, Any] = {}
    for key, text in query.items():
        if key in ("set", "format"):
            continue
        try:
            params[key] = loads_untrusted(
                text, what=f"query value {key[:40]}", max_bytes=QUERY_VALUE_MAX_BYTES, max_depth=MAX_CONFIG_DEPTH
            )
        except UntrustedInputError:
            if text.lstrip().startswith(("[", "{")):
                raise
            params[key] = text
    if overrides:
        params["overrides"] = overrides
    return params


def form_estimate(params: Mapping[str, Any]) -> dict[str, Any]:
    """The estimate summary (`mass_ops.stages.api.estimate_summary`) of the config `params` build; `ValueError` or
    `InputError` (one line) for params that do not describe a valid cycle."""
    from mass_ops_airflow.cycle import cycle_config, stage_function

    return stage_function("estimate_summary")(cycle_config(params))


# Where the estimate page links back to, relative to `/mass-ops/estimate` so it holds under any `[api] base_url`:
# the DAG's page in the Airflow UI, whose Trigger button opens the form (Airflow 3.3's UI has no form URL of its own).
DAG_PAGE_HREF = f"../dags/{CYCLE_DAG_ID}"
# An echoed value longer than this (a long task list) is cut: the echo is a reminder, the JSON has everything.
ECHO_VALUE_MAX_CHARS = 80
STAGE_HEADERS = ("stage", "episodes", "LLM calls", "prompt tokens", "completion tokens")
GPU_HEADERS = ("serving GPU-h", "training GPU-h")
TIME_COST_HEADERS = ("wall-clock h", "USD")


def _echo(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= ECHO_VALUE_MAX_CHARS else text[: ECHO_VALUE_MAX_CHARS - 1] + "…"


def applied_line(params: Mapping[str, Any]) -> str:
    """The values the estimate is for, as the caller gave them: the preset, then each knob and override as key=value."""
    from mass_ops_airflow.params import default_preset

    preset = f"preset={params['preset']}" if params.get("preset") else f"preset={default_preset()} (the default)"
    parts = [preset, *(f"{k}={_echo(v)}" for k, v in params.items() if k not in ("preset", "overrides"))]
    parts += [f"set {_echo(o)}" for o in params.get("overrides", [])]
    rest = "" if len(parts) > 1 else " (no knob or override changed)"
    return "Values applied: " + "; ".join(parts) + rest + "."


def budget_line(summary: Mapping[str, Any], allow_over_budget: bool = False) -> str:
    """One sentence on the cycle budget: none set, within it, or over it (each exceeded limit, and whether the run's
    first step will stop on it: it does unless Allow over budget is checked)."""
    budget, total = summary["budget"], summary["estimate"]["total"]
    usd, tokens = budget["cycle_cost_usd"], budget["cycle_tokens"]
    if usd is None and tokens is None:
        return "No cycle budget set (budgets.cycle_cost_usd and budgets.cycle_tokens are unset): nothing is checked."
    spent = total["prompt_tokens"] + total["completion_tokens"]
    limits = []
    if usd is not None:
        limits.append((total["cost_usd"] > usd, f"{total['cost_usd']:,.2f} USD (budget {usd:,.2f} USD)"))
    if tokens is not None:
        limits.append((spent > tokens, f"{spent:,} tokens (budget {tokens:,})"))
    if not budget["over_budget"]:
        return "Within the cycle budget: " + "; ".join(text for _, text in limits) + "."
    over = "; ".join(text for exceeded, text in limits if exceeded)
    outcome = (
        "Allow over budget is checked, so the run starts anyway."
        if allow_over_budget
        else "The run stops at its first step unless Allow over budget is checked."
    )
    return f"Over the cycle budget: {over}. {outcome}"


def _tokens(count: int, sd: int) -> str:
    return f"{count:,} ± {sd:,}" if sd else f"{count:,}"


def stage_table(estimate: Mapping[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Headers and rows (one per stage, then the total): counts with separators, hours with one decimal, USD with
    two; the GPU-hour columns only when some stage uses GPUs."""
    rows = [*estimate["stages"], {**estimate["total"], "stage": "total"}]
    gpus = any(r["serving_gpu_hours"] or r["training_gpu_hours"] for r in rows)
    headers = STAGE_HEADERS + (GPU_HEADERS if gpus else ()) + TIME_COST_HEADERS
    table = []
    for r in rows:
        counts = (str(r["stage"]), f"{r['episodes']:,}", f"{r['llm_calls']:,}")
        tokens = (
            _tokens(r["prompt_tokens"], r["prompt_tokens_sd"]),
            _tokens(r["completion_tokens"], r["completion_tokens_sd"]),
        )
        gpu = (f"{r['serving_gpu_hours']:,.1f}", f"{r['training_gpu_hours']:,.1f}") if gpus else ()
        table.append((*counts, *tokens, *gpu, f"{r['wall_clock_s'] / 3600:,.1f}", f"{r['cost_usd']:,.2f}"))
    return headers, table


def estimate_html(summary: Mapping[str, Any], params: Mapping[str, Any], json_href: str) -> str:
    """The page, in the report's look: the values applied, a link back to the DAG, the total and the budget
    sentence, the table per stage, where the per-unit figures come from, and a link to the same figures as JSON."""
    from mass_ops.evaluation.report.model import Block
    from mass_ops.evaluation.report.rendering import render_html

    estimate = summary["estimate"]
    total = estimate["total"]
    headers, rows = stage_table(estimate)
    hours = f"{total['wall_clock_s'] / 3600:,.1f}"
    tokens = total["prompt_tokens"] + total["completion_tokens"]
    headline = (
        f"Total: {total['episodes']:,} episodes, {total['llm_calls']:,} LLM calls, {tokens:,} tokens, "
        f"{hours} wall-clock hours, {total['cost_usd']:,.2f} USD."
    )
    if estimate.get("lineage_cycle"):
        source = f"measured on the parent cycle {estimate['lineage_cycle']} where it recorded them, else defaults"
    else:
        source = f"the {estimate.get('scale') or 'paper'} scale's defaults (no parent cycle's measurements)"
    blocks = [
        Block("title", f"Cost estimate: cycle {summary['cycle']}"),
        Block("p", applied_line(params)),
        Block("link", f"Back to the {CYCLE_DAG_ID} DAG (its Trigger button opens the form)", href=DAG_PAGE_HREF),
        Block("p", headline),
        Block("p", budget_line(summary, params.get("allow_over_budget") is True)),
        Block("h2", "Per stage"),
        Block("table", headers=headers, rows=tuple(rows)),
        Block("p", f"Per-unit figures: {source}. Wall-clock adds up over the stages, which run one after another."),
    ]
    if not any(h in headers for h in GPU_HEADERS):
        blocks.append(Block("p", "GPU-hours: none estimated (no stage serves or trains on GPUs)."))
    if estimate.get("unpriced_models"):
        unpriced = ", ".join(estimate["unpriced_models"])
        blocks.append(Block("note", f"Not priced (no prices.models entry, counted at 0 USD): {unpriced}."))
    blocks.append(Block("link", "The same figures as JSON", href=json_href))
    return render_html(blocks, {})


def _text(status: int, line: str) -> PlainTextResponse:
    return PlainTextResponse(line + "\n", status_code=status)


def create_app(open_store: Callable[[], ArtifactStore] = deployment_store) -> FastAPI:
    """The reports app; every route requires an authenticated Airflow user (see the module docstring)."""
    # Imported here: Airflow's API security module is heavy and only the API server builds this app.
    from airflow.api_fastapi.core_api.security import get_user

    app = FastAPI(
        title="mass-ops reports",
        dependencies=[Depends(get_user)],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    reader = ReportReader(open_store)

    @app.exception_handler(ReportNameError)
    def bad_name(request: Request, exc: ReportNameError) -> Response:
        return _text(400, str(exc))

    @app.exception_handler(StoreUnavailable)
    def unavailable(request: Request, exc: StoreUnavailable) -> Response:
        return _text(503, str(exc))

    @app.get("/reports/{cycle}")
    def report_folder(cycle: str) -> Response:
        """Redirect to the folder URL (relative, so it holds behind any proxy prefix)."""
        return RedirectResponse(f"{quote(check_cycle(cycle), safe='')}/", status_code=307)

    @app.get("/reports/{cycle}/")
    def report_page(cycle: str) -> Response:
        """The cycle's report.html."""
        data = reader.read(f"{report_prefix(check_cycle(cycle))}/report.html")
        if data is None:
            return _text(404, f"cycle {cycle} has no report yet (its report step has not written report.html)")
        return Response(data, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/reports/{cycle}/figures/{name}.png")
    def report_figure(cycle: str, name: str) -> Response:
        """One PNG figure of the cycle's report."""
        data = reader.read(f"{report_prefix(check_cycle(cycle))}/figures/{check_figure(name)}.png")
        if data is None:
            return _text(404, f"cycle {cycle} has no report figure {name}.png")
        return Response(data, media_type="image/png", headers=FIGURE_HEADERS)

    @app.get("/estimate")
    def estimate_page(request: Request) -> Response:
        """The per-stage cost estimate of the cycle the query's trigger-form values describe."""
        try:
            params = estimate_params(request.query_params, request.query_params.getlist("set"))
            summary = form_estimate(params)
        except (ValueError, InputError) as exc:  # unknown knob, bad override, a deployment's key, too deep
            return _text(400, f"estimate: {_one_line(exc)}")
        if request.query_params.get("format") == "json":
            return JSONResponse(summary, headers=FIGURE_HEADERS)
        kept = [(k, v) for k, v in request.query_params.multi_items() if k != "format"]
        page = estimate_html(summary, params, "estimate?" + urlencode([*kept, ("format", "json")]))
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    return app
