"""Store timeouts and retries: environment variables with documented defaults, refused when unusable."""

from __future__ import annotations

import pytest

from mass_ops.errors import InputError
from mass_ops.store.timeouts import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_STATEMENT_TIMEOUT_S,
    StoreSettingError,
    StoreTimeouts,
)


def test_defaults_when_unset():
    limits = StoreTimeouts.from_env({})
    assert limits == StoreTimeouts(
        DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, DEFAULT_MAX_ATTEMPTS, DEFAULT_STATEMENT_TIMEOUT_S
    )


def test_values_from_the_environment_reach_both_clients():
    limits = StoreTimeouts.from_env(
        {
            "MASS_STORE_CONNECT_TIMEOUT_S": "2.5",
            "MASS_STORE_READ_TIMEOUT_S": "7",
            "MASS_STORE_MAX_ATTEMPTS": "4",
            "MASS_STORE_STATEMENT_TIMEOUT_S": "0",
        }
    )
    config = limits.botocore_config(max_pool_connections=12)
    assert (config.connect_timeout, config.read_timeout, config.max_pool_connections) == (2.5, 7.0, 12)
    assert config.retries == {"total_max_attempts": 4, "mode": "standard"}
    args = limits.postgres_connect_args()
    assert args["connect_timeout"] == 3  # libpq takes whole seconds: rounded up, never down to "forever"
    assert args["tcp_user_timeout"] == 7000
    assert limits.statement_timeout_ms == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MASS_STORE_CONNECT_TIMEOUT_S", "0"),
        ("MASS_STORE_CONNECT_TIMEOUT_S", "ten"),
        ("MASS_STORE_READ_TIMEOUT_S", "-1"),
        ("MASS_STORE_READ_TIMEOUT_S", "inf"),
        ("MASS_STORE_MAX_ATTEMPTS", "0"),
        ("MASS_STORE_MAX_ATTEMPTS", "2.5"),
        ("MASS_STORE_MAX_ATTEMPTS", "1000"),
        ("MASS_STORE_STATEMENT_TIMEOUT_S", "nan"),
    ],
)
def test_unusable_values_are_one_input_error_naming_the_variable(name: str, value: str):
    with pytest.raises(StoreSettingError, match=name) as caught:
        StoreTimeouts.from_env({name: value})
    assert isinstance(caught.value, InputError) and "\n" not in str(caught.value)
