"""`inferd serve`: load the model, build the app, run it on uvloop until SIGINT / SIGTERM, then
drain: stop admitting, let in-flight requests finish within a grace period, exit 0.

systemd (Type=notify) hears: STATUS while loading, READY=1 once the inference probe has run,
WATCHDOG=1 from the engine loop, STOPPING=1 when the drain starts. SIGHUP reads the keys and
tenants again (the settings file's [tenants], server.admin_key_sha256, server.api_keys_file) and
reloads every model whose [models.NAME] table changed (reload.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import uvloop
from aiohttp import web

from inferd.api.app import create_app
from inferd.api.conversation.volatile import compile_patterns
from inferd.api.edge import connection_options
from inferd.api.gateway.gate import GATEWAY
from inferd.api.offload import prestarted_pool
from inferd.api.gateway.tenants import Keyring
from inferd.api.routing.registry import REGISTRY, ModelRegistry
from inferd.api.routing.reload import reload_changed
from inferd.api.routing.served import ModelSpec
from inferd.api.startup import StartupLine
from inferd.api.state import STATE
from inferd.api.systemd import Notifier
from inferd.settings.config import Settings
from inferd.settings.values import SettingsError
from inferd.engine.async_engine import AsyncEngine

log = logging.getLogger("inferd")


async def serve(settings: Settings, api_keys: frozenset[str], load: Callable[[], AsyncEngine | ModelRegistry],
                reload_keys: Callable[[], Keyring] | None = None,
                read_specs: Callable[[], list[ModelSpec]] | None = None) -> None:
    """Serve the engine or the registry of engines `load` builds (the caller knows how: the API
    never imports torch); SIGHUP reads the keys and tenants again through `reload_keys`, and
    reloads every model whose table `read_specs` finds changed."""
    compile_patterns(settings.cache.volatile_prompt_patterns)  # a bad one fails before the models load
    notifier = Notifier.from_environ()
    notifier.status("loading the models")
    asyncio.get_running_loop().set_default_executor(prestarted_pool())
    app = create_app(load(), settings, api_keys, reload_keys)
    state, models = app[STATE], app[REGISTRY]
    # handler_cancellation: a non-streaming request whose client left is aborted at once
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           **connection_options(settings.server))
    await runner.setup()  # (starts the engine thread)
    site = web.TCPSite(runner, settings.server.host, settings.server.port)
    try:
        await site.start()
    except BaseException:  # e.g. the port is taken: stop the engine thread before exiting
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    for line in startup_lines(models, len(api_keys), f"http://{host}:{port}"):
        log.info("%s", line.format())
    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    reloads: set[asyncio.Task[None]] = set()  # (held, so a reload in flight is not collected)

    def on_sighup() -> None:
        task = asyncio.ensure_future(_reload(app, read_specs))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    waiting_for_signal = asyncio.ensure_future(signals.get())
    while not state.probed and not waiting_for_signal.done():  # READY=1 once the probe has run
        await asyncio.wait([waiting_for_signal], timeout=0.05)
    if state.probed:
        notifier.ready(f"ready: serving {', '.join(models.slots)} on http://{host}:{port}")
        if notifier.watchdog_interval is not None:  # (systemd's watchdog counts from READY=1)
            models.heartbeat = pacer = _Pacer(notifier.watchdog, notifier.watchdog_interval)  # (and loads')
            for served in models.served():
                served.engine.heartbeat = pacer
            idle_beats = asyncio.ensure_future(_beat_while_unloaded(models, pacer))
            waiting_for_signal.add_done_callback(lambda _: idle_beats.cancel())
    try:
        sig = await waiting_for_signal
        await _drain(app, notifier, signals, settings.server.drain_seconds, signal.Signals(sig).name)
    finally:
        log.info("inferd shutting down")
        await runner.cleanup()
        notifier.close()


def startup_lines(models: ModelRegistry, api_keys: int, url: str) -> list[StartupLine]:
    """One per model: what it loaded; a model not loaded at start (on demand), placeholders (the
    line still names the server's address, for the scripts that read it)."""
    lines = []
    for slot in models.slots.values():
        name = slot.latest_spec.label if len(models.slots) > 1 else slot.name
        limits = slot.current.engine.limits if slot.current is not None else None
        if limits is None:
            log.info("model %s loads on demand, on its first request", slot.name)
            lines.append(StartupLine(name, "on-demand", 0, "-", "-", 0, 0, 0, api_keys, url))
            continue
        lines.append(StartupLine(name, limits.architecture, limits.num_layers, limits.dtype, limits.device,
                                 limits.num_kv_blocks, limits.block_size, limits.max_model_len, api_keys, url))
    return lines


async def _beat_while_unloaded(models: ModelRegistry, pacer: _Pacer) -> None:
    """The watchdog's beat while no engine runs (every model on demand, none loaded): the event
    loop's (an engine's loop beats it otherwise)."""
    while True:
        if not any(served.engine.alive for served in models.served()):
            pacer()
        await asyncio.sleep(pacer.interval / 2)


async def _drain(app: web.Application, notifier: Notifier, signals: asyncio.Queue[int], grace: float,
                 signal_name: str) -> None:
    """Stop admitting (/ready and new requests: 503), let what runs finish for up to `grace`
    seconds, or until a second signal; what still runs then ends with an error event."""
    app[STATE].draining = True  # every door: new requests get 503 with a Retry-After
    models = app[REGISTRY]  # (open requests: every model's, summed)
    notifier.stopping(f"draining: {models.open_requests} requests in flight")
    log.info("%s: draining %d requests in flight (up to %.0f s; a second signal stops at once)",
             signal_name, models.open_requests, grace)
    deadline = time.monotonic() + grace
    second = asyncio.ensure_future(signals.get())
    try:
        while models.open_requests and time.monotonic() < deadline and not second.done():
            await asyncio.wait([second], timeout=0.05)
    finally:
        second.cancel()
    if models.open_requests:
        app[STATE].drain_cut = models.open_requests
        log.warning("drain: %d requests did not finish in time; ending them", models.open_requests)
    else:
        log.info("drain: every request finished")


async def _reload(app: web.Application, read_specs: Callable[[], list[ModelSpec]] | None) -> None:
    """SIGHUP: the keys and tenants read again, and every model whose table changed reloaded; a
    bad file is logged and the old keys, tenants and revisions stay."""
    try:
        keyring = await app[GATEWAY].reload()
        log.info("SIGHUP: keys reloaded: %d keys, %d tenants", keyring.num_keys, len(keyring.tenants))
        if read_specs is not None:
            specs = await asyncio.get_running_loop().run_in_executor(None, read_specs)
            for line in await reload_changed(app[REGISTRY], app[STATE], specs):
                log.info("SIGHUP: %s", line)
    except (SettingsError, ValueError) as e:
        log.error("SIGHUP: reload refused, the old keys, tenants and models stay: %s", e)


class _Pacer:
    """Calls `action` at most once per `interval` seconds (the engine loop beats more often)."""

    def __init__(self, action: Callable[[], None], interval: float) -> None:
        self.action = action
        self.interval = interval
        self.last = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self.action()


def run_server(settings: Settings, api_keys: frozenset[str], load: Callable[[], AsyncEngine | ModelRegistry],
               reload_keys: Callable[[], Keyring] | None = None,
               read_specs: Callable[[], list[ModelSpec]] | None = None) -> None:
    uvloop.run(serve(settings, api_keys, load, reload_keys, read_specs))
