"""The fast ListObjectsV2 page reader gives what ElementTree gives, or steps aside."""

import pytest

from bucketfs.backends.s3_lean import _parse_fast, _parse_tree, parse_list_page

NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


def page(
    contents: str,
    prefixes: str = "",
    encoding: str = "<EncodingType>url</EncodingType>",
    truncated: str = "<IsTruncated>false</IsTruncated>",
    root_attrs: str = NS,
) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult {root_attrs}>'
        f"<Name>b</Name><Prefix>p/</Prefix><KeyCount>3</KeyCount><MaxKeys>1000</MaxKeys>"
        f"<Delimiter>/</Delimiter>{encoding}{truncated}{contents}{prefixes}</ListBucketResult>"
    ).encode()


AWS_OBJECT = (
    "<Contents><Key>{key}</Key><LastModified>2024-05-01T10:20:30.123Z</LastModified>"
    "<ETag>&quot;{etag}&quot;</ETag><ChecksumAlgorithm>CRC32</ChecksumAlgorithm><Size>{size}</Size>"
    "<Owner><ID>abc</ID><DisplayName>me</DisplayName></Owner><StorageClass>STANDARD</StorageClass></Contents>"
)
COMPACT_OBJECT = (  # (as MinIO and rclone write them)
    "<Contents><Key>{key}</Key><LastModified>2024-05-01T10:20:30.5Z</LastModified>"
    "<ETag>&quot;{etag}&quot;</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
)
REORDERED_OBJECT = (
    "<Contents>\n  <Size>{size}</Size>\n  <ETag>{etag}</ETag>\n  <Key>{key}</Key>\n"
    "  <LastModified>2024-05-01T10:20:30Z</LastModified>\n</Contents>"
)

