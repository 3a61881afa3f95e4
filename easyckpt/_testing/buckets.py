"""Internal: removing a scratch bucket of the object-store tests and benchmarks, objects and unfinished uploads
first (a bucket is deleted only empty). Not part of the public API."""
from __future__ import annotations

from easyckpt.storage.s3 import S3Storage


def drop_bucket(storage: S3Storage, bucket: str) -> None:
    """Every object of ``bucket``, its unfinished multipart uploads, then the bucket itself; closes ``storage``."""
    try:
        for page in storage.c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                storage.c.delete_object(Bucket=bucket, Key=obj["Key"])
        storage.abort_uploads(f"s3://{bucket}")
        storage.c.delete_bucket(Bucket=bucket)
    finally:
        storage.close()
