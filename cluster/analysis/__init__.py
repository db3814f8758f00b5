"""Analyses over many runs or around one: comparisons, sweeps and their trials, loss
landscapes."""
