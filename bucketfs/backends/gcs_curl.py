"""GCS media downloads as http/curl.py transfers: the GCS backend's small GETs.

Why: as for S3 (http/curl.py's docstring), a small file's GET through requests and
google-auth on a worker thread costs several times the CPU of one on the curl
thread, and the daemon's CPU per file is the ceiling of an ImageFolder epoch.

What this module owns: the download URL (the library's, built once per bucket),
the request's headers (Range, raw encoding, the credentials' Authorization and
quota-project headers) and turning a finished transfer into an answer or the
google-api-core exception the backend's `classify` already knows. Retries,
generation checks and the fall-back to the library stay in gcs.py.

When it is not used (`usable` false): an mTLS session (its client certificate lives
in the library's adapter), or a proxy configured for the endpoint (requests honours
HTTP(S)_PROXY; a direct connection may not be allowed). Then every GET takes the
library's path, as without pycurl (gcs_transport.py's LibraryGets), and `off_reason`
says why.
"""

from __future__ import annotations

import os
import threading
from typing import Optional
from urllib.parse import quote

import google.auth.transport.requests
import requests
import requests.certs
import requests.utils
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from bucketfs.backends.http.curl import Transfer

_PLACEHOLDER_KEY = "bucketfs-placeholder"


def ca_bundle_path() -> str:
    """The certificates requests trusts by default: REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE,
    else certifi's bundle (a store behind a private CA is configured this way)."""
    return os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or requests.certs.where()


class CurlDownloads:
    """Media GETs of one bucket, for `client` (built by the backend)."""

    def __init__(self, client: storage.Client, bucket: storage.Bucket, read_timeout_s: float) -> None:
        # The library's URL for one object, less its name and query: the same host
        # (endpoint option, STORAGE_EMULATOR_HOST) and bucket path as its own GETs.
        placeholder_url = storage.Blob(_PLACEHOLDER_KEY, bucket)._get_download_url(client)
        self.base_url = placeholder_url.split("?", 1)[0][: -len(_PLACEHOLDER_KEY)]
        self.credentials = client._credentials
        self.anonymous = isinstance(self.credentials, AnonymousCredentials)
        self.read_timeout_s = read_timeout_s
        self._refresh_lock = threading.Lock()
        scheme = self.base_url.partition(":")[0]
        if getattr(client._http, "is_mtls", False):
            self.off_reason = "an mTLS session: its client certificate is the library's"
        elif requests.utils.get_environ_proxies(self.base_url).get(scheme):
            self.off_reason = f"a proxy is set for {self.base_url.split('/')[2]}"
        else:
            self.off_reason = ""
        self.usable = not self.off_reason

    def url(self, key: str, generation: int) -> str:
        # quote(safe=""): "/" in a name is part of it (the library's own quoting; "~" stays).
        return f"{self.base_url}{quote(key, safe='')}?alt=media&generation={generation}&ifGenerationMatch={generation}"

    def needs_token(self) -> bool:
        """Whether the credentials must be refreshed (blocking: refresh_blocking)
        before a transfer can carry them."""
        return not self.anonymous and not self.credentials.valid

    def refresh_blocking(self, force: bool = False) -> None:
        """A new token (one request to the token endpoint or the metadata server), on a
        worker thread; concurrent callers share it."""
        with self._refresh_lock:
            if force or not self.credentials.valid:
                self.credentials.refresh(google.auth.transport.requests.Request())

    def transfer(self, key: str, start: int, end: int, generation: int, buffer: bytearray) -> Transfer:
        """The GET of `[start, end)` of that generation into `buffer` (len end - start)."""
        # Accept-Encoding: gzip with no decoding (curl decodes only when asked to): an
        # object stored gzip-encoded comes back as stored, at its listed size.
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "gzip"}
        if not self.anonymous:
            self.credentials.apply(headers)  # Authorization, and x-goog-user-project if set
        return Transfer.ranged(self.url(key, generation), headers, buffer, start, self.read_timeout_s)


def refused(transfer: Transfer) -> gexc.GoogleAPICallError:
    """The exception the library would raise for this answer's status."""
    body = bytes(transfer.error_body).decode("utf-8", "replace").strip()
    return gexc.from_http_status(
        transfer.status, f"GET {transfer.url.split('?', 1)[0]}: {body[:300] or transfer.status}"
    )


def served_generation(transfer: Transfer) -> Optional[int]:
    """The generation the answer reports (`x-goog-generation`); None where the endpoint
    names none (the gcp-storage-emulator)."""
    served = transfer.headers.get("x-goog-generation")
    return int(served) if served else None
