"""ListObjectsV2 pages from different servers read to the same keys, sizes and versions."""

import pytest

from bucketfs.backends.s3_lean import parse_list_page

NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


def page(contents: str, prefixes: str = "", encoding: str = "<EncodingType>url</EncodingType>",
         truncated: str = "<IsTruncated>false</IsTruncated>", root_attrs: str = NS) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult {root_attrs}>'
            f"<Name>b</Name><Prefix>p/</Prefix><KeyCount>3</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<Delimiter>/</Delimiter>{encoding}{truncated}{contents}{prefixes}</ListBucketResult>").encode()


AWS_OBJECT = ("<Contents><Key>{key}</Key><LastModified>2024-05-01T10:20:30.123Z</LastModified>"
              "<ETag>&quot;{etag}&quot;</ETag><ChecksumAlgorithm>CRC32</ChecksumAlgorithm><Size>{size}</Size>"
              "<Owner><ID>abc</ID><DisplayName>me</DisplayName></Owner><StorageClass>STANDARD</StorageClass></Contents>")
REORDERED_OBJECT = ("<Contents>\n  <Size>{size}</Size>\n  <ETag>{etag}</ETag>\n  <Key>{key}</Key>\n"
                    "  <LastModified>2024-05-01T10:20:30Z</LastModified>\n</Contents>")

AWS_PAGE = page(
    AWS_OBJECT.format(key="p/a%20b%2Bc.jpg", etag="e1", size=5)
    + AWS_OBJECT.format(key="p/%C3%A9t%C3%A9.jpg", etag="e2", size=0)
    + AWS_OBJECT.format(key="p/x%26y%3C.jpg", etag="e3-2", size=12345678901),
    "<CommonPrefixes><Prefix>p/sub%20dir/</Prefix></CommonPrefixes><CommonPrefixes><Prefix>p/z/</Prefix></CommonPrefixes>")


@pytest.mark.timeout(10)
def test_url_encoded_page_decodes_keys_prefixes_sizes_and_times():
    objects, prefixes, token, truncated = parse_list_page(AWS_PAGE)
    assert [o[0] for o in objects] == ["p/a b+c.jpg", "p/été.jpg", "p/x&y<.jpg"]
    assert [o[1] for o in objects] == [5, 0, 12345678901]
    assert objects[0][2] == 1714558830123000000  # ns since the epoch, UTC
    assert [o[3] for o in objects] == ['"e1"', '"e2"', '"e3-2"']
    assert prefixes == ["p/sub dir/", "p/z/"]
    assert (token, truncated) == (None, False)


@pytest.mark.timeout(10)
def test_page_without_encoding_type_unescapes_xml():
    body = page(AWS_OBJECT.format(key="p/a&amp;b&lt;c&#62;.jpg", etag="e", size=7)
                + AWS_OBJECT.format(key="p/&amp;copy;", etag="f", size=8), encoding="")
    assert [o[0] for o in parse_list_page(body)[0]] == ["p/a&b<c>.jpg", "p/&copy;"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("body", [
    page(REORDERED_OBJECT.format(key="p/k", etag="e", size=1)),  # fields in another order
    # A namespace prefix on every tag, and CDATA: other servers' spellings of the same page.
    page("<s3:Contents><s3:Key>p/k</s3:Key><s3:LastModified>2024-05-01T10:20:30Z</s3:LastModified>"
         "<s3:ETag>e</s3:ETag><s3:Size>1</s3:Size></s3:Contents>").replace(b"<ListBucketResult", b"<s3:ListBucketResult")
    .replace(b"</ListBucketResult", b"</s3:ListBucketResult").replace(b'xmlns="', b'xmlns:s3="'),
    page("<Contents><Key><![CDATA[p/k]]></Key><LastModified>2024-05-01T10:20:30Z</LastModified>"
         "<ETag>e</ETag><Size>1</Size></Contents>"),
], ids=["reordered", "prefixed", "cdata"])
def test_other_spellings_of_one_object(body):
    assert parse_list_page(body) == ([("p/k", 1, 1714558830000000000, "e")], [], None, False)


@pytest.mark.timeout(10)
def test_truncated_page_gives_its_token_and_empty_pages_read():
    body = page(AWS_OBJECT.format(key="p/k", etag="e", size=1),
                truncated="<IsTruncated>true</IsTruncated><NextContinuationToken>tok/+=</NextContinuationToken>")
    assert parse_list_page(body)[2:] == ("tok/+=", True)
    assert parse_list_page(page("")) == ([], [], None, False)
    assert parse_list_page(page("", "<CommonPrefixes><Prefix>p/a/</Prefix></CommonPrefixes>"))[1] == ["p/a/"]
