"""Fixtures shared by every test: a real Redis server, flushed per test.

By default the suite starts its own server on a free port (so parallel suites and the
machine's own Redis never see each other's keys); set SQUALL_TEST_REDIS_URL to use another.
"""

from __future__ import annotations

import os
import uuid

import pytest
import redis
from optional import pytest_terminal_summary  # noqa: F401  (the closing "optional suites" section)
from realmodel import real_model  # noqa: F401  (the real pretrained model, built once: tests/realmodel.py)

from squall.shared.localredis import LocalRedis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    url = os.environ.get("SQUALL_TEST_REDIS_URL")
    if url:
        yield url
        return
    server = LocalRedis(data_dir=tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def r(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def run_name():
    return f"t{uuid.uuid4().hex[:8]}"
