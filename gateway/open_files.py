"""The process's limit on open files: every session holds a socket, and the common default soft
limit (1 024) is below the sessions one engine serves. Past it, accept() fails and new clients hang
instead of being queued or refused; a load test's client processes hit the same wall."""

from __future__ import annotations

import contextlib


def raise_open_files_limit() -> int:
    """The soft limit raised to the hard one (or to 2^20 when there is no hard limit) -> the soft
    limit now; -1 where the platform has no such limits."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
