"""Runs in the training processes: snapshots into /dev/shm, the optimizer-overlap watch, the SIGTERM
agreement, loading the newest complete state, the agent client, and the
trainer-side helpers adapters call. Adapters talk to ``checkpointer.Checkpointer``."""
