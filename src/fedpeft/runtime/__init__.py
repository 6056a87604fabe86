"""Runtimes: how server and client halves are run (embedded = one process)."""
