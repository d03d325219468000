"""TLS for meshd and the console: the context a node serves HTTPS with, and the one that verifies
https:// nodes (a node's peers, or the nodes the console polls). Only ``ssl``: the console imports it too.

Contexts are built once at startup, so a missing, unreadable or mismatched file is a one-line error
before the model loads, never a failure on the first request.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NodeTLS:
    """A node's two TLS contexts: ``server`` serves HTTPS (None: plain HTTP); ``client`` verifies https:// peers."""

    server: ssl.SSLContext | None
    client: ssl.SSLContext


class TLSConfigError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the option and the file."""


def _readable(path: str, option: str) -> str:
    try:
        with open(Path(path).expanduser(), "rb") as file:
            if not file.read(1):
                raise TLSConfigError(f"{option} {path}: the file is empty")
    except OSError as exc:
        raise TLSConfigError(f"{option} {path}: cannot read it ({exc.strerror or exc})") from None
    return str(Path(path).expanduser())


def server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The context a node serves HTTPS with: its certificate chain and private key (PEM files)."""
    cert, key = _readable(certfile, "--ssl-certfile"), _readable(keyfile, "--ssl-keyfile")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise TLSConfigError(f"--ssl-keyfile {keyfile} is not the private key of --ssl-certfile {certfile}") \
                from None
        raise TLSConfigError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a PEM certificate chain "
                             f"and its private key ({exc.reason or exc})") from None
    return context


def client_context(ca_file: str | None = None) -> ssl.SSLContext:
    """The context https:// peers are verified with: the system's trust store, or only ``ca_file``'s CAs.

    Hostnames (or IP addresses) are checked against the peer's certificate.
    """
    if ca_file is None:
        return ssl.create_default_context()
    path = _readable(ca_file, "--ssl-ca-file")
    try:
        return ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        raise TLSConfigError(f"--ssl-ca-file {ca_file}: no PEM CA certificate in it ({exc.reason or exc})") from None


def untrusted_certificate(exc: BaseException) -> str | None:
    """A sentence for the peer list when ``exc`` (or its cause) is a failed certificate check, else None."""
    seen = 0
    while exc is not None and seen < 8:
        # aiohttp's ClientConnectorCertificateError is an SSLCertVerificationError without its fields: unwrap first
        inner = getattr(exc, "certificate_error", None)
        if inner is None and isinstance(exc, ssl.SSLCertVerificationError):
            detail = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or str(exc)
            return f"TLS: its certificate is not trusted ({detail})"
        exc, seen = inner or exc.__cause__ or exc.__context__, seen + 1
    return None
