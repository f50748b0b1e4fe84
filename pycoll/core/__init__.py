"""The engine: communicator, set-up, executor, collectives, reductions, tuner, callbacks."""
