"""The champion (BEST-H) rule of RHI in baseline-anchored mode (MASS_SPEC §3.3, `_derive_champion_baseline`).

Every version is judged against the fixed bare reference ("B" = the version won). Among versions that beat the
reference, a later one replaces the champion only by winning a direct arbitration against it; ties never advance
the champion, and rounds whose arbitration is missing (older than the current version) leave it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

BASELINE_WIN = "B"


def baseline_key(version: int) -> str:
    """Key of version k's verdict against the reference in the RHI ledger."""
    return f"v{version}_vs_no_harness"


def arbitration_key(champion: int, challenger: int) -> str:
    """Key of an arbitration between the champion and a challenger in the champion ledger."""
    return f"champion_v{champion}_vs_v{challenger}"


@dataclass(frozen=True)
class ChampionState:
    """The champion after considering versions 0..current.

    `arbitration_needed`: the current version beat the reference, a champion with a reference win exists, and no
    arbitration between them is recorded yet — one more judge call (champion as A, current as B) decides.
    """

    champion: int
    has_win: bool
    arbitration_needed: bool = False

    @property
    def retained(self) -> int | None:
        """The scoreboard champion: the champion if it ever beat the reference, else none."""
        return self.champion if self.has_win else None


def derive_champion(
    baseline: Mapping[int, str],
    arbitration: Mapping[tuple[int, int], str],
    current: int,
) -> ChampionState:
    """Resolve the champion from the verdicts of versions 0..current.

    `baseline` maps a version to its verdict against the reference (A, B, tie or invalid); `arbitration` maps
    (champion, challenger) to the arbitration verdict (B = the challenger won).
    """
    champion = 0
    has_win = baseline.get(0) == BASELINE_WIN
    for version in range(1, current + 1):
        if baseline.get(version) != BASELINE_WIN:
            continue
        if not has_win:
            champion, has_win = version, True
            continue
        decided = arbitration.get((champion, version))
        if decided is not None:
            if decided == BASELINE_WIN:
                champion = version
        elif version == current:
            return ChampionState(champion, has_win, arbitration_needed=True)
    return ChampionState(champion, has_win)
