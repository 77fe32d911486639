"""The in-process simulator: the sync engine driven with simulated learner speeds."""
