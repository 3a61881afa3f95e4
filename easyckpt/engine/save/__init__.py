"""What runs when a rank saves: taking a snapshot once the engine decided one is due (saver.py), the copy into a
shared-memory slot (snapshot.py) with its pinned buffers and background copy (pinned.py, background.py), its
overlap with the optimizer step (overlap.py), the snapshot budget and skipped snapshots (budget.py, skips.py),
the first snapshot's size estimate (estimate.py) and the RNG states saved beside the model (rng.py)."""
