"""Runs in the training processes: snapshots into /dev/shm, the optimizer-overlap watch, the SIGTERM
agreement, loading the newest complete state, and the agent client. Adapters talk to ``session``."""
