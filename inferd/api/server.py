"""`inferd serve`: load the model, build the app, run it on uvloop until SIGINT / SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import uvloop
from aiohttp import web

from inferd.api.app import create_app
from inferd.config import Settings
from inferd.engine.engine import AsyncEngine
from inferd.engine.llm_engine import LLMEngine
from inferd.model.loader import default_model_path

log = logging.getLogger("inferd")


def served_name(settings: Settings) -> str:
    if settings.model.name:
        return settings.model.name
    path = Path(settings.model.path) if settings.model.path else default_model_path()
    return path.stem if path.is_file() else path.name


async def serve(settings: Settings, api_keys: frozenset[str]) -> None:
    llm = LLMEngine.from_config(settings.engine_config())
    engine = AsyncEngine(llm, served_name(settings))
    # handler_cancellation: a non-streaming request whose client left is aborted at once
    runner = web.AppRunner(
        create_app(engine, settings, api_keys), access_log=None, handle_signals=False, handler_cancellation=True
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.server.host, settings.server.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    cfg = llm.model_config
    log.info(
        "inferd serving %s (%s, %d layers) dtype=%s device=%s kv_blocks=%d x %d tokens, max_model_len=%d, "
        "api_keys=%d on http://%s:%d",
        engine.model_name, cfg.architecture, cfg.num_layers, str(llm.model.dtype).removeprefix("torch."),
        llm.model.device, llm.block_manager.pool.num_blocks, llm.config.block_size, llm.max_model_len,
        len(api_keys), host, port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("inferd shutting down")
        await runner.cleanup()


def run_server(settings: Settings, api_keys: frozenset[str]) -> None:
    uvloop.run(serve(settings, api_keys))
