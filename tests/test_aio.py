import asyncio

from unicache.aio import cancel_and_wait


async def test_cancel_and_wait_stops_a_task_that_swallows_one_cancellation():
    swallowed = []

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if not swallowed:  # what gh-86296 does to a wait_for-based loop, once
                    swallowed.append(True)
                    continue
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], timeout_s=5.0) == set()
    assert task.cancelled() and swallowed == [True]


async def test_cancel_and_wait_reports_tasks_that_never_stop():
    holding = [True]

    async def immortal():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if holding[0]:
                    continue
                raise

    task = asyncio.create_task(immortal())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], timeout_s=0.3) == {task}
    holding[0] = False
    assert await cancel_and_wait([task], timeout_s=1.0) == set()
