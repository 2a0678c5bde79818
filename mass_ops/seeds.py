"""Every seed formula of a MASS cycle, in one place (MASS_SPEC §1, §3, §6, §10).

Seeds make a rerun reproduce the reference run: an episode's seed goes to qwen-code's sampling params, a judge or
optimizer call's seed to the chat request. An attempt retried after an infrastructure failure keeps its unit's seed;
a judge call retried because its answer was not a usable verdict gets a derived seed (`judge_retry_seed`), since a
deterministic server would repeat the same unusable answer.
"""

from __future__ import annotations

import hashlib
import random
from datetime import date


def reference_episode_seed(search_seed_base: int, task_id: int) -> int:
    """RHI reference (bare-task) episode of task q: seed_base + q."""
    return search_seed_base + task_id


def version_episode_seed(search_seed_base: int, task_id: int, version: int) -> int:
    """RHI episode of workflow version k of task q: seed_base + q + 1000·k."""
    return search_seed_base + task_id + 1000 * version


def search_call_seed(search_seed_base: int, task_id: int) -> int:
    """Optimizer and in-loop judge calls of task q all use seed_base + q."""
    return search_seed_base + task_id


def collection_seed(collection_seed_base: int, task_id: int, candidate: int) -> int:
    """Teacher candidate i of task q: seed_base + 100·q + i."""
    return collection_seed_base + 100 * task_id + candidate


# Derived seeds stay below 2**31: every server accepts them, whatever integer width it parses seeds into.
JUDGE_RETRY_SEED_BITS = 31


def judge_retry_seed(seed: int | None, retry: int) -> int | None:
    """Sampling seed of a judge call whose unit seed is `seed` after `retry` unusable answers (0, 1, 2, …).

    `retry` is the number of attempts of the unit already recorded ``invalid``, across runs. Retry 0 uses the unit's
    seed itself, so a first answer that is a usable verdict is exactly the reference's; retry r ≥ 1 uses the first
    four bytes of SHA-256(``"<seed>/judge-retry/<r>"``) read big-endian, masked to 31 bits: a fresh, reproducible
    seed that no other formula here produces except by chance. An attempt that failed on infrastructure does not
    count, so it is retried with the same seed (ARCHITECTURE: units and retries). No seed (OpenRouter and external
    judges send none) stays none.
    """
    if retry < 0:
        raise ValueError(f"judge retry numbers start at 0, got {retry}")
    if seed is None or retry == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/judge-retry/{retry}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & ((1 << JUDGE_RETRY_SEED_BITS) - 1)


def schedule_seed(ranking_seed: int, task_id: int) -> int:
    """Seed of task q's tournament schedule: ranking.seed + q."""
    return ranking_seed + task_id


def match_seed(ranking_seed: int, task_id: int, match_index: int) -> int:
    """Seed of the i-th self-judge match of task q: ranking.seed + 1000·q + i."""
    return ranking_seed + 1000 * task_id + match_index


def rollout_seed(rollout_seed_base: int, task_id: int, replicate: int) -> int:
    """Evaluation rollout i of task q: 910000 + 100·q + i in the paper preset."""
    return rollout_seed_base + 100 * task_id + replicate


# The next cycle's search and collection seed bases move one stride (cycle2: 450000 → 1450000, 710000 → 1710000).
SEED_BASE_STRIDE = 1_000_000


def next_cycle_seed_base(seed_base: int) -> int:
    """The seed base of the same stage in the next cycle (MASS_SPEC §2 cycle2)."""
    return seed_base + SEED_BASE_STRIDE


NIGHTLY_SEED_STRIDE = 100_000  # above every rollout seed offset (100·task + replicate)
NIGHTLY_SEED_PERIOD = 20_000  # days; keeps every nightly seed below 2**31


def nightly_rollout_seed_base(rollout_seed_base: int, night: date) -> int:
    """The rollout seed base of the nightly evaluation of calendar day `night` (UTC): fresh samples every night,
    the same ones whenever that night is rerun or backfilled, never the cycle's own rollout seeds."""
    days = (night - date(2000, 1, 1)).days % NIGHTLY_SEED_PERIOD
    return rollout_seed_base + NIGHTLY_SEED_STRIDE * (1 + days)


def presentation_swapped(judge_seed: int) -> bool:
    """Whether an external judge sees the pair swapped: random.Random(seed).choice([False, True])."""
    return random.Random(judge_seed).choice([False, True])


# The reference gives indices to tb2, sab, ds and mlr only (MASS_SPEC §10); swe and asta, which it never packaged,
# take the next free ones, so their seeds never collide with the others'.
BENCHMARK_INDEX = {"tb2": 0, "sab": 1, "ds": 2, "mlr": 3, "swe": 4, "asta": 5}


def benchmark_seed(benchmark: str, trial: int, task_index: int) -> int:
    """Benchmark episode seed, shared across generations for paired comparison: 3,100,000 + b·10,000 + t·1,000 + i."""
    return 3_100_000 + BENCHMARK_INDEX[benchmark] * 10_000 + trial * 1_000 + task_index
