"""The save directory: the only code that writes, renames or deletes in it.

base.py (the Storage interface; its docstring gives the call order a back-end sees) · posix.py and
direct.py (POSIX file systems, O_DIRECT streaming) · savedir.py (SaveDir: the
names, listings and deletes of one save directory) · commit.py (the commit sequence) · retention.py (what
is pruned) · stepfiles.py (reading a step's manifest and listed files) · auditlog.py · joblock.py (one job per
save directory) · s3.py (an S3-compatible object store as a Storage back-end: conditional create, parallel
multipart uploads and ranged reads; s3writer.py: one object's multipart upload; s3client.py: URLs, the boto3
client, its failures as StoreError; objectread.py: a whole object read by parallel ranged GETs, shared by
object-store back-ends) · resolve.py (which back-end serves a path: the one parser of a URL's scheme) ·
storelock.py (one job per prefix on a store: a lease over the Versioned verbs).
"""
