"""Differential fuzzing and the backend contract suite (needs ``writeback-core[testing]``)."""
