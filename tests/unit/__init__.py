"""In-process unit tests: algorithms on the in-memory transport, frames, kernels, and the
repository's own rules (layers, settings, doc paths)."""
