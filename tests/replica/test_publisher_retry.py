"""The publisher's asyncio Redis client gets redis-py's asyncio ``Retry`` (the synchronous
one made the client warn at every replica start), and no retry at all: the publisher
resyncs after an outage itself (replica/publishing/publisher.py)."""

from __future__ import annotations

import warnings

import redis.asyncio.retry
import redis.retry

from unicache.replica.publishing.publisher import CachePublisher
from unicache.testing.signed_state import SIGNER


async def test_the_asyncio_client_gets_the_asyncio_retry_and_warns_nothing():
    pub = CachePublisher(object(), "r0", "redis://127.0.0.1:1/0", "127.0.0.1:5000", signer=SIGNER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client = pub._client()
    try:
        retry = client.get_retry()
        assert isinstance(retry, redis.asyncio.retry.Retry) and not isinstance(retry, redis.retry.Retry)
        assert retry.get_retries() == 0
    finally:
        await client.aclose()
