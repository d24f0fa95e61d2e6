import asyncio

from unicache.plumbing.aio import cancel_and_wait


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


async def _unretrieved_after_cancel(call) -> list[str]:
    """Cancel a task awaiting (through ``call``) a Redis-like read that, when cancelled,
    fails with ConnectionError (the server went away with the same Ctrl-C); return the
    messages asyncio's exception handler got ("Task exception was never retrieved")."""
    import gc

    seen: list[str] = []
    loop = asyncio.get_running_loop()
    gc.collect()  # earlier tests' garbage is reported now, not below

    def handler(_loop, ctx) -> None:
        # only this test's error: an unretrieved exception of another test's task, collected
        # during this one, is not what is counted here
        if str(ctx.get("exception")) == "Connection closed by server.":
            seen.append(ctx["message"])

    loop.set_exception_handler(handler)

    async def read():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise ConnectionError("Connection closed by server.") from None

    async def caller():
        try:
            await call(read())
        except ConnectionError:
            pass

    task = asyncio.create_task(caller())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    del task
    for _ in range(3):  # the inner task is reported when it is collected
        await asyncio.sleep(0.01)
        gc.collect()
    loop.set_exception_handler(None)
    return seen


async def test_with_deadline_leaves_no_unretrieved_task_exception_at_shutdown():
    from unicache.plumbing.aio import with_deadline

    # The failure it replaces: wait_for's inner task keeps the error nobody retrieves.
    assert await _unretrieved_after_cancel(lambda aw: asyncio.wait_for(aw, 5.0)) == ["Task exception was never retrieved"]
    assert await _unretrieved_after_cancel(lambda aw: with_deadline(aw, 5.0)) == []


async def test_with_deadline_raises_timeout_error():
    import pytest

    from unicache.plumbing.aio import with_deadline

    with pytest.raises(TimeoutError):
        await with_deadline(asyncio.sleep(10), 0.01)
    assert await with_deadline(asyncio.sleep(0, result=7), 1.0) == 7
