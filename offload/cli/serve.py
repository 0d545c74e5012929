"""`offload serve`: plan and load a model once, then answer OpenAI-compatible HTTP requests (offload/serve/)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
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
    with bind_socket(options.host, options.port) as sock:  # before the model loads (minutes)
        lock = lock_state_dir(Path(options.state_dir)) if options.state_dir else None
        try:
            return _serve(config, api_key, sock)
        finally:
            if lock is not None:
                os.close(lock)


def _serve(config, api_key: str | None, sock: socket.socket) -> int:
    import uvicorn

    from offload.jobs.config import sampling_defaults
    from offload.jobs.device import check_gpu_is_here
    from offload.jobs.worker import load_llm
    from offload.serve.app import Server, make_app

    options = config.serve
    check_gpu_is_here(config)
    llm = load_llm(config)
    server = Server(llm, config.model.path, defaults=sampling_defaults(config), api_key=api_key,
                    max_waiting=options.max_waiting, state_dir=options.state_dir,
                    max_upload_bytes=options.max_upload_bytes, reasoning_parser=options.reasoning_parser,
                    tool_call_parser=options.tool_call_parser)
    logger.info(f"serving {config.model.path} at http://{options.host}:{options.port}/v1 "
                f"({'an API key is required' if api_key else 'no API key required'}); Ctrl-C stops it")
    level = logging.getLogger("offload").getEffectiveLevel()
    http = uvicorn.Server(uvicorn.Config(make_app(server), host=options.host, port=options.port,
                                         log_level="info" if level <= logging.INFO else "warning"))
    try:
        http.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM stop the server, which is its normal end (as uvicorn.run has it)
        pass
    if not http.started:
        raise ConfigError(f"offload serve stopped before it started answering at {options.host}:{options.port}; the "
                          f"lines above say why")
    return EXIT_OK


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for the server to listen on; ConfigError naming --host or --port when the
    address is not this machine's or the port is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"serve.host {host!r} is not an address this machine can listen on "
                          f"({getattr(e, 'strerror', None) or e}); give an IP address such as 127.0.0.1 or 0.0.0.0 "
                          f"(--host)") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a port in TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        fix = ("another program listens there: stop it, or give another --port" if e.errno == errno.EADDRINUSE
               else "this user may not listen there: give a --port above 1023" if e.errno == errno.EACCES
               else "give an address of this machine (--host), such as 127.0.0.1 or 0.0.0.0")
        raise ConfigError(f"offload serve cannot listen at {host}:{port} ({e.strerror}); {fix}") from None
    return sock


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
