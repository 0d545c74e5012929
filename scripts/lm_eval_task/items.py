"""The items of offload_mc50 (items.jsonl beside this file) as the task's dataset: no download, any working folder."""

from __future__ import annotations

import json
from pathlib import Path

ITEMS = Path(__file__).resolve().parent / "items.jsonl"


def load(**_) -> dict:
    """{'test': the items} as a datasets.Dataset (lm-eval's custom_dataset hook; metadata keywords ignored)."""
    import datasets

    rows = [json.loads(line) for line in ITEMS.read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
