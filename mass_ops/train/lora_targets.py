"""Which modules LoRA adapts (MASS_SPEC §8), and a summary of what a pattern picks on a given model.

The reference adapts, with PEFT, every module whose name fullmatches
`.*language_model.*\\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|out_proj)$`:
the attention, MLP and linear-attention (Gated DeltaNet) projections of the language model of a Qwen3.5/3.6
multimodal checkpoint, never the vision tower. `lora_target_pattern` builds the pattern mass-ops uses from a list of
projection names: on a multimodal model it matches exactly the modules the reference regex matches (its first
alternative *is* the reference's), and on a text-only Qwen3-family model (`model.layers.N…`, where the reference regex
would match nothing) it matches the same projections of the decoder layers. MTP heads (`mtp.…`) and vision towers
(`model.visual.…`) are matched by neither alternative.

Importing this module is cheap (no torch); `summarize_lora_targets` works on any `torch.nn.Module`, including one
built on the meta device or partitioned by ZeRO-3 (it reads `in_features`/`out_features`, not weight shapes).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mass_ops.config import DEFAULT_LORA_TARGETS
from mass_ops.errors import InputError

# The reference's projections (attention q/k/v/o, MLP gate/up/down, linear attention in_proj_qkv/z and out_proj):
# the config's default, named once there.
REFERENCE_TARGET_MODULES = DEFAULT_LORA_TARGETS
# The reference's regex, verbatim (MASS_SPEC §8); kept for comparison and for runs that want exactly it.
REFERENCE_TARGET_PATTERN = (
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|out_proj)$"
)
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LoraTargetError(InputError):
    """A target list or pattern that cannot be used; the message names it and why."""


def lora_target_pattern(modules: Sequence[str] = REFERENCE_TARGET_MODULES) -> str:
    """The regex PEFT fullmatches against module names to adapt the projections named in `modules`.

    Multimodal checkpoints: anything under `language_model` ending in one of the names (the reference's rule).
    Text-only checkpoints: the same names inside `model.layers.N`. Vision towers and MTP heads never match.
    """
    names = list(modules)
    if not names or not all(isinstance(m, str) and _MODULE_NAME.match(m) for m in names):
        raise LoraTargetError(f"LoRA target modules must be a non-empty list of module names (got {modules!r})")
    leaves = "|".join(dict.fromkeys(names))
    return rf"(?:.*language_model.*|model\.layers\..*)\.(?:{leaves})$"


@dataclass(frozen=True)
class LoraTargetSummary:
    """What a target pattern adapts on one model: modules per projection name and the adapter's size.

    `adapter_parameters` = Σ r·(in_features + out_features) over the adapted modules (lora_A is r×in, lora_B out×r);
    `lora_tensors` = 2 per adapted module. `linear_not_adapted` counts the Linear modules left alone, by name, so a
    log shows at a glance that e.g. the vision tower and in_proj_a/in_proj_b stay frozen.
    """

    pattern: str
    lora_r: int
    modules: int
    by_kind: dict[str, int]
    adapter_parameters: int
    lora_tensors: int
    linear_modules: int
    linear_not_adapted: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (lora_targets.json, the train_log metadata row, a metadata DB row)."""
        return asdict(self)

    def describe(self) -> str:
        """One log line: `50 modules (in_proj_qkv 6, …), 2 123 456 adapter parameters`."""
        kinds = ", ".join(f"{name} {count}" for name, count in self.by_kind.items())
        return (
            f"LoRA adapts {self.modules} of {self.linear_modules} Linear modules ({kinds}); "
            f"{self.adapter_parameters} adapter parameters in {self.lora_tensors} tensors (r={self.lora_r})"
        )


def summarize_lora_targets(model: Any, pattern: str, *, lora_r: int) -> LoraTargetSummary:
    """Match `pattern` (fullmatch, as PEFT does for a string) against `model.named_modules()`.

    Raises `LoraTargetError` when the pattern is not a regex or matches a module LoRA cannot wrap here (a matched
    module that is not a Linear would make PEFT fail later, deep inside a distributed start).
    """
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise LoraTargetError(f"LoRA target pattern {pattern!r} is not a valid regex ({exc})") from None
    by_kind: Counter[str] = Counter()
    not_adapted: Counter[str] = Counter()
    parameters = 0
    linear = 0
    for name, module in model.named_modules():
        # nn.Linear (also under ZeRO-3's zero.Init, which keeps the class and its feature sizes).
        is_linear = hasattr(module, "in_features") and hasattr(module, "out_features")
        leaf = name.rsplit(".", 1)[-1]
        if not compiled.fullmatch(name):
            if is_linear:
                linear += 1
                not_adapted[_kind_outside(name)] += 1
            continue
        if not is_linear:
            raise LoraTargetError(
                f"LoRA target pattern matches {name} ({type(module).__name__}), which is not a Linear module"
            )
        linear += 1
        by_kind[leaf] += 1
        parameters += lora_r * (int(module.in_features) + int(module.out_features))
    ordered = {name: by_kind[name] for name in sorted(by_kind, key=_kind_order)}
    return LoraTargetSummary(
        pattern=pattern,
        lora_r=lora_r,
        modules=sum(by_kind.values()),
        by_kind=ordered,
        adapter_parameters=parameters,
        lora_tensors=2 * sum(by_kind.values()),
        linear_modules=linear,
        linear_not_adapted=dict(sorted(not_adapted.items())),
    )


def _kind_order(name: str) -> tuple[int, str]:
    try:
        return REFERENCE_TARGET_MODULES.index(name), name
    except ValueError:
        return len(REFERENCE_TARGET_MODULES), name


def _kind_outside(name: str) -> str:
    """How a frozen Linear is counted: vision/MTP towers as a whole, decoder projections by their own name."""
    parts = name.split(".")
    for tower in ("visual", "vision_tower", "vision_model", "mtp"):
        if tower in parts:
            return tower
    return parts[-1]
