"""The one exception the renderer raises for bad input."""

from __future__ import annotations


class RenderError(ValueError):
    """A proxy log, prompt or conversation cannot be rendered; the message is one line naming where and why."""
