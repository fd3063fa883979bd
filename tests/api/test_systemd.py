"""systemd: the notify protocol against real datagram sockets, and the unit file
(systemd-analyze verify, and deploy/inferd.service kept equal to what `inferd systemd-unit` prints)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

import inferd.api.systemd as systemd
from inferd.api.systemd import Notifier, render_unit
from inferd.cli import app

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_UNIT = ROOT / "deploy" / "inferd.service"
OPT_INFERD = "/opt/inferd/.venv/bin/inferd"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


def receiver(address: str) -> socket.socket:
    """What systemd does: a datagram socket bound at the address NOTIFY_SOCKET names."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + address[1:] if address.startswith("@") else address)
    sock.settimeout(5)
    return sock


def pending(sock: socket.socket) -> list[bytes]:
    """Every datagram queued on `sock` now."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(5)


@pytest.fixture
def socket_path(tmp_path: Path) -> str:
    path = str(tmp_path / "notify.sock")
    assert len(path) < 108, "AF_UNIX paths are at most 107 bytes"
    return path


# ---------------------------------------------------------------------------------------------
# the notify protocol


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_messages_arrive_exactly_and_in_order(kind: str, socket_path: str) -> None:
    address = socket_path if kind == "path" else f"@inferd-test-{os.getpid()}"
    with receiver(address) as sock, Notifier.from_environ({"NOTIFY_SOCKET": address}) as notifier:
        assert notifier.enabled
        notifier.status("loading SmolLM2-135M")
        notifier.ready()
        notifier.ready("ready: 1 model, 8000 KV blocks")
        notifier.watchdog()
        notifier.status("two\nlines")
        notifier.stopping("draining 3 streams")
        notifier.stopping()
        assert [sock.recv(4096) for _ in range(7)] == [
            b"STATUS=loading SmolLM2-135M",
            b"READY=1",
            b"READY=1\nSTATUS=ready: 1 model, 8000 KV blocks",
            b"WATCHDOG=1",
            b"STATUS=two lines",
            b"STOPPING=1\nSTATUS=draining 3 streams",
            b"STOPPING=1",
        ]
        notifier.close()
        assert not notifier.enabled
        notifier.status("after close")
        assert pending(sock) == []


def test_two_threads(socket_path: str) -> None:
    """The engine thread pings while the event loop sets STATUS: every message arrives whole,
    each thread's in its order."""
    n = 300
    # NOTE: net.unix.max_dgram_qlen may be as small as 10, and a full queue drops the message
    # (sends never block): the senders wait for room so that nothing is dropped.
    room = threading.Semaphore(8)
    with receiver(socket_path) as sock, Notifier.from_environ({"NOTIFY_SOCKET": socket_path}) as notifier:
        start = threading.Barrier(2)

        def send(i: int) -> None:
            start.wait()
            for k in range(n):
                assert room.acquire(timeout=5)
                if i == 0:
                    notifier.watchdog()
                else:
                    notifier.status(f"step {k}")

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        got = []
        for _ in range(2 * n):
            got.append(sock.recv(4096))
            room.release()
        for t in threads:
            t.join(5)
        assert pending(sock) == []
    assert got.count(b"WATCHDOG=1") == n
    assert [m for m in got if m != b"WATCHDOG=1"] == [f"STATUS=step {k}".encode() for k in range(n)]


def test_unset_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_socket(*args: object) -> None:
        raise AssertionError("a disabled notifier opened a socket")

    monkeypatch.setattr(systemd.socket, "socket", no_socket)
    for environ in ({}, {"NOTIFY_SOCKET": ""}, {"WATCHDOG_USEC": "30000000"}):
        notifier = Notifier.from_environ(environ)
        assert not notifier.enabled and notifier.watchdog_interval is None
        notifier.ready("ready")
        notifier.status("x")
        notifier.watchdog()
        notifier.stopping()
        notifier.close()


