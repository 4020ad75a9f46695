"""Process names as `ps` shows them: `duoserve: scheduler`, `duoserve: worker 0`."""

from __future__ import annotations

import ctypes
import signal

import setproctitle


def set_process_title(role: str) -> None:
    setproctitle.setproctitle(f"duoserve: {role}")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no orphans)."""
    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, sig)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own cleanup still stops its children
