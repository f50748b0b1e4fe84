"""Observers of the engine: tracing, clocks, straggler statistics, hang dumps, fault injection."""
