"""Runs in the training processes: the Checkpointer adapters talk to (checkpointer.py) and the engine under
it (session.py, over the seams of seams.py), snapshots into /dev/shm, the optimizer-overlap watch, the
SIGTERM agreement, loading the newest complete state, the agent client."""
