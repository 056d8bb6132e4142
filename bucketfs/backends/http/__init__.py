"""HTTP plumbing the S3 and GCS backends share, under their SDKs: receiving bodies
within a deadline (body.py), small GETs on libcurl's multi interface (curl.py), the
checksums of bodies as they arrive (checksums.py) and the SigV4 signer of S3's lean
GETs and LISTs (sigv4.py).

These modules move and sign bytes only: retries, version checks and the checks of
an answer stay with the backends (base.py, calls.py). Nothing here imports a cloud
SDK or another part of bucketfs.backends.
"""
