"""Backends: one small async read-only interface per object store.

Only modules in this package import cloud SDKs.
"""

from bucketfs.backends.base import Backend, ListPage, ObjectInfo  # noqa: F401


def make_backend(config):
    """Build the backend for `config.url.scheme`; SDKs are imported only when needed."""
    if config.url.scheme == "s3":
        from bucketfs.backends.s3 import S3Backend

        return S3Backend(config)
    if config.url.scheme == "gs":
        from bucketfs.backends.gcs import GCSBackend

        return GCSBackend(config)
    raise ValueError(f"no backend for scheme {config.url.scheme!r}")


def check_options(config) -> None:
    """Refuse (errors.InvalidOption) what the store's SDK would refuse when the daemon
    builds its client, without building one: `mount --check` then catches it too."""
    if config.url.scheme == "s3" and config.region:
        from bucketfs.backends.s3 import check_region

        check_region(config.region)
