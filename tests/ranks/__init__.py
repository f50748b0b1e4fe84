"""Multi-rank tests over the real transports (shared memory, TCP, network namespaces), on
``pycoll.testing``'s pooled or fresh rank processes."""
