"""Sampling: the parameters users pass (`params`, torch-free), penalties, counter-based randomness, and a step's
sampling and acceptance per row (`sampling`, on top of spec_decode's acceptance rules)."""
