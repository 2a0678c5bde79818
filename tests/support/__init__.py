"""Helpers shared by test modules, imported as a library (`from tests.support.<topic> import …`).

Fixtures stay in conftest modules, which may import from here; no test module imports a conftest.
"""
