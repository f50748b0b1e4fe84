"""pycoll's own test kit, shipped so that tests of a backend built on pycoll, or of a new
transport, can run what pycoll's tests run (as trio ships ``trio.testing``):

- ``ranks``: ``run_ranks(fn, world, ...)`` runs ``fn(rank, world, *args)`` on a reused pool
  of rank processes (forkserver, torch preloaded), each with a fresh c10d Store and, when
  asked, an initialised default group; the first failure or a timeout kills every rank.
  ``fresh``: ``launch(fn, world, ...)`` for ranks that may die or hang on purpose (fault
  tests): fresh processes from the same forkserver, each optionally in a network namespace,
  every one reaped whatever happens. ``spawn``: ``run(target, world, *args)`` for the tools and
  the CLI (demo, cuda-bench, tools/*.py): fresh processes around a Store this process hosts,
  values by rank, a failing or dying rank failing the run at once.
- ``reference``: the whole-world reference of every collective, and ``run_case``, which runs
  any algorithm's schedules on in-memory ranks and compares each rank with it.
- ``conformance``: what every transport must do (ordering, deadlines, abort, sever, close,
  peer death), one ``check_*(maker)`` each; ``worlds`` builds connected transports of every
  kind for them (``memory_world``, ``tcp_world``, ``shm_world``) and checks for leaks.
- ``memory``: an in-memory transport (optionally in lockstep, to find deadlocks); the
  algorithms' unit tests run on it, world sizes 1 to 9.
- ``mailbox_transport`` and ``mailbox``: a point-to-point transport over shared-memory
  mailboxes (the collectives of one host run on ``transport.shm.arena`` instead).

Nothing below the command line (``pycoll.cli``) imports this package.
"""
