"""The command line's rooms: one module per `planner` subcommand with its arguments, its one-line
refusals and its tables (planner/cli.py builds the parser and dispatches). The engine they drive
lives beside this package in planner/ (search, probes, calibrate, validate)."""
