"""Test infrastructure that tests/ and scripts/ share: real S3-compatible servers
(rclone, moto; `servers`), the GCS emulator and a GCS-like adapter (`gcs_server`,
served over HTTP by `http_front`), proxies that count or break requests
(`counting_proxy`, `fault_proxy`, `s3_fronts`) and the mount harness (`mounting`).

It is the top layer: it may import any part of bucketfs, and nothing in bucketfs
imports it. The runtime (the `bucketfs` command, the daemon, the fstab helper)
never imports `bucketfs.testing`, so the test-only packages it needs (moto,
requests, gcp-storage-emulator, cryptography, pytest...: the `test` extra in
pyproject.toml) are not dependencies of bucketfs itself. pytest fixtures stay in
tests/ (conftest.py files).
"""
