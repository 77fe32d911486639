"""Launching runs: the CLI's commands that start roles, on one host or many (launcher, cluster plans, workers, hostfiles, ranks, child processes, sweeps, preflight checks, shipped configs)."""
