"""sd_notify without libsystemd: readiness, watchdog pings and stopping, as datagrams.

``$NOTIFY_SOCKET`` is a path or, with a leading ``@``, an abstract socket. Without it (not run
by systemd, or a test) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        owned = pid is None or pid == str(os.getpid())
        self.watchdog_interval: float | None = (
            int(usec) / 2e6 if usec and usec.isascii() and usec.isdigit() and owned else None
        )

    def notify(self, *fields: str) -> bool:
        if not self.address:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.sendto("\n".join(fields).encode(), target)
            except OSError:
                return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")
