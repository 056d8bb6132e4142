"""Connection slots by urgency: a call someone waits on never queues behind read-ahead."""

import threading

import trio
import trio.testing

from bucketfs import errors
from bucketfs.backends import slots
from bucketfs.backends.calls import BlockingCaller, RetryPolicy
from bucketfs.backends.memory import MemoryBackend
from tests.unit.helpers import read_all, resolve, run_fs

MiB = 1024 * 1024


class Ticket:
    def __init__(self, urgent=False):
        self.urgent = urgent


def never_transient(exc):
    return errors.BackendError(str(exc))


def test_urgent_calls_take_the_next_slot_before_older_speculative_ones():
    """One slot, held. Queued in this order: speculative A, speculative B, an urgent
    call, then speculative C whose ticket turns urgent while it waits. Freed slots go
    urgent first (the plain call, then C), then oldest first (A, B)."""
    caller = BlockingCaller(1, RetryPolicy(5, 0.1, 5.0), never_transient)
    release_first = threading.Event()
    ran = []

    def work(name):
        if name == "holder":
            release_first.wait(10)
        ran.append(name)

    async def call(name, ticket=None, task_status=trio.TASK_STATUS_IGNORED):
        if ticket is not None:
            slots.mark_speculative(ticket)
        task_status.started()
        await caller.call(name, work, name)

    async def main():
        c_ticket = Ticket()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "holder")
                await trio.testing.wait_all_tasks_blocked()
                for name, ticket in (("A", Ticket()), ("B", Ticket()), ("urgent", None), ("C", c_ticket)):
                    await nursery.start(call, name, ticket)
                    await trio.testing.wait_all_tasks_blocked()
                assert caller.slots.queued_count == 4
                c_ticket.urgent = True  # a reader started waiting on C's bytes
                release_first.set()
        return caller.slots.overtakes_count

    overtakes = trio.run(main)
    assert ran == ["holder", "urgent", "C", "A", "B"]
    assert overtakes == 2


def test_a_cancelled_waiter_leaves_the_queue_and_slots_stay_balanced():
    caller = BlockingCaller(1, RetryPolicy(5, 0.1, 5.0), never_transient)
    release_first = threading.Event()

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller.call, "holder", release_first.wait, 10)
                await trio.testing.wait_all_tasks_blocked()
                waiter_scope = trio.CancelScope()

                async def cancelled_waiter():
                    with waiter_scope:
                        await caller.call("gone", lambda: None)

                nursery.start_soon(cancelled_waiter)
                await trio.testing.wait_all_tasks_blocked()
                assert len(caller.slots._waiting) == 1
                waiter_scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                release_first.set()
            # Every call finished or left: no slot is held, nobody waits, and a new call
            # runs at once (a leaked slot would hang it until fail_after).
            after = await caller.call("after", lambda: "ran")
            return caller.slots.busy_count, len(caller.slots._waiting), after

    busy, waiting, after = trio.run(main)
    assert (busy, waiting, after) == (0, 0, "ran")


def test_the_core_marks_read_ahead_and_listings_ahead_as_speculative():
    """What the backend sees at each request: reads a caller waits for are urgent;
    read-ahead parts and listings ahead of a walk are speculative until waited on."""
    shard = bytes(range(256)) * (128 * 1024)  # 32 MiB
    tree = {f"classes/c{i:02d}/img.jpg": b"x" * 100 for i in range(12)}
    backend = MemoryBackend({"s/shard-0.tar": shard, "small.bin": b"y" * 1000, **tree})
    seen = []

    def hook(op, key):
        ticket = slots._SPECULATIVE.get()
        seen.append((op, key, ticket is None or ticket.urgent))

    backend.fail_hook = hook

    async def body(fs):
        assert await read_all(fs, "small.bin") == b"y" * 1000
        assert await read_all(fs, "s/shard-0.tar", chunk_bytes=1 * MiB) == shard
        for i in (0, 1):  # a walk: the rest of the classes are listed ahead of it
            await resolve(fs, f"classes/c{i:02d}/img.jpg")
        await trio.testing.wait_all_tasks_blocked()  # the listings ahead have run
        assert fs.stats["namespace.listed_ahead"] == 10

    run_fs(backend, body, small_file_bytes=1 * MiB)
    small_gets = [urgent for op, key, urgent in seen if op == "get" and key == "small.bin"]
    shard_gets = [urgent for op, key, urgent in seen if op == "get" and key == "s/shard-0.tar"]
    ahead_lists = [
        urgent for op, key, urgent in seen if op == "list" and key.startswith("classes/c") and key >= "classes/c02"
    ]
    assert small_gets == [True]
    assert len(shard_gets) >= 4 and shard_gets.count(False) >= 2
    assert len(ahead_lists) == 10 and not any(ahead_lists)
