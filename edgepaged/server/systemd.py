"""Talking to systemd when it runs the server (`Type=notify`, packaging/edgepaged.service):
READY=1 once the model is loaded and the ports listen, STOPPING=1 when it drains, WATCHDOG=1
every half `WatchdogSec` while the engine loop is alive (a model step that never returns stops
the petting, and systemd restarts the service). Without NOTIFY_SOCKET every call is a no-op.
The protocol is one datagram per message on a Unix socket (sd_notify(3)); no library needed."""
from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send `message` ("READY=1", "STATUS=…", …) to systemd; False when not run by it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address[0] == "@":                   # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval_s() -> float | None:
    """How often to pet the watchdog (half of WatchdogSec), or None when it is off or meant
    for another process."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(int(usec) / 1e6 / 2, 0.05)
    except ValueError:
        return None
