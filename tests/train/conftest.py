"""Fixtures of the training tests: a tiny Qwen3-architecture model and window files rendered with the real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.train import window_record, write_jsonl  # noqa: F401 - used by the fixtures below

# Short agent turns a 2-layer model can memorise in a few dozen LoRA steps: (task, role, assistant text).
TURNS: tuple[tuple[int, str, str], ...] = (
    (
        51,
        "orchestrator",
        "Plan: the data analyst loads the macro surprises, then the model architect fits the "
        "nowcast, then the backtesting engineer runs the SPY timing signal.",
    ),
    (51, "worker", "Loaded 412 monthly macro surprise rows into data/macro.parquet and verified no gaps remain."),
    (53, "orchestrator", "Delegate the FOMC event study to the analyst, then verify the two-day window report."),
    (53, "auxiliary", "Summary so far: the announcement windows are built and the drift estimates are pending."),
    (202, "orchestrator", "Stage one: featurize the interfaces. Stage two: train the contact predictor."),
    (202, "worker", "Computed residue contact maps for 96 complexes and saved them to data/contacts.npy."),
)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a random-weight Qwen3ForCausalLM (hidden 128, 2 layers, bf16) with the real Qwen3 tokenizer."""
    from mass_ops.models.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3") / "model")


@pytest.fixture(scope="session")
def chat_windows(tiny_qwen3: Path) -> list[dict]:
    """One window per turn, rendered with the model's own (real Qwen3) chat template; only the assistant turn
    (after the generation prompt, through <|im_end|>) is supervised, as render does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    records = []
    for index, (task, role, text) in enumerate(TURNS):
        messages = [
            {"role": "system", "content": f"You are the {role} of the research team on task {task}."},
            {"role": "user", "content": f"Report on stage {index} of the pipeline."},
        ]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = tokenizer(prompt + text + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids
        labels = [-100] * len(prompt_ids) + ids[len(prompt_ids) :]
        labels[-1] = -100  # the newline after <|im_end|> is not the model's to predict
        records.append(window_record(ids, labels, task=task, role=role, episode=f"t{task}_L0_s{710000 + index}"))
    return records
