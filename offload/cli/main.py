"""The `offload` command line: generate, plan, simulate, calibrate, run, validate, serve, cache, eval-kl.
Errors print one line unless --debug."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading

from offload import __version__
from offload.cli import cache, calibrate, eval_kl, generate, plan, run, serve, simulate, validate
from offload.cli.exits import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_TERMINATED
from offload.environment import environment_help
from offload.errors import OffloadError

# each adds its parser: add_parser(sub)
COMMANDS = (generate, plan, simulate, calibrate, run, validate, serve, cache, eval_kl)
LOG_LEVELS = ("debug", "info", "warning", "error")
SYMLINK_LOOP = "Symlink loop from "  # pathlib's RuntimeError for ELOOP: "Symlink loop from '<path>'"


class Parser(argparse.ArgumentParser):
    """argparse's parser (each command's too) with its errors as one line, without the usage block, and a value
    that starts with "-" and a digit taken as a value (`--cpu-memory -5GiB` reaches the option's own check)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d")  # argparse's: which "-..." words are values

    def error(self, message: str, prog: str | None = None):
        self.exit(2, f"offload: error: {message}; see `{prog or self.prog} --help`\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but words no command takes are named with the help of the command they followed."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            self.error(f"unrecognized arguments: {' '.join(extra)}", f"{self.prog} {command}" if command else None)
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="offload", description=__doc__, epilog=environment_help(),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"offload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for p in (parser, *sub.choices.values()):  # the global options, also after the subcommand
        top = p is parser
        p.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                       help="show tracebacks (and debug logs)")
        p.add_argument("--quiet", "-q", action="store_true", default=False if top else argparse.SUPPRESS,
                       help="log warnings and errors only (answers, plans and reports still print)")
        p.add_argument("--log-level", choices=LOG_LEVELS, default=None if top else argparse.SUPPRESS,
                       help="how much offload logs to stderr (default info)")
    return parser


def setup_logging(args) -> None:
    """offload's messages go to stderr through logging; stdout carries answers, plans and reports."""
    level = args.log_level or ("debug" if args.debug else "warning" if args.quiet else "info")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("offload: %(message)s"))
    logger = logging.getLogger("offload")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    warnings_logger.handlers[:] = [handler]
    warnings_logger.propagate = False


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it unwinds like Ctrl-C (flush, report, clean up)."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args)
    in_main = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    try:
        return args.func(args)
    except OffloadError as e:
        if args.debug:
            raise
        print(f"offload: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # a file the specific checks did not foresee: still one line
        if args.debug:
            raise
        where = f" ({e.filename})" if e.filename else ""
        print(f"offload: error: {e.strerror or e}{where}; check that path and the space left on its disk",
              file=sys.stderr)
        return EXIT_ERROR
    except RuntimeError as e:  # pathlib before Python 3.13 reports a symlink loop so, not as an OSError (ELOOP)
        if args.debug or not str(e).startswith(SYMLINK_LOOP):
            raise
        print(f"offload: error: {str(e).removeprefix(SYMLINK_LOOP)} is a symlink loop (a link that leads back to "
              f"itself); point it at a file, or give another path", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        kept = "; finished work is kept, rerun to resume" if getattr(args, "resumes", False) else ""
        terminated = isinstance(e, Terminated)
        print(f"offload: {'terminated (SIGTERM)' if terminated else 'interrupted'}{kept}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
