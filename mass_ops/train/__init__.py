"""LoRA SFT on DeepSpeed ZeRO-3: arguments, window data, sampler, schedule, loss, trainer, launch and checkpoints.

Importing this package is cheap: torch, DeepSpeed and PEFT are imported only by `loss` and `trainer`.
"""
