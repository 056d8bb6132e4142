"""The memory budget's order among reads waiting for memory (no backend, no FUSE)."""

import collections

import pytest
import trio
import trio.testing

from bucketfs.core.memory import DEMAND_WAIT_MAX_S, MemoryBudget

MiB = 1024 * 1024
CAPACITY_BYTES = 8 * MiB


def run(body):
    """Run `body(budget, granted)` on a mock clock, the whole budget held by someone
    else; `granted` lists the names of demands in the order they got memory."""
    budget = MemoryBudget(CAPACITY_BYTES, collections.Counter(), demand_headroom_bytes=1 * MiB)
    budget._take(CAPACITY_BYTES)
    granted = []

    async def main():
        with trio.fail_after(DEMAND_WAIT_MAX_S / 2):  # a wait this long would be an overcommit, not an order
            return await body(budget, granted)

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)), budget


def demand(budget, granted, name, n_bytes):
    async def task():
        await budget.reserve(n_bytes)
        granted.append(name)

    return task


def test_the_oldest_waiting_read_is_served_first():
    """Woken together, waiters raced for each release: a smaller, later one took the
    freed bytes and the oldest READ waited on (16-19 s on a real mount at 16 MiB)."""

    async def body(budget, granted):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(demand(budget, granted, "old", 6 * MiB))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(demand(budget, granted, "young", 4 * MiB))
            await trio.testing.wait_all_tasks_blocked()
            budget.release(4 * MiB)  # enough for the young one only
            await trio.testing.wait_all_tasks_blocked()
            assert granted == []
            budget.release(4 * MiB)
            await trio.testing.wait_all_tasks_blocked()
            assert granted == ["old"]
            budget.release(6 * MiB)
        return granted

    granted, budget = run(body)
    assert granted == ["old", "young"] and budget.stats["memory.overcommits"] == 0


def test_a_new_read_does_not_take_memory_an_older_waiting_read_needs():
    async def body(budget, granted):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(demand(budget, granted, "old", 6 * MiB))
            await trio.testing.wait_all_tasks_blocked()
            budget.release(4 * MiB)
            nursery.start_soon(demand(budget, granted, "new", 1 * MiB))
            await trio.testing.wait_all_tasks_blocked()
            assert granted == []  # 4 MiB free: 1 MiB would leave the oldest 3 of its 6
            budget.release(3 * MiB)  # 7 free: the old one's 6 and the new one's 1
            await trio.testing.wait_all_tasks_blocked()
        return granted

    granted, budget = run(body)
    assert sorted(granted) == ["new", "old"] and budget.stats["memory.overcommits"] == 0  # (either order: both fit)


def test_a_new_read_takes_what_the_oldest_waiting_read_leaves():
    async def body(budget, granted):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(demand(budget, granted, "old", 6 * MiB))
            await trio.testing.wait_all_tasks_blocked()
            budget.release(CAPACITY_BYTES)  # the old one is woken, and has not run yet
            await demand(budget, granted, "new", 2 * MiB)()  # 2 MiB beside its 6: at once
        return granted

    granted, budget = run(body)
    assert granted == ["new", "old"] and budget.used_bytes == CAPACITY_BYTES


def test_read_ahead_takes_nothing_while_a_read_waits():
    async def body(budget, granted):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(demand(budget, granted, "read", 8 * MiB))
            await trio.testing.wait_all_tasks_blocked()
            budget.release(2 * MiB)  # 1 MiB would fit read-ahead's limit (capacity less the headroom)
            refused = not budget.try_reserve(1 * MiB)
            budget.release(6 * MiB)
        return refused

    refused, budget = run(body)
    assert refused and budget.stats["memory.prefetch_refused"] == 1
    assert budget.try_reserve(1 * MiB) is False  # (the read holds the whole budget now)


def test_a_cancelled_oldest_read_hands_its_turn_on():
    """Nothing is released when the oldest waiter goes: the next must be woken by its going."""

    async def body(budget, granted):
        async with trio.open_nursery() as nursery:
            old_scope = trio.CancelScope()

            async def old():
                with old_scope:
                    await demand(budget, granted, "old", 6 * MiB)()

            nursery.start_soon(old)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(demand(budget, granted, "young", 4 * MiB))
            await trio.testing.wait_all_tasks_blocked()
            budget.release(4 * MiB)
            await trio.testing.wait_all_tasks_blocked()
            assert granted == []
            old_scope.cancel()
        return granted

    granted, budget = run(body)
    assert granted == ["young"] and budget.stats["memory.overcommits"] == 0


@pytest.mark.parametrize("cancelled", ["older", "younger"])
def test_a_cancelled_waiter_leaves_only_its_own_place(cancelled):
    """Two waiters asking the same size: removing one by equality dropped the other's
    place and left the cancelled one's as a ghost the survivor waited behind."""

    async def body(budget, granted):
        scopes = {"older": trio.CancelScope(), "younger": trio.CancelScope()}

        def waiter(name):
            async def task():
                with scopes[name]:
                    await demand(budget, granted, name, 4 * MiB)()

            return task

        async with trio.open_nursery() as nursery:
            for name in ("older", "younger"):
                nursery.start_soon(waiter(name))
                await trio.testing.wait_all_tasks_blocked()
            scopes[cancelled].cancel()
            await trio.testing.wait_all_tasks_blocked()
            budget.release(4 * MiB)
        return granted

    granted, budget = run(body)
    survivor = "younger" if cancelled == "older" else "older"
    assert granted == [survivor] and budget.stats["memory.overcommits"] == 0
