"""Helpers shared by test modules, imported as a library (`from tests.support.<topic> import …`).

Fixtures that several folders use live in `tests/support/*_fixtures.py`; a folder's conftest imports the ones it
wants. Test modules import helpers only: never a conftest, never a fixture.
"""
