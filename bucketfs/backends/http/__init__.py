"""HTTP plumbing the S3 and GCS backends share, under their SDKs: small GETs on
libcurl's multi interface (curl.py) and the SigV4 signer of S3's lean GETs and
LISTs (sigv4.py).

These modules move and sign bytes only: retries, version checks and the checks of
an answer stay with the backends. Nothing here imports a cloud SDK.
"""
