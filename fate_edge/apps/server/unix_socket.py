"""The daemon's Unix socket: private by default, never stolen from a live daemon, removed only by its owner.

Whoever can connect to the socket can use the model (and, without ``--api-key``, needs nothing else),
so it is created 0600 (``--socket-mode`` widens it). A path where another daemon answers is refused;
a socket file nobody answers on is stale (a crashed daemon) and is replaced. At exit the file is
unlinked only if it is still the one this process bound (same device and inode).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from dataclasses import dataclass

from fate_edge.errors import FateEdgeError

log = logging.getLogger("fate_edge.apps.server")

DEFAULT_MODE = 0o600


def parse_mode(text: str) -> int:
    """``--socket-mode`` (octal, like chmod: ``600``, ``0660``) → permission bits."""
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise FateEdgeError(f"--socket-mode must be octal permission bits such as 600 or 660, got {text!r}")
    return mode


@dataclass
class BoundSocket:
    sock: socket.socket
    path: str
    identity: tuple[int, int]  # (st_dev, st_ino) of the file bind() created

    def cleanup(self) -> None:
        """Close the socket; unlink the path only if it is still our file (another daemon may own it now)."""
        self.sock.close()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self.identity:
            os.unlink(self.path)
        else:
            log.warning("%s is no longer the socket this server created; leaving it in place", self.path)


def _remove_stale(path: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FateEdgeError(
            f"--unix-socket {path}: the path exists and is not a socket; remove it or choose another path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: left behind by a daemon that did not exit cleanly
        log.warning("removed the stale socket %s (no server was listening on it)", path)
        return
    except OSError as exc:
        raise FateEdgeError(f"--unix-socket {path}: cannot check whether a server listens there ({exc})") from None
    finally:
        probe.close()
    raise FateEdgeError(
        f"--unix-socket {path}: another server is listening on this socket; stop it or choose another path"
    )


def bind_unix_socket(path: str, mode: int = DEFAULT_MODE) -> BoundSocket:
    """A bound (not yet listening) socket at ``path`` with permission bits ``mode``."""
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the file is born 0600: no window in which anyone else may connect
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise FateEdgeError(
                f"--unix-socket {path}: another server bound this path just now; stop it or choose another path"
            ) from None
        raise FateEdgeError(f"--unix-socket {path}: cannot bind ({exc})") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    st = os.stat(path)
    return BoundSocket(sock, path, (st.st_dev, st.st_ino))
