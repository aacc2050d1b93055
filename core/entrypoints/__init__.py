"""Command-line entry points run by `deepinfer <command>` (see deepinfer.cli)."""
