"""Fixtures for the client tests: fake OpenAI-style servers on real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest_asyncio
from aiohttp import web


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """`await serve(application)`: the application served on a free loopback port, its root URL;
    every one started is cleaned up after the test."""
    runners: list[web.AppRunner] = []

    async def start(application: web.Application) -> str:
        runner = web.AppRunner(application)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()
