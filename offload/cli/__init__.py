"""The command line: one module per command (generate, plan, calibrate, run, validate); main.py builds it."""
