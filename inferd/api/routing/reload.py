"""Versioned hot reload: a new revision loads beside the old one and takes over only once it
has proved itself; the old one drains and is freed.

    POST /admin/models/NAME/reload  {"path"?, "revision"?}   (admin key, api/admin.py; SIGHUP:
    POST /admin/models/NAME/rollback                          every model whose table changed)

    load (worker thread) -> start its engine -> inference probe -> evaluation set (eval_file)
        any step fails: the new revision is stopped and dropped, the old keeps serving,
                        422 revision_rejected with the reason (and the log)
        all pass:       slot.current = new (new requests go there at once), slot.previous =
                        the old spec (for a rollback), the old revision retires: its in-flight
                        requests finish on it, then its engine stops and its memory goes;
                        KV events ([kv_events]): the old revision's end with AllBlocksCleared,
                        the new one's begin (it started without a sink)

No request is lost or cut: a request holds the revision it was admitted to until it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

from inferd.api.routing.registry import ModelRegistry, ModelSlot
from inferd.api.routing.served import ModelSpec, Served
from inferd.api.state import ServerState
from inferd.engine.protocol import EngineRequest
from inferd.text.sampling_params import SamplingParams

log = logging.getLogger(__name__)

EVAL_EXTRA_TOKENS = 2  # generated beyond the expected text's own tokens (tokenization may differ)
PROBE_SECONDS = 60.0  # a new revision whose start-up probe has not run by then is rejected


class RevisionRejected(Exception):
    """The new revision failed to load, its probe or its evaluation set."""


async def reload_model(registry: ModelRegistry, server: ServerState, slot: ModelSlot, spec: ModelSpec) -> Served:
    """Load `spec` beside the slot's current revision, prove it, and swap it in (module docstring)."""
    if registry.loader is None:
        raise RevisionRejected("this server was built around one given engine and cannot load another")
    async with slot.lock:
        if slot.serving is None:  # (not loaded, asleep or moving: lifecycle.py's; a load reads the new spec)
            raise RevisionRejected(f"model {slot.name} is {slot.life.state}: only a serving model reloads")
        loop = asyncio.get_running_loop()
        try:
            engine = await loop.run_in_executor(None, registry.loader, spec)
        except Exception as e:  # (ModelLoadError, OSError, a torch error, out of memory: all the same here)
            raise _rejected(slot, spec, f"it did not load: {e}") from None
        old = slot.current
        new = Served(spec, engine, server, old.settings, slot.counts.door)
        try:
            await new.start()
            await new.first_probe(within=PROBE_SECONDS)
            failure = await evaluate(new, spec.eval_file)
        except TimeoutError as e:
            await new.stop()
            raise _rejected(slot, spec, str(e)) from None
        except BaseException:
            await new.stop()
            raise
        if failure is not None:
            await new.stop()
            raise _rejected(slot, spec, failure)
        slot.previous, slot.current, slot.limits = old.spec, new, engine.limits
        registry.hand_over_events(old, new)  # (subscribers: AllBlocksCleared, then the new revision's events)
        slot.counts.reloads += 1
        registry.refresh_aliases()
        slot.retire(old)
        log.info("model %s: revision %s serves (was %s)", slot.name, spec.revision, old.spec.revision)
        return new


def _rejected(slot: ModelSlot, spec: ModelSpec, reason: str) -> RevisionRejected:
    slot.counts.reloads_refused += 1
    message = f"model {slot.name}: revision {spec.revision} rejected, {slot.current.spec.revision} keeps serving: {reason}"
    log.error("%s", message)
    return RevisionRejected(message)


def read_eval_set(path: str) -> list[tuple[str, str]]:
    """(prompt, expected greedy continuation) pairs from a JSON-lines file."""
    cases = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                case = json.loads(line)
                cases.append((str(case["prompt"]), str(case["expected"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: not a JSON object with prompt and expected") from None
    return cases


async def evaluate(served: Served, eval_file: str | None) -> str | None:
    """The first case whose greedy continuation does not start with the expected text, as a
    reason; None when every case passes (or there is no evaluation set)."""
    if eval_file is None:
        return None
    try:
        cases = read_eval_set(eval_file)
    except (OSError, ValueError) as e:
        return f"evaluation set unreadable: {e}"
    engine = served.engine
    answers = await asyncio.gather(*(_greedy(served, prompt, expected) for prompt, expected in cases))
    for (prompt, expected), answer in zip(cases, answers):
        if not answer.startswith(expected):
            return f"evaluation set: {prompt!r} continued as {answer!r}, expected {expected!r}"
    log.info("evaluation set: %d cases pass on %s", len(cases), engine.limits.model_path)
    return None


async def _greedy(served: Served, prompt: str, expected: str) -> str:
    engine = served.engine
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=len(tokenizer.encode(expected)) + EVAL_EXTRA_TOKENS, temperature=0.0)
    # NOTE: past the door on purpose, like the probe: the revision serves nobody yet
    stream = engine.submit(EngineRequest(engine.new_group_id(), tokenizer.encode(prompt), params,
                                         engine.limits.policy.default_class))
    texts = []
    try:
        async for out in stream:
            texts.append(out.text)
    finally:
        stream.abort()
    return "".join(texts)


async def reload_changed(registry: ModelRegistry, server: ServerState, specs: list[ModelSpec]) -> list[str]:
    """SIGHUP: reload every model whose table changed; what happened to each, for the log."""
    done = []
    for spec in specs:
        slot = registry.slots.get(spec.name) or (registry.primary if not spec.name else None)  # ("": the one model)
        if slot is None:
            continue  # (models are added or removed by a restart)
        spec = dataclasses.replace(spec, name=slot.name)
        slot.pinned, slot.idle_unload_seconds = spec.pinned, spec.idle_unload_seconds
        if slot.current is None:  # (not loaded: the table read is what it loads next)
            if spec != slot.spec:
                slot.spec = spec
                done.append(f"{spec.label}: not loaded; it loads this revision when next asked")
            continue
        if spec == slot.current.spec:
            continue
        try:
            await reload_model(registry, server, slot, spec)
            done.append(f"{spec.label} serves")
        except RevisionRejected as e:
            done.append(str(e))
    return done
