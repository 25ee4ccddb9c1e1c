"""How this process's S3 client waits and retries: a store that stops answering fails a request in bounded time.

Left to their defaults, s3fs and botocore turn a stalled store into a long silent stall: botocore
waits for each read and retries up to five times, s3fs retries each of those up to five times
again, and aiohttp (under aiobotocore) waits without any limit for the ``100 Continue`` that a PUT
asks for and for the store to take the request's body. Here, for ``s3://`` and ``s3a://``:

- ``--checkpoint.s3_connect_timeout_seconds`` and ``--checkpoint.s3_read_timeout_seconds`` bound
  each wait, and ``--checkpoint.s3_max_attempts`` bounds the attempts of one request (botocore's
  "standard" retry mode, which retries throttling, 5xx answers and timeouts with a backoff);
  s3fs's own retry loop, which would multiply the attempts, is turned off;
- requests go out without ``Expect: 100-continue``: the body is sent at once, and the read timeout
  bounds the wait for the answer;
- on Linux every connection has ``TCP_USER_TIMEOUT`` = the read timeout, so a store that stops
  taking a body (its receive window stays shut) or disappears ends the connection.

A request to a store that stopped answering thus fails after about ``max_attempts`` x (read
timeout + backoff), with botocore's error naming the endpoint; ``unanswered_line`` makes the one
line the saver raises. The settings are process-wide: fsspec's configuration for the two schemes,
read whenever an S3 file system is created, so DCP's readers and writers, which create their own
from the URL, get them too. Preflight applies the job's (``configure``); until then the defaults
of ``S3Timeouts`` hold (``location.py`` applies them before its first S3 file system).
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # the config is read, never imported at run time: this module stays light
    from torchtitan.config.job_config import Checkpoint

PROTOCOLS = ("s3", "s3a")


@dataclass(frozen=True)
class S3Timeouts:
    """The waits and attempts of one S3 request (defaults: those of ``[checkpoint]``)."""

    connect_seconds: int = 10
    read_seconds: int = 30
    max_attempts: int = 3

    @classmethod
    def from_config(cls, ck: Checkpoint) -> S3Timeouts:
        return cls(ck.s3_connect_timeout_seconds, ck.s3_read_timeout_seconds, ck.s3_max_attempts)


_wanted = S3Timeouts()
_applied: S3Timeouts | None = None


def configure(timeouts: S3Timeouts) -> None:
    """Use ``timeouts`` for every S3 file system this process creates from now on."""
    global _wanted
    _wanted = timeouts
    if _applied is not None:
        apply()


def current() -> S3Timeouts:
    return _wanted


def apply() -> None:
    """Put the wanted settings into fsspec's configuration (once per change); ImportError when s3fs cannot take them."""
    global _applied
    if _applied == _wanted:
        return
    import fsspec.config

    try:
        import s3fs
    except ImportError:
        raise ImportError("s3:// needs the s3fs driver: pip install s3fs") from None
    config = _client_config(_wanted)
    _check_supported(config)
    s3fs.S3FileSystem.retries = 1  # one s3fs attempt of botocore's bounded ones, not five of them
    for protocol in PROTOCOLS:  # over what the user's fsspec configuration sets, if anything
        given = fsspec.config.conf.get(protocol, {})
        fsspec.config.conf[protocol] = {**given, "config_kwargs": {**given.get("config_kwargs", {}), **config}}
    _applied = _wanted


def _client_config(timeouts: S3Timeouts) -> dict[str, Any]:
    """botocore's ``Config`` (aiobotocore's ``AioConfig``) arguments for ``timeouts``."""
    return {
        "connect_timeout": timeouts.connect_seconds,
        "read_timeout": timeouts.read_seconds,
        "retries": {"mode": "standard", "total_max_attempts": timeouts.max_attempts},
        "http_session_cls": _no_continue_session(),
        "connector_args": {"socket_factory": functools.partial(_socket, timeouts.read_seconds)},
    }


def _check_supported(config: dict[str, Any]) -> None:
    try:
        from aiobotocore.config import AioConfig

        AioConfig(**config)
    except Exception as e:  # noqa: BLE001 - an older aiobotocore refuses an option in its own way
        raise ImportError(f"the installed s3fs/aiobotocore cannot bound S3 waits ({type(e).__name__}: {e}); "
                          "pip install -U s3fs") from None


@functools.cache
def _no_continue_session() -> type:
    from aiobotocore.httpsession import AIOHTTPSession

    class NoContinueSession(AIOHTTPSession):
        """aiobotocore's HTTP session, sending a body at once: aiohttp waits for ``100 Continue`` without a timeout.

        botocore leaves ``Expect`` out of the signature, so dropping it after signing is allowed.
        """

        async def send(self, request: Any) -> Any:
            request.headers.pop("Expect", None)
            return await super().send(request)

    return NoContinueSession


def _socket(user_timeout_seconds: int, addr_info: tuple) -> socket.socket:
    """A connection's socket (aiohttp's ``socket_factory``), which the kernel closes when sent data goes unacked,
    or the store's window stays shut, for ``user_timeout_seconds`` (Linux; elsewhere the read timeout alone
    bounds the wait)."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=kind, proto=proto)
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is not None and family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, option, user_timeout_seconds * 1000)
    return sock


# ---- a store that did not answer, as one line ---------------------------------------------------
def unanswered(error: BaseException) -> BaseException | None:
    """botocore's timeout or connection error inside ``error`` (its causes, DCP's per-rank failures), or None."""
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # no S3 driver: no S3 error either
        return None
    seen: set[int] = set()
    pending = [error]
    while pending:
        found = pending.pop()
        if id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, (BotoConnectionError, HTTPClientError)) and _endpoint(found):
            return found
        failures = getattr(found, "failures", None)  # DCP's CheckpointException: {rank: (error, traceback)}
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending += [e for e in (found.__cause__, found.__context__) if e is not None]
    return None


def _endpoint(error: BaseException) -> str | None:
    url = getattr(error, "kwargs", {}).get("endpoint_url")
    if not url:
        return None
    parts = urlsplit(str(url))
    return f"{parts.scheme}://{parts.netloc}"


def unanswered_line(error: BaseException, what: str) -> str | None:
    """``what`` failed because the store did not answer: one line naming the endpoint and the options; else None."""
    found = unanswered(error)
    if found is None:
        return None
    t = _wanted
    return (f"{what}: the object store at {_endpoint(found)} did not answer ({found}) in {t.max_attempts} "
            f"attempt(s) of --checkpoint.s3_connect_timeout_seconds={t.connect_seconds} / "
            f"--checkpoint.s3_read_timeout_seconds={t.read_seconds} (--checkpoint.s3_max_attempts); "
            "check the store and its endpoint (AWS_ENDPOINT_URL)")


class StoreUnansweredError(RuntimeError):
    """A save, or its commit, that the object store left unanswered (the message is ``unanswered_line``)."""
