"""READs of up to 4 MiB (bucketfs/fuse/requestsize.py): the receive buffer size is written
only where exactly one word after pyfuse3's table of operations holds libfuse's
default; anything else, and nothing is written. (A real mount's READ sizes:
tests/integration/test_large_reads.py.)"""

import ctypes

import pytest

from bucketfs.fuse.noopendir import LOWLEVEL_OPS, POINTER_BYTES, PYFUSE3_OPS
from bucketfs.fuse.requestsize import BUFSIZE_SEARCH_BYTES, LIBFUSE_DEFAULT_BUFFER_BYTES, bufsize_field

pytestmark = pytest.mark.timeout(30)

TABLE_OFFSET_BYTES = 40  # where libfuse 3.14 puts it
HANDLER = 0x5000  # a pointer "inside pyfuse3's code"
CODE = [(HANDLER, HANDLER + 1)]


def fake_session(defaults_at: list) -> tuple:
    """A struct fuse_session as libfuse 3 lays it out: a header, pyfuse3's table, then
    fields, with libfuse's default buffer size at these word offsets after the table."""
    words = (TABLE_OFFSET_BYTES + len(LOWLEVEL_OPS) * POINTER_BYTES + BUFSIZE_SEARCH_BYTES) // POINTER_BYTES + 8
    memory = (ctypes.c_size_t * words)()
    first = TABLE_OFFSET_BYTES // POINTER_BYTES
    for i, name in enumerate(LOWLEVEL_OPS):
        memory[first + i] = HANDLER if name in PYFUSE3_OPS else 0
    after = first + len(LOWLEVEL_OPS)
    memory[after + 3] = 1 << 20  # (a field near the value: not it)
    for offset in defaults_at:
        memory[after + offset] = LIBFUSE_DEFAULT_BUFFER_BYTES
    return memory, ctypes.addressof(memory) + after * POINTER_BYTES


@pytest.mark.skipif(POINTER_BYTES != 8, reason="the search reads 64-bit words")
def test_the_buffer_size_is_the_one_word_holding_libfuses_default():
    memory, fields = fake_session([100])
    assert bufsize_field(ctypes.addressof(memory), CODE) == fields + 100 * POINTER_BYTES


@pytest.mark.skipif(POINTER_BYTES != 8, reason="the search reads 64-bit words")
@pytest.mark.parametrize("defaults_at", [[], [40, 100]], ids=["none", "two"])
def test_no_word_or_two_words_holding_the_default_find_nothing(defaults_at):
    memory, _ = fake_session(defaults_at)
    assert bufsize_field(ctypes.addressof(memory), CODE) is None


def test_no_table_of_pyfuse3s_finds_nothing():
    memory, _ = fake_session([100])
    assert bufsize_field(ctypes.addressof(memory), [(HANDLER + 8, HANDLER + 9)]) is None
