"""Reading a listing index from a file or an object: `bucketfs mount --index
FILE-or-URL` (mount.serve) and `bucketfs index show`.

Invariants:
- Every way an index can be unusable is one line and its exit code: no such file or
  object, unreadable, not an index, damaged (checksum) -> 11; a format version this
  bucketfs does not read -> 12; the index of another URL -> 13. The store's own
  refusals while fetching it are mount's: 3 (no bucket), 4 (denied), 5 (unreachable).
- An index object is fetched with one HEAD and one GET pinned to the version the
  HEAD named (a LIST never); one rewritten between the two is fetched again.
- An index in another bucket of the same store is read with a backend of its own
  (the same options); one on another store (gs:// for an s3:// mount) is refused by
  Config (exit 2).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import trio

from bucketfs import errors
from bucketfs.backends import make_backend
from bucketfs.config import BucketURL, Config, is_url, parse_object_url
from bucketfs.core.listing_index import (
    FORMAT_VERSION,
    IndexOfAnotherURL,
    IndexProblem,
    ListingIndex,
    UnknownIndexVersion,
    decode_index,
)

FETCH_ATTEMPTS = 3  # an index object rewritten between its HEAD and its GET, again and again


def read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise errors.UserError(f"--index {path}: no such file", errors.EXIT_BAD_INDEX) from None
    except OSError as exc:
        raise errors.UserError(f"--index {path}: {exc.strerror}", errors.EXIT_BAD_INDEX) from None


async def _fetch_object(location: str, config: Config, backend) -> bytes:
    """The bytes of the index object at `location` (s3:// or gs://), through `backend`
    when it is in `config`'s bucket, else through a backend of its own."""
    scheme, bucket, key = parse_object_url(location)
    target = backend
    if backend is None or bucket != config.url.bucket:
        try:
            target = make_backend(dataclasses.replace(config, url=BucketURL(scheme, bucket, "")))
        except errors.BucketfsError as exc:
            raise errors.user_error_for(exc, location) from None
    try:
        for attempt in range(FETCH_ATTEMPTS):
            try:
                info = await target.stat(key)
                return await target.read_range(key, 0, info.size_bytes, info.version, object_bytes=info.size_bytes)
            except errors.NotFound:
                raise errors.UserError(f"--index {location}: no such object", errors.EXIT_BAD_INDEX) from None
            except errors.ObjectChanged:
                if attempt + 1 == FETCH_ATTEMPTS:
                    raise errors.UserError(
                        f"--index {location}: rewritten while it was read, {FETCH_ATTEMPTS} times",
                        errors.EXIT_BAD_INDEX,
                    ) from None
            except errors.BucketfsError as exc:
                raise errors.user_error_for(exc, f"--index {location}", bool(config.endpoint_url)) from None
        raise AssertionError("unreachable")
    finally:
        if target is not backend:
            with trio.CancelScope(shield=True):
                await target.aclose()


def decode(data: bytes, location: str, expected_url: Optional[str]) -> ListingIndex:
    """`data` decoded, or the UserError (and exit code) of its problem."""
    try:
        return decode_index(data, expected_url=expected_url, what=f"--index {location}")
    except UnknownIndexVersion as exc:
        raise errors.UserError(str(exc), errors.EXIT_INDEX_VERSION) from None
    except IndexOfAnotherURL as exc:
        raise errors.UserError(str(exc), errors.EXIT_INDEX_OTHER_URL) from None
    except IndexProblem as exc:
        raise errors.UserError(str(exc), errors.EXIT_BAD_INDEX) from None


async def load_index(location: str, config: Config, backend=None) -> ListingIndex:
    """The index at `location` (a file, or an object URL) for `config.url`: decoded,
    checked, and of that URL; UserError otherwise."""
    if is_url(location):
        data = await _fetch_object(location, config, backend)
    else:
        data = await trio.to_thread.run_sync(read_file, location)
    return decode(data, location, str(config.url))


def run_index_show(location: str, config: Optional[Config]) -> int:
    """`bucketfs index show FILE-or-URL`: check the index and print what it holds.
    `config`: the store options, for a URL (its `url` is the index's bucket)."""

    async def read() -> bytes:
        if not is_url(location):
            return await trio.to_thread.run_sync(read_file, location)
        assert config is not None
        return await _fetch_object(location, config, None)

    index = decode(trio.run(read), location, None)
    print(
        f"url: {index.url}\n"
        f"built at: {index.built_at}\n"
        f"objects: {index.objects_count:,} in {index.directories_count:,} directories\n"
        f"format version: {FORMAT_VERSION}; created by: {index.header.get('created_by') or '?'}",
        file=sys.stdout,
    )
    return errors.EXIT_OK
