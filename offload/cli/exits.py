"""Exit codes of the `offload` command (README, "The command line"): what a script running it can branch on."""

EXIT_OK = 0  # done; for `offload run`, every request in the output has an answer
EXIT_ERROR = 2  # bad input or a failure, said in one line on stderr; for a job, the answers written are kept
EXIT_FAILED_REQUESTS = 3  # `offload run` finished, but some requests are error lines in the output
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): finished answers flushed, report written
EXIT_TERMINATED = 143  # SIGTERM: the same as Ctrl-C
