"""Runs in the node agent: one process per (job, node), started by the first local rank, that persists
and commits the trainers' snapshots. Never imports torch or anything under ``easyckpt.engine``."""
