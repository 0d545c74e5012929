"""`offload plan` and `offload validate` are arithmetic over config.json and the hardware profile: on a shipped
model config they import neither torch nor transformers (checked by sys.modules, not by the clock)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import child_env

CHECK = """
import json, sys
from offload.cli.main import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""
PLAN = ["plan", "--model", "llama-3.1-70b", "--hardware", "rtx4090-ddr5", "--gpu-memory", "22GiB",
        "--quantization", "q4_0"]


def _run(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHECK, *argv], capture_output=True, text=True, env=child_env(),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plan_imports_neither_torch_nor_transformers():
    assert _run(PLAN) == {"code": 0, "heavy": []}
    assert _run([*PLAN, "--json", "--explain"]) == {"code": 0, "heavy": []}


def test_validate_of_token_prompts_imports_neither(tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": [1, 2, 3], "max_tokens": 4}}) + "\n")
    assert _run(["validate", *PLAN[1:], "--input", str(requests)]) == {"code": 0, "heavy": []}
