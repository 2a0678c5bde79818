"""The trigger form's estimate page (`/mass-ops/estimate`) through the plugin's app: it reads like the report (labels,
units, hours), echoes the values applied, says a budget sentence only when a budget is set, and links back."""

from __future__ import annotations

import html
import re
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

# The JSON fields of a stage row: the page shows labels for them, never the names.
RAW_FIELDS = (
    "llm_calls",
    "prompt_tokens",
    "completion_tokens",
    "prompt_tokens_sd",
    "completion_tokens_sd",
    "serving_gpu_hours",
    "training_gpu_hours",
    "wall_clock_s",
    "cost_usd",
)


@pytest.fixture
def client(tmp_path, monkeypatch) -> TestClient:
    """The reports app mounted as the API server mounts it, with a signed-in user; no parent cycle recorded, so the
    estimate uses the preset's defaults (the estimate page never opens the artifact store)."""
    from airflow.api_fastapi.core_api.security import get_user
    from mass_ops_airflow.report_app import create_app

    monkeypatch.setenv("MASS_METADATA_URL", f"sqlite:///{tmp_path / 'absent.db'}")
    monkeypatch.delenv("MASS_DEFAULT_PRESET", raising=False)
    app = create_app(lambda: pytest.fail("the estimate page opened the artifact store"))
    app.dependency_overrides[get_user] = lambda: SimpleNamespace(username="reader")
    root = FastAPI()
    root.mount("/mass-ops", app)
    return TestClient(root)


def page_and_figures(client: TestClient, query: str) -> tuple[str, dict[str, Any]]:
    """The page's text (tags stripped, entities decoded) and the JSON of the same query."""
    page = client.get(f"/mass-ops/estimate?{query}")
    assert page.status_code == 200, page.text
    figures = client.get(f"/mass-ops/estimate?{query}&format=json")
    assert figures.status_code == 200, figures.text
    return page.text, figures.json()


def text_of(page: str) -> str:
    body = page.split("<body>", 1)[-1]  # the head holds only the title and the style
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def table_of(page: str) -> tuple[list[str], list[list[str]]]:
    """The headers and rows of the page's table."""
    (table,) = re.findall(r"<table>.*?</table>", page, flags=re.S)
    headers = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", table)]
    rows = [
        [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)] for row in table.split("</tr>") if "<td>" in row
    ]
    return headers, rows


@pytest.mark.parametrize("preset", ["demo", "paper"])
def test_the_page_shows_labels_and_units_never_field_names_or_seconds(client, preset):
    page, figures = page_and_figures(client, f"preset={preset}")
    estimate = figures["estimate"]
    headers, rows = table_of(page)
    for label in ("stage", "episodes", "LLM calls", "prompt tokens", "completion tokens", "wall-clock h", "USD"):
        assert label in headers, (label, headers)
    text = text_of(page)
    for field in RAW_FIELDS:
        assert not re.search(rf"\b{field}\b", page), f"raw field name {field} on the page"
    stages = [*estimate["stages"], estimate["total"]]
    assert [r[0] for r in rows] == [*(s["stage"] for s in estimate["stages"]), "total"]
    for row, stage in zip(rows, stages, strict=True):
        by_label = dict(zip(headers, row, strict=True))
        assert by_label["wall-clock h"] == f"{stage['wall_clock_s'] / 3600:,.1f}", "hours with one decimal"
        assert by_label["prompt tokens"] == f"{stage['prompt_tokens']:,}", "tokens with separators"
        assert by_label["USD"] == f"{stage['cost_usd']:,.2f}"
        seconds = stage["wall_clock_s"]
        for shown in {f"{seconds:,.2f}", f"{seconds:,.1f}", f"{round(seconds):,}"} - {"0", "0.0", "0.00"}:
            assert shown not in text, f"a seconds figure ({shown}) on the page"
    total_s = estimate["total"]["wall_clock_s"]
    assert f"{total_s / 3600:,.1f} wall-clock hours" in text
    gpu_hours = sum(s["serving_gpu_hours"] + s["training_gpu_hours"] for s in stages)
    assert ("serving GPU-h" in headers) is (gpu_hours > 0), "GPU columns only when some stage uses GPUs"
    assert ("GPU-hours: none estimated" in text) is (gpu_hours == 0)