PAGES = {
    "aws, url-encoded keys": page(
        AWS_OBJECT.format(key="p/a%20b%2Bc.jpg", etag="e1", size=5)
        + AWS_OBJECT.format(key="p/%C3%A9t%C3%A9.jpg", etag="e2", size=0)
        + AWS_OBJECT.format(key="p/x%26y%3C.jpg", etag="e3-2", size=12345678901),
        "<CommonPrefixes><Prefix>p/sub%20dir/</Prefix></CommonPrefixes><CommonPrefixes><Prefix>p/z/</Prefix></CommonPrefixes>",
    ),
    "no encoding type: XML escapes": page(
        AWS_OBJECT.format(key="p/a&amp;b&lt;c&#62;.jpg", etag="e", size=7)
        + AWS_OBJECT.format(key="p/&amp;copy;", etag="f", size=8),
        encoding="",
    ),
    "fields in another order": page(
        REORDERED_OBJECT.format(key="p/k1", etag="a", size=1) + REORDERED_OBJECT.format(key="p/k2", etag="b", size=2)
    ),
    "compact entries": page(
        COMPACT_OBJECT.format(key="p/k1", etag="a", size=1) + COMPACT_OBJECT.format(key="p/k%202", etag="b", size=2)
    ),
    # (The entries written without a gap are found first; the page is read whole again
    # when one is not among them.)
    "compact entries, and one with a checksum among them": page(
        COMPACT_OBJECT.format(key="p/k1", etag="a", size=1)
        + AWS_OBJECT.format(key="p/k2", etag="b", size=2)
        + COMPACT_OBJECT.format(key="p/k3", etag="c", size=3)
    ),
    "truncated with a token": page(
        AWS_OBJECT.format(key="p/k", etag="e", size=1),
        truncated="<IsTruncated>true</IsTruncated><NextContinuationToken>tok/+=</NextContinuationToken>",
    ),
    "empty": page(""),
    "prefixes only": page("", "<CommonPrefixes><Prefix>p/a/</Prefix></CommonPrefixes>"),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", sorted(PAGES))
def test_fast_reader_matches_elementtree(name):
    body = PAGES[name]
    fast = _parse_fast(body)
    assert fast is not None, "a plain page must take the fast path"
    assert fast == _parse_tree(body)


def test_decoded_values():
    objects, prefixes, token, truncated = parse_list_page(PAGES["aws, url-encoded keys"])
    assert [o[0] for o in objects] == ["p/a b+c.jpg", "p/été.jpg", "p/x&y<.jpg"]
    assert [o[1] for o in objects] == [5, 0, 12345678901]
    assert objects[0][2] == 1714558830123000000  # ns since the epoch, UTC
    assert objects[0][3] == '"e1"'
    assert prefixes == ["p/sub dir/", "p/z/"]
    assert (token, truncated) == (None, False)
    objects, *_ = parse_list_page(PAGES["no encoding type: XML escapes"])
    assert [o[0] for o in objects] == ["p/a&b<c>.jpg", "p/&copy;"]
    assert parse_list_page(PAGES["truncated with a token"])[2:] == ("tok/+=", True)


@pytest.mark.parametrize(
    "body",
    [
        # A namespace prefix on every tag: only a real XML parser reads it.
        page(
            "<s3:Contents><s3:Key>p/k</s3:Key><s3:LastModified>2024-05-01T10:20:30Z</s3:LastModified>"
            "<s3:ETag>e</s3:ETag><s3:Size>1</s3:Size></s3:Contents>"
        )
        .replace(b"<ListBucketResult", b"<s3:ListBucketResult")
        .replace(b"</ListBucketResult", b"</s3:ListBucketResult")
        .replace(b'xmlns="', b'xmlns:s3="'),
        page(
            "<Contents><Key><![CDATA[p/k]]></Key><LastModified>2024-05-01T10:20:30Z</LastModified>"
            "<ETag>e</ETag><Size>1</Size></Contents>"
        ),
        page("<Contents><Key>p/k</Key><Size>1</Size></Contents>"),  # no LastModified: not a shape we know
    ],
)
def test_unusual_pages_go_to_elementtree(body):
    assert _parse_fast(body) is None


def _flat_page(keys, url_encoded: bool, pretty: bool) -> bytes:
    import hashlib
    import urllib.parse

    sep = "\n  " if pretty else ""

    def written(key: str) -> str:
        if url_encoded:
            return urllib.parse.quote(key, safe="/")
        return key.replace("&", "&amp;").replace("<", "&lt;")

    items = "".join(
        f"<Contents>{sep}<Key>{written(key)}</Key>{sep}<LastModified>2026-11-27T10:00:00.000Z</LastModified>"
        f"<ETag>&quot;{hashlib.md5(key.encode()).hexdigest()}&quot;</ETag><Size>1</Size></Contents>"
        for key in keys
    )
    tail = "<EncodingType>url</EncodingType>" if url_encoded else ""  # (after the entries, as rclone writes it)
    return (
        f'<?xml version="1.0"?><ListBucketResult xmlns="x"><IsTruncated>true</IsTruncated>{items}{tail}'
        "</ListBucketResult>"
    ).encode()


def test_a_flat_page_cut_at_an_end_keeps_exactly_the_keys_up_to_it():
    """cut_page_at (index build's ranges): random pages and ends, every escaping."""
    import random

    from bucketfs.backends.s3_lean import cut_page_at, parse_page_until

    rng = random.Random(38)
    for _ in range(3000):
        alphabet = rng.choice(["ab%+&é z<", "ab", "abcdefghij0123456789", "aé😀"])
        keys = sorted(
            {
                "p/" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 8)))
                for _ in range(rng.randrange(0, 40))
            }
        )
        body = _flat_page(keys, url_encoded=rng.random() < 0.8, pretty=rng.random() < 0.3)
        end = "p/" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 6)))
        objects, _prefixes, _token, truncated = parse_page_until(body, end)
        kept = [key for key in keys if key <= end]
        if cut_page_at(body, end) is None:
            assert kept == keys and [o[0] for o in objects] == keys and truncated
        else:
            assert [o[0] for o in objects] == kept and not truncated, (keys, end)
