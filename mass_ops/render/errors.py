"""The one exception the renderer raises for bad input."""

from __future__ import annotations

from mass_ops.errors import InputError


class RenderError(InputError):
    """A proxy log, prompt or conversation cannot be rendered; the message is one line naming where and why."""
