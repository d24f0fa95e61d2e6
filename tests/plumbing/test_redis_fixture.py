import redis


def test_redis_fixture_runs_a_private_server_that_can_restart(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.set("k", "v")
    assert client.get("k") == b"v"
    port = redis_server.port
    redis_server.kill()
    redis_server.start()
    assert redis_server.port == port
    client = redis.Redis.from_url(redis_server.url)
    assert client.get("k") is None  # no persistence
