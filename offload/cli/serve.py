"""`offload serve`: plan and load a model once, then answer OpenAI-compatible HTTP requests (offload/serve/)."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from offload.cli.exits import EXIT_OK
from offload.cli.job_flags import add_serve_flags, effective_config
from offload.errors import ConfigError

logger = logging.getLogger("offload")

SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "python_multipart")  # the offload[serve] extra
API_KEY_ENV = "OFFLOAD_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP, as OpenAI's API (completions, chat, streaming)")
    add_serve_flags(p)
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    p.set_defaults(func=run, resumes=True)  # a stopped server's batches resume when it starts again


def run(args) -> int:
    config = effective_config(args, need_input=False)
    if args.print_config:
        print(config.to_yaml(), end="")
        return EXIT_OK
    check_serve_packages()
    options = config.serve
    api_key = options.api_key or os.environ.get(API_KEY_ENV) or None
    lock = lock_state_dir(Path(options.state_dir)) if options.state_dir else None
    try:
        return _serve(config, api_key)
    finally:
        if lock is not None:
            os.close(lock)


def _serve(config, api_key: str | None) -> int:
    import uvicorn

    from offload.jobs.config import sampling_defaults
    from offload.jobs.worker import load_llm
    from offload.serve.app import Server, make_app

    options = config.serve
    llm = load_llm(config)
    server = Server(llm, config.model.path, defaults=sampling_defaults(config), api_key=api_key,
                    max_waiting=options.max_waiting, state_dir=options.state_dir,
                    max_upload_bytes=options.max_upload_bytes)
    logger.info(f"serving {config.model.path} at http://{options.host}:{options.port}/v1 "
                f"({'an API key is required' if api_key else 'no API key required'}); Ctrl-C stops it")
    level = logging.getLogger("offload").getEffectiveLevel()
    uvicorn.run(make_app(server), host=options.host, port=options.port,
                log_level="info" if level <= logging.INFO else "warning")
    return EXIT_OK


def check_serve_packages() -> None:
    """ConfigError naming the extra when a package the server needs is missing."""
    import importlib.util

    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"offload serve needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                          f"not installed; install them with `pip install 'offload[serve]'`")


def lock_state_dir(folder: Path) -> int:
    """Create the state folder and hold its lock (a file descriptor) for the server's life; ConfigError if it
    cannot be written or another server holds it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / "serve.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise ConfigError(f"serve.state_dir {folder} cannot be used ({e.strerror}); give a folder this user can "
                          f"write (--state-dir)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"another offload serve uses the state folder {folder}; stop it, or give this one its "
                          f"own --state-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
