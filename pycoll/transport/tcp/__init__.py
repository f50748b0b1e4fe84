"""The TCP transport: connections, the data path, failure handling, the mesh and its handshake."""
