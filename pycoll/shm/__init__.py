"""What runs on one host: the ranks of a group that share a machine meet in shared memory.

- ``arena.py``: the memfd segment every local rank maps (no name in /dev/shm: nothing to leak),
  double-buffered staging slots, and futex barriers whose waits poll only while no task waits
  for a core (``transport/spin.py``); ``segment.py`` maps it, ``futex.py`` waits and wakes.
- ``algorithms.py``, ``rounds.py``: every collective over the arena's slots, in rounds of at
  most one slot a rank (a 1 GiB tensor needs no 1 GiB of shared memory).
- ``heap.py``, ``registered.py``: registered memory (``pycoll.empty_shared``, DDP's buckets),
  where tensors live in the shared segment and collectives work on them in place.
- ``shared.py``: the public side of registered memory (``empty_shared``, ``shared_scratch``).
- ``links.py``: point-to-point between the ranks of the host, a ring of bytes per ordered
  pair that the point-to-point engine reads and writes (``transport/tcp/p2p_local.py``).

``core/setup.py`` decides when a group runs here (``choose_mode``); across hosts the
hierarchical mode reduces here, then between host leaders over TCP (``core/collectives.py``).
"""
