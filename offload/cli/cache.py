"""`offload cache list|clear`: the packed weights offload keeps under $OFFLOAD_CACHE/packed (weights/cache.py)."""

from __future__ import annotations

import time
from pathlib import Path

from offload.errors import ConfigError
from offload.hardware import format_bytes


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="list or clear the packed (quantized) weights kept from earlier loads")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="each cached entry: model, format, size, date; and the total")
    clear = actions.add_parser("clear", help="remove every cached entry, or those of one model")
    clear.add_argument("--model", help="remove only the entries of this model (folder or Hub id)")
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.weights.cache import list_entries, packed_root

    entries = list_entries()
    if args.action == "list":
        print_entries(entries, packed_root())
        return 0
    if args.model is not None:
        model = model_key(args.model)
        chosen = [e for e in entries if e.model == model]
        if not chosen:
            known = ", ".join(sorted({e.model for e in entries})) or "none"
            where = "" if model == args.model else f" ({model})"
            raise ConfigError(f"no packed weights are cached for {args.model}{where}; cached models: {known} "
                              f"(`offload cache list` shows them)")
    else:
        chosen = entries
    return clear(chosen)


def model_key(model: str) -> str:
    """The model path entries record: the resolved folder (a Hub id's snapshot), or the absolute path as given
    when it no longer exists (its entries can still be cleared)."""
    from offload.errors import WeightsError
    from offload.weights.default_model import resolve_model

    try:
        return str(resolve_model(model).resolve())
    except WeightsError:  # a Hub id no longer in the Hugging Face cache
        return str(Path(model).expanduser().resolve())


def clear(entries) -> int:
    from offload.weights.cache import remove_entry

    removed = [e for e in entries if remove_entry(e)]
    kept = len(entries) - len(removed)
    busy = f"; {kept} being written by a running offload kept" if kept else ""
    print(f"removed {len(removed)} entries ({format_bytes(sum(e.n_bytes for e in removed))}){busy}")
    return 0


def print_entries(entries, root: Path) -> None:
    for e in entries:
        state = "" if e.complete else "  (incomplete: being written, or left by a crash)"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created_s))
        print(f"{e.model}  {e.quantization} {e.dtype}{' tiled' if e.tiled else ''}  {format_bytes(e.n_bytes)}  "
              f"{when}{state}")
    print(f"{len(entries)} entries, {format_bytes(sum(e.n_bytes for e in entries))} in {root}")

