"""Trainers: the EAGLE-3 training step, bootstrap and online trainers."""
