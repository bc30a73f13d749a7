"""TLS for both protocols (``runtime.tls_cert``, ``runtime.tls_key``; off when both are null).

The certificate and key are files the user hands in: they are read as data (PEM, by the ``ssl`` module and
grpc, which run no code), checked once on the frontend rank before any server starts, and a bad one is a
:class:`~hpcsplit.errors.RuntimeStageError` that says what was found, what is needed and what to do.  The
key must not be readable by the group or others (as ssh asks of its keys): on a shared cluster a key others
can read lets them pose as the server.  HTTP gets an :class:`ssl.SSLContext` (TLS 1.2 at least), gRPC
``grpc.ssl_server_credentials`` from the same two files.  The bearer token is still required over TLS.
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from hpcsplit.errors import RuntimeStageError

__all__ = ["TlsFiles", "load_tls"]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A checked certificate chain and key: their paths (the protocol workers load the same files) and bytes."""

    cert: str
    key: str
    cert_pem: bytes
    key_pem: bytes

    def http_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key, password=_no_password)  # an encrypted key fails, never prompts
        return ctx

    def grpc_credentials(self) -> Any:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def _no_password() -> bytes:
    return b""


def _read(what: str, path: str, limit: int = 1 << 20) -> bytes:
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise RuntimeStageError(f"runtime.{what} = {path!r}: cannot read it ({e.strerror}); give the path of a "
                                "PEM file on the frontend's node") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        raise RuntimeStageError(f"runtime.{what} = {path!r}: found {'no regular file' if not stat.S_ISREG(st.st_mode) else f'{st.st_size} bytes'}; "
                                f"needed a PEM file of at most {limit} bytes")
    if what == "tls_key" and st.st_mode & 0o077:
        raise RuntimeStageError(f"runtime.tls_key = {path!r} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                                f"a server key must be private: chmod 600 {path}")
    return p.read_bytes()


def load_tls(cert: str | None, key: str | None) -> TlsFiles | None:
    """The checked TLS files, or None when TLS is off (both null; the settings refuse one without the other)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise RuntimeStageError("runtime.tls_cert and runtime.tls_key go together: give both (PEM files) or neither")
    cert_pem, key_pem = _read("tls_cert", cert), _read("tls_key", key)
    files = TlsFiles(os.path.abspath(cert), os.path.abspath(key), cert_pem, key_pem)
    try:
        files.http_context()
    except (ssl.SSLError, ValueError) as e:
        raise RuntimeStageError(f"runtime.tls_cert = {cert!r} and runtime.tls_key = {key!r} do not load as a PEM "
                                f"certificate chain and its private key ({e}); give the server's certificate "
                                "(with its chain) and the unencrypted key that matches it") from None
    return files
