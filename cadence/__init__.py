"""Cadence's composition root: the `cadence` command wires engines, aligner and gateway together."""
