"""Running under systemd: the notify protocol (sd_notify without libsystemd) and the unit file.

The protocol: each message is one datagram of newline-separated `KEY=VALUE` lines sent to the
AF_UNIX socket named by $NOTIFY_SOCKET (a path, or `@name` for the abstract namespace).
systemd reads `READY=1` (start-up done: a `Type=notify` unit becomes active), `STATUS=...`
(the line `systemctl status` shows), `STOPPING=1` (shutdown began) and `WATCHDOG=1` (alive;
with `WatchdogSec=` set, a missing ping for that long restarts the service; the clock starts
at READY=1, so model loading is bounded by `TimeoutStartSec=` instead).

`UNIT_TEMPLATE` is the one source of the unit: `inferd systemd-unit` renders it for the
current install, and deploy/inferd.service is its rendering for /opt/inferd (a test checks).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from inferd.settings import environment

log = logging.getLogger("inferd")


class Notifier:
    """systemd's notify protocol: datagrams to $NOTIFY_SOCKET (a path, or '@name' for the
    abstract namespace). A no-op when the variable is unset.

    Thread-safe: the engine thread sends WATCHDOG=1 while the event loop sends STATUS. A send
    never raises and never blocks: a failure is logged once at warning and the message dropped,
    since a notify failure must not kill the server. One datagram socket, connected on the
    first send and reused; after a failed send it is reconnected on the next one (systemd
    re-binds its socket when it re-executes itself).
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        # NOTE: Linux spells an abstract address with a leading NUL; systemd writes it '@'.
        self._address = None if not address else "\0" + address[1:] if address.startswith("@") else address
        self._watchdog_usec = watchdog_usec
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        self._warned = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """The notifier systemd asked for through $NOTIFY_SOCKET, $WATCHDOG_USEC, $WATCHDOG_PID."""
        address = environ.get(environment.NOTIFY_SOCKET.name) or None
        if address is not None and not address.startswith(("/", "@")):
            log.warning("systemd notify: NOTIFY_SOCKET=%r is not a path or @name; notifications are off", address)
            address = None
        return cls(address, _watchdog_usec(environ))

    @property
    def enabled(self) -> bool:
        return self._address is not None and not self._closed

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3)
        advises; None when there is no watchdog for this process or notifications are off."""
        if self._watchdog_usec is None or not self.enabled:
            return None
        return self._watchdog_usec / 2 / 1e6

    def ready(self, status: str | None = None) -> None:
        self._send("READY=1", status)

    def status(self, text: str) -> None:
        self._send(None, text)

    def stopping(self, status: str | None = None) -> None:
        self._send("STOPPING=1", status)

    def watchdog(self) -> None:
        self._send("WATCHDOG=1", None)

    def close(self) -> None:
        """Close the socket; later calls are no-ops."""
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, state: str | None, status: str | None) -> None:
        if self._address is None:
            return
        lines = [state] if state else []
        if status is not None:
            # one line per key: a newline would start a new (bogus) assignment
            lines.append("STATUS=" + " ".join(status.splitlines()))
        message = "\n".join(lines).encode()
        with self._lock:
            if self._closed:
                return
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    sock.setblocking(False)
                    try:
                        sock.connect(self._address)
                    except OSError:
                        sock.close()
                        raise
                    self._sock = sock
                # NOTE: the kernel attaches our pid (the process, not the thread), which is what
                # NotifyAccess=main checks, so the engine thread's pings count as the main pid's.
                self._sock.send(message)
            except OSError as e:  # gone, refused, full (EAGAIN): drop this message, reconnect next time
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "systemd notify: cannot send to %s (%s); dropping this and logging no further failures",
                        self._address.replace("\0", "@"), e,
                    )


def _watchdog_usec(environ: Mapping[str, str]) -> int | None:
    """$WATCHDOG_USEC when it is meant for this process (sd_watchdog_enabled's rules)."""
    usec = environ.get(environment.WATCHDOG_USEC.name)
    if not usec:
        return None
    pid = environ.get(environment.WATCHDOG_PID.name)
    try:
        if pid and int(pid) != os.getpid():
            return None  # meant for another process, e.g. a parent that exec'd us without clearing it
        value = int(usec)
    except ValueError:
        log.warning("systemd notify: ignoring WATCHDOG_USEC=%r / WATCHDOG_PID=%r", usec, pid)
        return None
    return value if value > 0 else None


# ---------------------------------------------------------------------------------------------
# the unit file

DEFAULT_CONFIG = "/etc/inferd/inferd.toml"
DEFAULT_USER = "inferd"

UNIT_TEMPLATE = """\
# inferd: an LLM inference server on one GPU box. Generated by `inferd systemd-unit`.
# Install: see "Running under systemd" in docs/operations.md.
[Unit]
Description=inferd LLM inference server
# server.host may name an address that appears only once the network is up
Wants=network-online.target
After=network-online.target nvidia-persistenced.service

[Service]
# READY=1 comes once the model is loaded and the start-up probe passed; STATUS= shows
# loading / ready / draining in `systemctl status`.
Type=notify
NotifyAccess=main
ExecStart={exec_start}
Restart=on-failure
RestartSec=5
# The engine loop pings every WatchdogSec/2; a hung engine is killed (SIGABRT) and restarted.
# The clock starts at READY=1: loading is bounded by TimeoutStartSec instead.
WatchdogSec=30
# loading and dequantizing a large model, and the first CUDA context, take minutes
TimeoutStartSec=600
# SIGTERM starts a drain (30 s grace by default); stopping must outlast it, or the
# streams still open would be cut by SIGKILL.
KillSignal=SIGTERM
TimeoutStopSec=45
# SIGTERM to inferd alone (it drains), SIGKILL to any stray child after the timeout
KillMode=mixed

# A dedicated account, made once with:
#   useradd --system --user-group --home-dir /var/lib/inferd --shell /usr/sbin/nologin inferd
# Not DynamicUser=: the model files are owned by (or readable to) a fixed account.
User={user}
Group={group}
DynamicUser=no

# Sandbox. Everything is read-only but the directories below.
ProtectSystem=strict
# models under /home would be hidden: keep them in /srv/models
ProtectHome=true
PrivateTmp=true
NoNewPrivileges=true
ProtectKernelTunables=true
ProtectKernelModules=true
ProtectControlGroups=true
RestrictSUIDSGID=true
LockPersonality=true
RestrictRealtime=true
# no capabilities at all (ports below 1024 would need CAP_NET_BIND_SERVICE)
CapabilityBoundingSet=
# The model weights, read-only (strict does that already; named so that a ReadWritePaths=
# added later cannot open them). '-': a missing folder is the loader's error to report.
ReadOnlyPaths=-/srv/models
# /var/lib/inferd (home, API keys file), /var/log/inferd, /var/cache/inferd (JIT caches)
StateDirectory=inferd
LogsDirectory=inferd
CacheDirectory=inferd
Environment=XDG_CACHE_HOME=%C/inferd CUPY_CACHE_DIR=%C/inferd/cupy

# Devices: the GPU and nothing else. NOTE: no PrivateDevices=, which would hide /dev/nvidia*
# whatever DeviceAllow= says. More GPUs: add /dev/nvidia1, ... lines.
DevicePolicy=closed
DeviceAllow=/dev/nvidia0 rw
DeviceAllow=/dev/nvidiactl rw
DeviceAllow=/dev/nvidia-uvm rw
DeviceAllow=/dev/nvidia-uvm-tools rw
DeviceAllow=/dev/nvidia-modeset rw
# NOTE: no MemoryDenyWriteExecute=: CUDA's driver JIT and NVRTC need writable+executable pages.

LimitNOFILE=65536
Environment=PYTHONUNBUFFERED=1

[Install]
WantedBy=multi-user.target
"""


def exec_start(python: str = sys.executable) -> list[str]:
    """The command that runs `inferd serve` from this install: the `inferd` script beside the
    interpreter (a venv's bin/), or `python -m inferd.cli` when there is none."""
    python = os.path.abspath(python)  # NOTE: not resolved: a venv's python is a symlink out of it
    script = Path(python).parent / "inferd"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [python, "-m", "inferd.cli"]


def render_unit(
    command: Sequence[str], config: str = DEFAULT_CONFIG, user: str = DEFAULT_USER, group: str | None = None
) -> str:
    """The unit file running `command serve --config config` as `user` (and `group`, default
    the user's name)."""
    group = group or user
    for name in (user, group):
        if not name or any(c.isspace() or c in "%$\"'\\" for c in name):
            raise ValueError(f"not a user or group name systemd accepts: {name!r}")
    args = [*command, "serve", "--config", config]
    return UNIT_TEMPLATE.format(exec_start=" ".join(map(_exec_arg, args)), user=user, group=group)


def _exec_arg(arg: str) -> str:
    """One ExecStart= word, quoted as systemd.service(5) parses it: `%` is a specifier and `$`
    an environment variable unless doubled; whitespace, quotes and backslashes need quotes."""
    if "\n" in arg or "\0" in arg:
        raise ValueError(f"ExecStart= cannot hold a newline or NUL: {arg!r}")
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c.isspace() or c in "\"'\\;" for c in arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
