"""Write `rendered_prompts.json`: the text every case of `cases.py` builds with the code on the import path.

The committed fixture was generated from the string-building code before the prompt texts became templates:

    git worktree add /tmp/mass-ops-old 8266ed7
    PYTHONPATH=/tmp/mass-ops-old:. python tests/prompts/generate_fixtures.py   # cases.py from this tree

Run against today's code it only reproduces what the templates render, so regenerate it only on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.prompts.cases import prompt_cases

FIXTURE = Path(__file__).with_name("rendered_prompts.json")


def main() -> None:
    rendered = {name: build() for name, build in prompt_cases().items()}
    payload = {"generated_from": "mass-ops commit 8266ed7 (prompts built by Python strings)", "prompts": rendered}
    FIXTURE.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(rendered)} prompts written to {FIXTURE}")


if __name__ == "__main__":
    main()
