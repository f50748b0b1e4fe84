"""Shared memory: the arena of one host's ranks (segment, slots, futex barriers)."""
