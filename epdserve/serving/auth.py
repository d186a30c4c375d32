"""The options that seal every internal frame: the deployment's token (``serve`` generates one) and CURVE.
Frames are ``body | stream (8) | seq (8, big-endian) | tag (32)``, tag = HMAC-SHA256(K[purpose], bind | stream
| seq | body), checked before parsing; what each option protects and what it does not, replay included:
docs/architecture.md, "Sealing"."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from epdserve.argtypes import setting
from epdserve.transfer.sealing import ENCRYPTIONS, Keyring


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


@dataclass(frozen=True)
class AuthOptions:
    """Defaults from the environment: how ``serve`` hands them to its workers (not argv)."""
    auth_token: str | None = field(default_factory=lambda: _env("EPDSERVE_AUTH_TOKEN"), metadata=setting(
        "shared secret that seals every frame between the router and its workers (default: $EPDSERVE_AUTH_TOKEN; "
        "serve generates a random one and hands it to its workers)"))
    allow_unauthenticated: bool = field(
        default_factory=lambda: _env("EPDSERVE_ALLOW_UNAUTHENTICATED") == "1", metadata=setting(
            "run without an auth token although a socket listens on TCP: anyone who can reach it can join as a "
            "worker, read prompts and forge outputs", action="store_true"))
    internal_encryption: str = field(
        default_factory=lambda: _env("EPDSERVE_INTERNAL_ENCRYPTION") or "none", metadata=setting(
            "curve: encrypt every internal TCP socket with ZeroMQ CURVE, keys derived from the auth token (needs one)",
            choices=ENCRYPTIONS))


def options_error(options: AuthOptions, tcp_listeners: list[str]) -> str | None:
    """Why these options cannot run (a TCP listener without a token, CURVE without a token or support), or None."""
    if tcp_listeners and not options.auth_token and not options.allow_unauthenticated:
        return (f"listening on TCP ({', '.join(tcp_listeners)}) needs --auth-token (or $EPDSERVE_AUTH_TOKEN); "
                f"--allow-unauthenticated lets anyone who can reach it in")
    try:
        keyring_from(options)
    except ValueError as exc:
        return str(exc)
    return None


def keyring_from(options: AuthOptions) -> Keyring:
    """Raises ValueError as :class:`Keyring` (check :func:`options_error` first)."""
    return Keyring(options.auth_token, curve=options.internal_encryption == "curve")
