"""Structured outputs on the default model: 20 JSON schemas x 5 prompts, each answer parsed and validated.

The schemas are written as users write them (nested objects, arrays, enums, required fields, numbers with bounds,
strings without a maxLength); each is asked for through a chat with response_format's json_schema, as OpenAI's
client sends it (LLM.chat with the same structured output), with --max-tokens room (default 256). An answer counts
as good when it ends with finish_reason "stop", parses with json.loads and validates with jsonschema; an answer cut
by max_tokens ("length") counts as a failure. Runs greedy and, with --temperature, sampled too; prints each
failure's schema, prompt and reason, then the count of good answers of each run.

  python scripts/check_schemas.py [--model default] [--max-tokens 256] [--temperature 1.0]
  python scripts/check_schemas.py --smoke    # a tiny random model, 3 schemas x 2 prompts, 96 tokens
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _obj(required: list[str] | None = None, **props) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS = {
    "person": _obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 130}),
    "address": _obj(street=S, city=S, zip={"type": "string", "pattern": "^[0-9]{5}$"}),
    "user with address": _obj(name=S, address=_obj(city=S, country=S)),
    "order": _obj(id=I, items={"type": "array", "items": _obj(sku=S, qty={"type": "integer", "minimum": 1}),
                               "minItems": 1, "maxItems": 4}),
    "color enum": _obj(color={"enum": ["red", "green", "blue"]}),
    "status and code": _obj(status={"enum": ["ok", "error", "pending"]}, code={"type": "integer", "minimum": 100,
                                                                                "maximum": 599}),
    "rating": _obj(score={"type": "number", "minimum": 0, "maximum": 5}, comment=S),
    "tags": _obj(tags={"type": "array", "items": S, "minItems": 1, "maxItems": 5}),
    "flags": _obj(active=B, verified=B, admin=B),
    "optional fields": _obj(["title"], title=S, subtitle=S, pages=I),
    "coordinates": _obj(lat={"type": "number", "minimum": -90, "maximum": 90},
                        lon={"type": "number", "minimum": -180, "maximum": 180}),
    "book": _obj(title=S, author=_obj(first=S, last=S), year={"type": "integer", "minimum": 1400, "maximum": 2030}),
    "matrix": _obj(rows={"type": "array", "items": {"type": "array", "items": I, "minItems": 2, "maxItems": 2},
                         "minItems": 2, "maxItems": 2}),
    "event": _obj(name=S, date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                  attendees={"type": "integer", "minimum": 0}),
    "product": _obj(name=S, price={"type": "number", "exclusiveMinimum": 0}, currency={"enum": ["USD", "EUR"]},
                    in_stock=B),
    "weather": _obj(city=S, temperature_c={"type": "number", "minimum": -60, "maximum": 60},
                    conditions={"enum": ["sunny", "cloudy", "rain", "snow"]}),
    "team": _obj(team=S, members={"type": "array", "items": _obj(name=S, role={"enum": ["lead", "dev", "qa"]}),
                                  "minItems": 1, "maxItems": 3}),
    "answer": _obj(answer={"enum": ["yes", "no"]}, confidence={"type": "number", "minimum": 0, "maximum": 1}),
    "recipe": _obj(dish=S, servings={"type": "integer", "minimum": 1, "maximum": 12},
                   steps={"type": "array", "items": S, "minItems": 1, "maxItems": 3}),
    "nullable note": _obj(["id"], id=I, note={"type": ["string", "null"]}),
}
PROMPTS = ["Describe a typical example as JSON.", "Give me one record about a small town in Spain.",
           "Make up a plausible entry for a library database.", "Answer in JSON about your favourite thing.",
           "Fill this in for a customer named Ada."]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="model folder, .gguf file or 'default'")
    p.add_argument("--max-tokens", type=int, default=256, help="room each answer has")
    p.add_argument("--temperature", type=float, default=None, help="also run sampled at this temperature")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, 3 schemas x 2 prompts, 96 tokens")
    return p.parse_args(argv)


def failure(output, schema: dict) -> str | None:
    """Why an answer is not a valid instance of schema, or None."""
    import jsonschema

    if output.finish_reason != "stop":
        return f"finish_reason {output.finish_reason}"
    try:
        jsonschema.validate(json.loads(output.text), schema)
    except json.JSONDecodeError as e:
        return f"does not parse: {e}"
    except jsonschema.ValidationError as e:
        return f"does not validate: {e.message}"
    return None


def run(llm, schemas: dict, prompts: list[str], max_tokens: int, temperature: float) -> int:
    """Good answers of every schema x prompt, the failures printed."""
    from offload import SamplingParams

    asks = [(name, prompt) for name in schemas for prompt in prompts]
    chats = [[{"role": "user", "content": f"{prompt} Reply with JSON for: {name}."}] for name, prompt in asks]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                             structured_outputs={"json": schemas[name]}) for i, (name, _) in enumerate(asks)]
    good = 0
    for (name, prompt), out in zip(asks, llm.chat(chats, params)):
        why = failure(out.outputs[0], schemas[name])
        good += why is None
        if why is not None:
            print(f"  FAIL {name!r} / {prompt!r}: {why}; answer {out.outputs[0].text[:120]!r}")
    print(f"temperature {temperature}: {good} of {len(asks)} answers parse and validate "
          f"({len(schemas)} schemas x {len(prompts)} prompts, max_tokens {max_tokens})")
    return good


def main(argv=None) -> int:
    args = parse_args(argv)
    from offload import LLM

    schemas, prompts = SCHEMAS, PROMPTS
    if args.smoke:
        sys.path.insert(0, str(HERE))
        from make_llama import tiny

        folder = tiny(Path(tempfile.mkdtemp(prefix="check-schemas-")) / "tiny", vocab=259, tokenizer=True)
        args.model, args.max_tokens = str(folder), 96
        schemas, prompts = {k: SCHEMAS[k] for k in ("color enum", "flags", "answer")}, PROMPTS[:2]
    llm = LLM(args.model, batch_size=16, max_model_len=1024)
    runs = [0.0] + ([args.temperature] if args.temperature is not None else [])
    good = [run(llm, schemas, prompts, args.max_tokens, t) for t in runs]
    return 0 if all(g == len(schemas) * len(prompts) for g in good) or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
