"""The budget ledger's rows: spend per scope of a cycle, incremented atomically, and once-only markers (charges,
alerts)."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from mass_ops.store.repository.base import (
    RepositoryBase,
)
from mass_ops.store.schema import (
    BudgetCharge,
    BudgetSpend,
    utcnow,
)


class BudgetRecords(RepositoryBase):
    """Rows of `budget_spend` and `budget_charges`."""

    def add_budget_spend(
        self,
        cycle_id: int,
        scopes: Sequence[str],
        *,
        tokens: int,
        cost_usd: float = 0.0,
        requests: int = 1,
        charge_key: str | None = None,
    ) -> bool:
        """Add spend to every scope of `scopes` in one transaction: an atomic increment (INSERT … ON CONFLICT DO
        UPDATE SET x = x + excluded.x), so concurrent processes never lose one another's spend.

        With `charge_key`, the charge is made at most once per cycle: its marker (`budget_charges`) commits with the
        increments, and a key already marked adds nothing. Returns whether the spend was added."""
        if not scopes:
            return False
        table = BudgetSpend.__table__
        insert = self._dialect_insert(BudgetSpend)
        statement = insert.on_conflict_do_update(
            index_elements=["cycle_id", "scope"],
            set_={
                "tokens": table.c.tokens + insert.excluded.tokens,
                "cost_usd": table.c.cost_usd + insert.excluded.cost_usd,
                "requests": table.c.requests + insert.excluded.requests,
                "updated_at": insert.excluded.updated_at,
            },
        )
        now = utcnow()
        rows = [
            {
                "cycle_id": cycle_id,
                "scope": scope,
                "tokens": tokens,
                "cost_usd": cost_usd,
                "requests": requests,
                "updated_at": now,
            }
            for scope in dict.fromkeys(scopes)
        ]
        with self.store.transaction() as connection:
            if charge_key is not None:
                mark = (
                    self._dialect_insert(BudgetCharge)
                    .on_conflict_do_nothing(index_elements=["cycle_id", "charge_key"])
                    .returning(BudgetCharge.id)  # no row back: the key was there (rowcount is not portable here)
                )
                marked = connection.execute(mark, {"cycle_id": cycle_id, "charge_key": charge_key, "created_at": now})
                if marked.first() is None:
                    return False  # charged before (a retried ingest): the increments are not repeated
            for row in rows:  # one statement per scope: executemany of an upsert is not portable
                connection.execute(statement, row)
        return True

    def note_budget_refusal(self, cycle_id: int, scope: str, need: int) -> None:
        """Remember that `scope` refused a request needing `need` tokens (its latest refusal)."""
        insert = self._dialect_insert(BudgetSpend)
        statement = insert.on_conflict_do_update(
            index_elements=["cycle_id", "scope"], set_={"refused_need": insert.excluded.refused_need}
        )
        row = {"cycle_id": cycle_id, "scope": scope, "tokens": 0, "cost_usd": 0.0, "requests": 0}
        with self.store.transaction() as connection:
            connection.execute(statement, {**row, "refused_need": need, "updated_at": utcnow()})

    def mark_budget_once(self, cycle_id: int, key: str) -> bool:
        """Insert the marker `key` of a cycle (`budget_charges`) unless it is there: True only for the one call, in
        any process, that inserted it (what makes a budget alert fire once)."""
        mark = (
            self._dialect_insert(BudgetCharge)
            .on_conflict_do_nothing(index_elements=["cycle_id", "charge_key"])
            .returning(BudgetCharge.id)
        )
        with self.store.transaction() as connection:
            marked = connection.execute(mark, {"cycle_id": cycle_id, "charge_key": key, "created_at": utcnow()})
            return marked.first() is not None

    def budget_marks(self, cycle_id: int, prefix: str) -> list[BudgetCharge]:
        """The markers of a cycle whose key starts with `prefix`, oldest first."""
        statement = (
            sa.select(BudgetCharge)
            .where(BudgetCharge.cycle_id == cycle_id, BudgetCharge.charge_key.startswith(prefix, autoescape=True))
            .order_by(BudgetCharge.id)
        )
        return self._all(statement)

    def budget_spend(self, cycle_id: int, scopes: Sequence[str] | None = None) -> dict[str, BudgetSpend]:
        """Spend so far per scope of a cycle (all scopes, or those among `scopes`; absent ones spent nothing)."""
        statement = sa.select(BudgetSpend).where(BudgetSpend.cycle_id == cycle_id)
        if scopes is not None:
            statement = statement.where(BudgetSpend.scope.in_(list(scopes)))
        return {row.scope: row for row in self._all(statement)}
