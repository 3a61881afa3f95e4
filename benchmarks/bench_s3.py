"""S3 clients against one S3 server, in one run: which one easyckpt's object-store back-end should use.

    scripts/s3-server.sh start /tmp/easyckpt-s3      # or any S3-compatible endpoint and a key of it
    .venv/bin/python benchmarks/bench_s3.py --endpoint http://127.0.0.1:7480 --key K --secret S [--mib 256]

For an object of --mib MiB (random bytes, held in memory: what a snapshot slot is), it times, each --repeats
times in rotated order, the best run counted:

upload     easyckpt's S3Storage writer (boto3, parts of 64 MiB sent by 8 threads from the caller's buffer);
           boto3's own managed transfer (upload_fileobj, its default 8 MiB parts and 10 threads);
           obstore's put (its multipart upload, Rust, when obstore is installed)
download   S3Storage.read_ranges (64 MiB ranged GETs, 8 at a time); boto3's download_fileobj; obstore's
           get_ranges

and prints MB/s for each and the ratios against the fastest of its kind. The bucket it makes is removed.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from easyckpt._testing.buckets import drop_bucket  # noqa: E402
from easyckpt.storage.s3 import S3Storage  # noqa: E402


def best(fn: Callable[[], None], repeats: int, after: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        after()          # (untimed) what an upload made is deleted: a test server's store is small
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--secret", required=True)
    p.add_argument("--mib", type=int, default=256)
    # (scripts/s3-server.sh's memstore holds about twice what is stored, until the gateway's garbage collection
    # frees deleted objects: start it with S3_STORE_BYTES well above a few times --mib)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--part-mib", type=int, default=None, help="easyckpt's part size (default: storage/s3.py's)")
    args = p.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID=args.key, AWS_SECRET_ACCESS_KEY=args.secret, AWS_DEFAULT_REGION="us-east-1")
    s3 = S3Storage(endpoint_url=args.endpoint, **({"part_bytes": args.part_mib << 20} if args.part_mib else {}))
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    s3.c.create_bucket(Bucket=bucket)
    data = os.urandom(args.mib << 20)
    n = len(data)
    up: Dict[str, Callable[[], None]] = {}
    down: Dict[str, Callable[[], None]] = {}
    counter = [0]
    made: List[str] = []

    def key(name: str) -> str:
        counter[0] += 1
        made.append(f"{name}/{counter[0]}")
        return made[-1]

    def forget() -> None:
        while made:
            s3.c.delete_object(Bucket=bucket, Key=made.pop())

    def easy_up() -> None:
        w = s3.open_writer(f"s3://{bucket}/{key('easy')}")
        w.write_mapped(memoryview(data), 0, len(data))      # sent from data, not copied (as from a slot)
        w.finish()
        w.sync()
    up["easyckpt S3Storage (boto3)"] = easy_up
    # boto3's managed transfers through the same boto3 client (``s3.c`` wraps it: its calls take keywords only)
    up["boto3 upload_fileobj"] = lambda: s3.c._c.upload_fileobj(io.BytesIO(data), bucket, key("boto3"))
    s3.write_atomic(f"s3://{bucket}/src", data)          # (one PUT: up to 5 GiB)
    piece = 64 << 20
    ranges = [(o, min(piece, n - o)) for o in range(0, n, piece)]
    down["easyckpt S3Storage.read_ranges (boto3)"] = lambda: s3.read_ranges(f"s3://{bucket}/src", ranges)  # type: ignore[assignment,return-value]
    down["boto3 download_fileobj"] = lambda: s3.c._c.download_fileobj(bucket, "src", io.BytesIO())
    try:
        import obstore
        from obstore.store import S3Store
        store = S3Store(bucket, endpoint=args.endpoint, access_key_id=args.key, secret_access_key=args.secret,
                        region="us-east-1", client_options={"allow_http": True})
        up["obstore put"] = lambda: obstore.put(store, key("obstore"), memoryview(data), chunk_size=piece,
                                                max_concurrency=8)
        down["obstore get_ranges"] = lambda: obstore.get_ranges(  # type: ignore[assignment,return-value]
            store, "src", starts=[o for o, _ in ranges], lengths=[k for _, k in ranges])
    except ImportError:
        print("obstore is not installed: pip install obstore")
    try:
        for kind, cases in (("upload", up), ("download", down)):
            names: List[str] = list(cases)
            got = {name: best(cases[name], args.repeats, forget) for name in names}
            top = min(got.values())
            print(f"\n{kind} of {args.mib} MiB, best of {args.repeats}:")
            for name in names:
                print(f"  {name:<42} {got[name]:7.3f} s  {n / got[name] / 1e6:8.1f} MB/s  "
                      f"{top / got[name]:.2f} of the fastest")
    finally:
        drop_bucket(s3, bucket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
