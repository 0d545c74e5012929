"""The hostile inputs of scripts/hostile_check.py, by kind: command lines and job configs (cli), request lines of a
job (lines), Python API calls (api), requests to a running server (http) and files through its Batch API (batch).
None repeats a case of tests/test_bad_input_corpus.py or tests/test_bad_gguf_metadata.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Case:
    """One hostile input: make(fixtures, the case's own empty folder) gives what is run, by kind: cli, argv; lines,
    the bad request lines (dicts or raw strings); api, a call of no arguments; http, an Http; batch, a BatchFile.
    expect "ok" where the input is odd but valid and must simply work; accept: exception types (beside
    OffloadError) that are a clean answer to an API call (Python's own TypeError for an unknown keyword)."""

    kind: str
    name: str
    make: Callable
    expect: str = "error"
    accept: tuple[str, ...] = ()


def cases(kind: str, table: dict) -> list[Case]:
    """Cases of one kind from {name: make} or {name: (make, expect)}."""
    out = []
    for name, entry in table.items():
        make, expect = entry if isinstance(entry, tuple) else (entry, "error")
        out.append(Case(kind, name, make, expect))
    return out


def _all() -> list[Case]:
    from hostile_cases import api_cases, cli_cases, http_cases, line_cases

    return [*cli_cases.CASES, *line_cases.CASES, *api_cases.CASES, *http_cases.CASES, *http_cases.BATCH_CASES]


ALL_CASES = _all()
