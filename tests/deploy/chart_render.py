"""Render the mass-ops chart with Helm's own template engine and validate the result as Kubernetes objects.

Rendering uses `helm-python-sdk` (import name `helm_python`): Helm 4's Go SDK compiled into a shared library that
the package loads with ctypes, so no `helm` binary is involved, and values are checked against values.schema.json
exactly as `helm install` would. Validation uses `kubernetes-validate`'s strict schemas of one pinned Kubernetes
release.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mass-ops"
KUBERNETES_VERSION = "1.33.0"
DEFAULT_RELEASE = "mass-ops"
DEFAULT_NAMESPACE = "mass-ops"


@dataclass(frozen=True)
class RenderedChart:
    """The manifests of one render (NOTES.txt kept apart)."""

    manifests: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        """The single manifest of `kind` (named `name`, if given); fails loudly when there is not exactly one."""
        found = [m for m in self.of_kind(kind) if name is None or m["metadata"]["name"] == name]
        if len(found) != 1:
            names = [m["metadata"]["name"] for m in self.of_kind(kind)]
            raise AssertionError(f"expected one {kind} {name or ''}, rendered: {names}")
        return found[0]

    def names(self) -> set[tuple[str, str]]:
        return {(m["kind"], m["metadata"]["name"]) for m in self.manifests}


def render_chart(
    values: dict[str, Any] | None = None,
    *,
    release: str = DEFAULT_RELEASE,
    namespace: str = DEFAULT_NAMESPACE,
) -> RenderedChart:
    """Render the chart as `helm template` would; invalid values raise `helm_python.HelmValuesError`."""
    with helm_python.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values or {}, name=release, namespace=namespace, is_install=True)
    manifests: list[dict[str, Any]] = []
    notes = ""
    for template, text in sorted(rendered.items()):
        if template.endswith("NOTES.txt"):
            notes = text
            continue
        for document in yaml.safe_load_all(text):
            if document is None:
                continue
            if not isinstance(document, dict) or "kind" not in document:
                raise AssertionError(f"{template} rendered something that is not a Kubernetes object: {document!r}")
            manifests.append(document)
    return RenderedChart(manifests=manifests, notes=notes)


def validate_manifest(manifest: dict[str, Any]) -> None:
    """Raise `kubernetes_validate.ValidationError` unless `manifest` is valid (strict: no unknown fields)."""
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