def test_no_budget_set_says_so_and_claims_nothing(client):
    page, figures = page_and_figures(client, "preset=demo")
    assert figures["budget"]["cycle_cost_usd"] is None and figures["budget"]["cycle_tokens"] is None
    text = text_of(page)
    assert "No cycle budget set" in text
    assert "within" not in text.lower() and "over the cycle budget" not in text.lower()


def test_a_budget_the_estimate_fits_is_stated_with_its_figures(client):
    overrides = ["budgets.cycle_cost_usd=1000", "budgets.cycle_tokens=1000000000"]
    page, figures = page_and_figures(client, "preset=demo&" + "&".join(f"set={quote(o)}" for o in overrides))
    total = figures["estimate"]["total"]
    tokens = total["prompt_tokens"] + total["completion_tokens"]
    assert figures["budget"]["over_budget"] is False
    assert (
        f"Within the cycle budget: {total['cost_usd']:,.2f} USD (budget 1,000.00 USD); "
        f"{tokens:,} tokens (budget 1,000,000,000)." in text_of(page)
    )
    assert "No cycle budget set" not in text_of(page)


@pytest.mark.parametrize(("allow", "outcome"), [("", "stops at its first step"), ("&allow_over_budget=true", "starts")])
def test_an_exceeded_budget_names_the_limit_and_what_the_run_will_do(client, allow, outcome):
    page, figures = page_and_figures(client, f"preset=demo&set={quote('budgets.cycle_tokens=1000')}{allow}")
    total = figures["estimate"]["total"]
    text = text_of(page)
    assert figures["budget"]["over_budget"] is True
    tokens = total["prompt_tokens"] + total["completion_tokens"]
    assert f"Over the cycle budget: {tokens:,} tokens (budget 1,000)." in text
    assert outcome in text and "Within the cycle budget" not in text


def test_the_values_applied_are_echoed_above_the_figures(client):
    query = "search_iterations=2&train_tasks=%5B51%2C%20202%5D&set=" + quote("collection.candidates=5")
    page, _ = page_and_figures(client, query)
    text = text_of(page)
    echo = re.search(r"Values applied: (.*?)\.\s", text)
    assert echo, text[:500]
    assert echo.group(1) == (
        "preset=demo (the default); search_iterations=2; train_tasks=[51, 202]; set collection.candidates=5"
    )
    assert text.index("Values applied") < text.index("Per stage"), "at the top, before the table"
    only_preset, _ = page_and_figures(client, "preset=paper")
    assert "Values applied: preset=paper (no knob or override changed)." in text_of(only_preset)


def test_the_page_links_back_to_the_dag_and_to_its_json(client):
    query = f"preset=demo&search_iterations=2&set={quote('collection.candidates=5')}"
    page = client.get(f"/mass-ops/estimate?{query}")
    links = {
        html.unescape(label): html.unescape(href)
        for href, label in re.findall(r'<a href="([^"]+)">(.*?)</a>', page.text)
    }
    back = next(href for label, href in links.items() if label.startswith("Back to the mass_cycle DAG"))
    # Resolved the way a browser resolves it: the Airflow UI's DAG page, under any base URL the API server has.
    assert urlsplit(urljoin(str(page.url), back)).path == "/dags/mass_cycle"
    assert urljoin("https://airflow.example.org/ops/mass-ops/estimate?x=1", back).endswith("/ops/dags/mass_cycle")
    as_json = client.get(urljoin(str(page.url), links["The same figures as JSON"]))
    assert as_json.status_code == 200 and as_json.headers["content-type"] == "application/json"
    assert as_json.json() == client.get(f"/mass-ops/estimate?{query}&format=json").json()
    collect = next(s for s in as_json.json()["estimate"]["stages"] if s["stage"] == "collect")
    assert collect["episodes"] == 5 * 2, "the override travelled with the link (5 candidates × 2 training tasks)"