def test_vanished_socket_never_raises(socket_path: str, caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": socket_path})
    with receiver(socket_path) as sock:
        notifier.status("one")
        assert sock.recv(4096) == b"STATUS=one"
    os.unlink(socket_path)
    with caplog.at_level(logging.WARNING, logger="inferd"):
        notifier.watchdog()  # the peer is gone: ECONNREFUSED
        notifier.status("two")  # and its path too: ENOENT on reconnecting
        notifier.stopping()
    assert [r.levelno for r in caplog.records] == [logging.WARNING], "logged once"
    assert socket_path in caplog.text
    with receiver(socket_path) as sock:  # systemd re-bound it (daemon-reexec): reconnected
        notifier.status("three")
        assert sock.recv(4096) == b"STATUS=three"
    notifier.close()
    # a socket that never was
    Notifier.from_environ({"NOTIFY_SOCKET": "/nonexistent/notify"}).ready()
    Notifier.from_environ({"NOTIFY_SOCKET": "@inferd-test-nobody-listens"}).ready()
    Notifier.from_environ({"NOTIFY_SOCKET": "relative/path"}).ready()


def test_full_queue_drops_without_blocking(socket_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """A receiver that does not read: sends return at once (the socket is non-blocking)."""
    with receiver(socket_path) as sock, Notifier.from_environ({"NOTIFY_SOCKET": socket_path}) as notifier:
        sent = threading.Event()

        def flood() -> None:
            for _ in range(2000):
                notifier.watchdog()
            sent.set()

        with caplog.at_level(logging.WARNING, logger="inferd"):
            threading.Thread(target=flood, daemon=True).start()
            assert sent.wait(10), "a send blocked on a full queue"
        got = pending(sock)
        assert 0 < len(got) < 2000 and set(got) == {b"WATCHDOG=1"}
        assert len(caplog.records) == 1
        notifier.status("after")  # room again
        assert sock.recv(4096) == b"STATUS=after"


def test_watchdog_interval() -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_environ(env).watchdog_interval == 15.0
    assert Notifier.from_environ({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 15.0
    other = os.getppid() if os.getppid() != os.getpid() else 1
    assert Notifier.from_environ({**env, "WATCHDOG_PID": str(other)}).watchdog_interval is None
    assert Notifier.from_environ({"NOTIFY_SOCKET": "/run/systemd/notify"}).watchdog_interval is None
    for bad in ("", "0", "soon"):
        assert Notifier.from_environ({**env, "WATCHDOG_USEC": bad}).watchdog_interval is None


# ---------------------------------------------------------------------------------------------
# the unit file


def test_deploy_unit_is_what_the_command_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/inferd.service is `inferd systemd-unit` run from /opt/inferd/.venv: no drift."""
    monkeypatch.setattr(systemd, "exec_start", lambda: [OPT_INFERD])
    result = CliRunner().invoke(app, ["systemd-unit"])
    assert result.exit_code == 0, result.output
    assert result.stdout == DEPLOY_UNIT.read_text(), "regenerate deploy/inferd.service: see docs/operations.md, Running under systemd"
    assert f"ExecStart={OPT_INFERD} serve --config /etc/inferd/inferd.toml\n" in result.stdout


def test_unit_settings() -> None:
    lines = DEPLOY_UNIT.read_text().splitlines()
    directives = {line for line in lines if line and not line.startswith(("#", "["))}
    for want in (
        "Type=notify", "NotifyAccess=main", "Restart=on-failure", "RestartSec=5", "WatchdogSec=30",
        "TimeoutStartSec=600", "TimeoutStopSec=45", "KillSignal=SIGTERM", "KillMode=mixed",
        "User=inferd", "Group=inferd", "DynamicUser=no", "ProtectSystem=strict", "ProtectHome=true",
        "PrivateTmp=true", "NoNewPrivileges=true", "ProtectKernelTunables=true", "ProtectKernelModules=true",
        "ProtectControlGroups=true", "RestrictSUIDSGID=true", "LockPersonality=true", "RestrictRealtime=true",
        "CapabilityBoundingSet=", "ReadOnlyPaths=-/srv/models", "StateDirectory=inferd", "LogsDirectory=inferd",
        "DevicePolicy=closed", "DeviceAllow=/dev/nvidia0 rw", "DeviceAllow=/dev/nvidiactl rw",
        "DeviceAllow=/dev/nvidia-uvm rw", "DeviceAllow=/dev/nvidia-uvm-tools rw", "DeviceAllow=/dev/nvidia-modeset rw",
        "LimitNOFILE=65536", "Environment=PYTHONUNBUFFERED=1", "WantedBy=multi-user.target",
    ):
        assert want in directives, want
    keys = {d.split("=", 1)[0] for d in directives}
    assert "PrivateDevices" not in keys, "it would hide /dev/nvidia*"
    assert "MemoryDenyWriteExecute" not in keys, "CUDA's JIT needs W+X pages"


def test_exec_start_finds_the_install(tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.touch()
    assert systemd.exec_start(str(python)) == [str(python), "-m", "inferd.cli"]
    script = bin_dir / "inferd"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert systemd.exec_start(str(python)) == [str(script)]


def test_exec_start_quoting() -> None:
    unit = render_unit(["/opt/my venv/bin/inferd"], "/etc/inferd/100% $HOME.toml", user="svc")
    assert 'ExecStart="/opt/my venv/bin/inferd" serve --config "/etc/inferd/100%% $$HOME.toml"\n' in unit
    assert "User=svc\nGroup=svc\n" in unit
    with pytest.raises(ValueError, match="user or group"):
        render_unit([OPT_INFERD], user="in ferd")
    with pytest.raises(ValueError, match="newline"):
        render_unit([OPT_INFERD], "/etc/x\n[Service]")
    result = CliRunner().invoke(app, ["systemd-unit", "--user", "a b"])
    assert result.exit_code == 1 and "not a user or group name" in result.output


@pytest.mark.skipif(not os.access(SYSTEMD_ANALYZE, os.X_OK), reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit this install prints passes `systemd-analyze verify`: exit 0, and no line of it
    ignored (systemd skips an unknown key or a bad value with only a warning)."""
    config = tmp_path / "inferd.toml"
    unit = tmp_path / "inferd.service"
    printed = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "systemd-unit", "--config", str(config)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    exec_line = next(line for line in printed.splitlines() if line.startswith("ExecStart="))
    assert exec_line.endswith(f" serve --config {config}")
    assert Path(exec_line.removeprefix("ExecStart=").split()[0]).parent == Path(sys.executable).parent
    unit.write_text(printed)
    # NOTE: verify needs the ExecStart binary to exist (it does: this venv's), not the User=
    # account nor the config file.
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", str(unit)], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert f"{unit}:" not in output, output
