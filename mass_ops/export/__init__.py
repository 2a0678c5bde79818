"""Export of a trained generation: LoRA merge into the BF16 base, then block-wise FP8 for serving (MASS_SPEC §9).

Both steps stream shard by shard and publish their output folder atomically; ``merge_and_export_fp8`` runs them as
one pass with the same results. ``ExportError`` (a ``ValueError``) names the tensor, file or folder at fault.
"""

from mass_ops.export.fp8 import (
    Fp8Info,
    Fp8Verification,
    TensorCheck,
    dequantize_blockwise,
    export_fp8,
    quantize_blockwise,
    verify_fp8,
)
from mass_ops.export.merge import LoraAdapter, MergeInfo, merge_lora, read_adapter
from mass_ops.export.safetensors_io import ExportError
from mass_ops.export.single_pass import merge_and_export_fp8

__all__ = [
    "ExportError",
    "Fp8Info",
    "Fp8Verification",
    "LoraAdapter",
    "MergeInfo",
    "TensorCheck",
    "dequantize_blockwise",
    "export_fp8",
    "merge_and_export_fp8",
    "merge_lora",
    "quantize_blockwise",
    "read_adapter",
    "verify_fp8",
]
