"""The budget ledger in the metadata store (ISSUE #15.2): atomic increments from many threads, the admission rule,
and a refused scope that stays exhausted until its limit is raised — on SQLite and on Postgres."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from mass_ops.store import migrations
from mass_ops.store.budgets import CYCLE_SCOPE, BudgetExhaustedError, BudgetLedger, BudgetLimits, task_scope
from mass_ops.store.metadata import MetadataStore
from mass_ops.store.repository import MetadataRepository


@pytest.fixture
def cycle(metadata_url: str) -> Iterator[tuple[MetadataRepository, int]]:
    migrations.upgrade(metadata_url)
    store = MetadataStore(metadata_url)
    repo = MetadataRepository(store)
    yield repo, repo.ensure_cycle("budget-test", {"name": "budget-test"}, "b" * 64).id
    store.dispose()


def test_concurrent_increments_lose_nothing(cycle: tuple[MetadataRepository, int]) -> None:
    repo, cycle_id = cycle
    scopes = (task_scope(51), CYCLE_SCOPE)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda _: repo.add_budget_spend(cycle_id, scopes, tokens=7, cost_usd=0.5), range(80)))
    spend = repo.budget_spend(cycle_id)
    assert {scope: (row.tokens, row.cost_usd, row.requests) for scope, row in spend.items()} == {
        "task:51": (560, 40.0, 80),
        "cycle": (560, 40.0, 80),
    }


def test_admission_counts_spend_in_flight_and_refusals_until_raised(cycle: tuple[MetadataRepository, int]) -> None:
    repo, cycle_id = cycle
    ledger = BudgetLedger(repo, cycle_id, BudgetLimits(cycle_tokens=1000, task_cost_usd=2.0))
    scopes = (task_scope(7), CYCLE_SCOPE)
    assert ledger.try_admit(scopes, 600) is None  # held in flight
    refused = ledger.try_admit(scopes, 500)  # 600 in flight + 500 > 1000
    assert refused is not None and refused.scope == CYCLE_SCOPE and refused.setting == "budgets.cycle_tokens"
    ledger.record(scopes, tokens=550, cost_usd=2.5)
    ledger.release(scopes, 600)
    # The task's cost has reached its limit: refused whatever the tokens (a call's cost is known only afterwards).
    with pytest.raises(BudgetExhaustedError, match=r"task 7 has cost \$2.5000 of budgets.task_cost_usd"):
        ledger.check(scopes, 1)
    # The cycle refused a request needing 500 with 550 spent: exhausted for every process until raised.
    other = BudgetLedger(repo, cycle_id, BudgetLimits(cycle_tokens=1000))
    assert other.exhausted((CYCLE_SCOPE,)) is not None
    assert BudgetLedger(repo, cycle_id, BudgetLimits(cycle_tokens=2000)).exhausted((CYCLE_SCOPE,)) is None
    assert BudgetLedger(repo, cycle_id, BudgetLimits()).exhausted(scopes) is None  # unlimited
