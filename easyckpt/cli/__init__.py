"""Operator tools: ``easyckpt ls | inspect | verify | prune | convert | status | run``."""
from easyckpt.cli.main import main

__all__ = ["main"]
