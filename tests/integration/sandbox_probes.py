"""Host-side probes shared by the sandbox tests (read by the tests themselves, not via the
code under test)."""

from __future__ import annotations

import os
from pathlib import Path


def live_processes_of_uid(uid: int) -> list[int]:
    """Running (non-zombie) processes of a host uid, read from /proc by the test itself."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in ("Z", "X"):
            found.append(int(entry))
    return found
