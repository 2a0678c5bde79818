"""Prompt templates (Jinja2): every text a model is sent — judge, optimizer, teacher prompt — shipped as package data
in ``templates/``; the config key ``prompts.dir`` replaces any of them by file name (see `library`)."""

from mass_ops.prompts.library import (
    PromptError,
    PromptSet,
    PromptTemplate,
    check_recorded,
    check_templates,
    load_prompts,
    shipped_prompts,
)
from mass_ops.prompts.specs import TEMPLATES, TemplateSpec

__all__ = [
    "TEMPLATES",
    "PromptError",
    "PromptSet",
    "PromptTemplate",
    "TemplateSpec",
    "check_recorded",
    "check_templates",
    "load_prompts",
    "shipped_prompts",
]
