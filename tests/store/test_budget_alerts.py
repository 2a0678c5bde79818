"""Budget alerts (issue 29, item 6): at 50% and 80% of each limit, one log line the first time the share is reached,
never again (not from another ledger, not from another thread), recorded in the store and handed to the configured
callback — on SQLite and on Postgres."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from mass_ops.config import ConfigError, load_config
from mass_ops.store import migrations
from mass_ops.store.budgets import (
    CYCLE_SCOPE,
    BudgetAlert,
    BudgetLedger,
    BudgetLimits,
    charge_episode,
    recorded_alerts,
    task_scope,
)
from mass_ops.store.metadata import MetadataStore
from mass_ops.store.repository import MetadataRepository

RECEIVED: list[BudgetAlert] = []
CALLBACK = f"{__name__}.receive"


def receive(alert: BudgetAlert) -> None:
    """The configured alert callback of these tests."""
    RECEIVED.append(alert)


@pytest.fixture
def cycle(metadata_url: str) -> Iterator[tuple[MetadataRepository, int]]:
    migrations.upgrade(metadata_url)
    store = MetadataStore(metadata_url)
    repo = MetadataRepository(store)
    RECEIVED.clear()
    yield repo, repo.ensure_cycle("alert-test", {"name": "alert-test"}, "a" * 64).id
    store.dispose()


def alert_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("budget alert:")]


def test_each_share_alerts_once_logged_recorded_and_called_back(cycle, caplog) -> None:
    repo, cycle_id = cycle
    limits = BudgetLimits(cycle_tokens=1000, alert_callback=CALLBACK)
    scopes = (task_scope(51), CYCLE_SCOPE)
    ledger = BudgetLedger(repo, cycle_id, limits)
    with caplog.at_level(logging.WARNING, logger="mass_ops.store.budgets"):
        ledger.record(scopes, tokens=400)  # 40%: nothing yet
        assert alert_lines(caplog) == []
        ledger.record(scopes, tokens=150)  # 55%: past 50%
        ledger.record(scopes, tokens=10)  # still between: not repeated
        other = BudgetLedger(repo, cycle_id, limits)  # another process's ledger, same cycle
        other.record(scopes, tokens=10)
        other.record(scopes, tokens=300)  # 87%: past 80%
        ledger.record(scopes, tokens=1)
    assert alert_lines(caplog) == [
        "budget alert: the cycle has used 550 of budgets.cycle_tokens = 1,000 tokens (55%, past 50%)",
        "budget alert: the cycle has used 870 of budgets.cycle_tokens = 1,000 tokens (87%, past 80%)",
    ]
    assert [(a.scope, a.percent, a.setting) for a in RECEIVED] == [
        (CYCLE_SCOPE, 50, "budgets.cycle_tokens"),
        (CYCLE_SCOPE, 80, "budgets.cycle_tokens"),
    ]
    recorded = recorded_alerts(repo, cycle_id)
    assert [(r.scope, r.unit, r.percent) for r in recorded] == [
        (CYCLE_SCOPE, "tokens", 50),
        (CYCLE_SCOPE, "tokens", 80),
    ]
    assert recorded[0].at <= recorded[1].at


def test_a_spend_that_jumps_past_both_shares_raises_both_and_costs_alert_too(cycle, caplog) -> None:
    repo, cycle_id = cycle
    ledger = BudgetLedger(repo, cycle_id, BudgetLimits(task_tokens=100, task_cost_usd=2.0))
    with caplog.at_level(logging.WARNING, logger="mass_ops.store.budgets"):
        ledger.record((task_scope(7),), tokens=90, cost_usd=1.2)
    assert alert_lines(caplog) == [
        "budget alert: task 7 has used 90 of budgets.task_tokens = 100 tokens (90%, past 50%)",
        "budget alert: task 7 has used 90 of budgets.task_tokens = 100 tokens (90%, past 80%)",
        "budget alert: task 7 has cost $1.20 of budgets.task_cost_usd = $2.00 (60%, past 50%)",
    ]
    assert [(r.scope, r.unit, r.percent) for r in recorded_alerts(repo, cycle_id)] == [
        ("task:7", "tokens", 50),
        ("task:7", "tokens", 80),
        ("task:7", "USD", 50),
    ]


def test_concurrent_ledgers_raise_each_alert_exactly_once(cycle, caplog) -> None:
    repo, cycle_id = cycle
    limits = BudgetLimits(cycle_tokens=800, alert_callback=CALLBACK)
    ledgers = [BudgetLedger(repo, cycle_id, limits) for _ in range(8)]
    with caplog.at_level(logging.WARNING, logger="mass_ops.store.budgets"), ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda k: ledgers[k % 8].record((CYCLE_SCOPE,), tokens=10), range(80)))
    assert len(alert_lines(caplog)) == 2
    assert sorted(a.percent for a in RECEIVED) == [50, 80]
    assert len(recorded_alerts(repo, cycle_id)) == 2


def test_a_pod_s_charge_alerts_at_the_next_admission_check(cycle, caplog) -> None:
    """On Kubernetes a pod's spend is charged as its episode is recorded; the check before the next pod notices it."""
    repo, cycle_id = cycle
    charge_episode(repo, cycle_id, 51, charge_key="episode:1", tokens=600)
    with caplog.at_level(logging.WARNING, logger="mass_ops.store.budgets"):
        assert BudgetLedger(repo, cycle_id, BudgetLimits(cycle_tokens=1000)).exhausted((CYCLE_SCOPE,)) is None
        BudgetLedger(repo, cycle_id, BudgetLimits(cycle_tokens=1000)).exhausted((CYCLE_SCOPE,))
    assert alert_lines(caplog) == [
        "budget alert: the cycle has used 600 of budgets.cycle_tokens = 1,000 tokens (60%, past 50%)"
    ]


def test_a_failing_callback_is_logged_and_the_spend_still_counts(cycle, caplog) -> None:
    repo, cycle_id = cycle
    ledger = BudgetLedger(repo, cycle_id, BudgetLimits(in_loop_tokens=10, alert_callback="json.loads"))
    with caplog.at_level(logging.WARNING, logger="mass_ops.store.budgets"):
        ledger.record(("in_loop",), tokens=6)
    assert any("budget alert callback json.loads failed: TypeError" in r.getMessage() for r in caplog.records)
    assert repo.budget_spend(cycle_id)["in_loop"].tokens == 6
    assert len(recorded_alerts(repo, cycle_id)) == 1


def test_the_callback_is_checked_when_the_config_loads() -> None:
    config = load_config("demo", [f"budgets.alert_callback={CALLBACK}"])
    assert config.budgets.alert_callback == CALLBACK
    assert BudgetLimits.from_mapping(config.budgets.model_dump()).alert_callback == CALLBACK
    with pytest.raises(ConfigError, match=r"^config: budgets.alert_callback: cannot import module 'no_such_module'"):
        load_config("demo", ["budgets.alert_callback=no_such_module.notify"])
    with pytest.raises(ConfigError, match="does not name a callable"):
        load_config("demo", [f"budgets.alert_callback={__name__}.RECEIVED"])
