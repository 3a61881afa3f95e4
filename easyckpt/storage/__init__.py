"""The save directory: the only code that writes, renames or deletes in it.

base.py (the Storage interface; its docstring gives the call order a back-end sees) · posix.py and
direct.py (the one implementation: POSIX file systems, O_DIRECT streaming) · savedir.py (SaveDir: the
names, listings and deletes of one save directory) · commit.py (the commit sequence) · retention.py (what
is pruned) · stepfiles.py (reading a step's manifest and listed files) · auditlog.py · joblock.py (one job per save directory). An object store is not implemented;
base.py says how it would fit.
"""
