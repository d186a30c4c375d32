"""Per-message authentication of every internal frame, and the keys derived from the
deployment's token (``--auth-token`` / ``$EPDSERVE_AUTH_TOKEN``; ``epdserve serve``
generates one when none is given).

**Sealing.** Every frame on an internal socket (a worker's events to the router: Hello,
Heartbeat, Stats, Output, Error, Encoded; the router's commands to a worker; a request
for a KV or embedding frame) is sent as::

    body | stream (8 bytes) | seq (8 bytes, big-endian) | tag (32 bytes)
    tag = HMAC-SHA256(K[purpose], bind | stream | seq | body)

and the receiver checks the tag (in constant time) before it parses the body: a frame of
anyone without the token is dropped unread, logged (rate-limited, :class:`DropLog`) and
never acted on. Keys: ``K[label] = HMAC-SHA256(SHA-256(token), "epdserve/v1/" + label)``,
one per direction and purpose (``events``: worker to router, ``commands``: router to
worker, ``kv-request``: a KV or embedding fetch request), so that a frame sealed for one
socket never opens on another. ``bind`` is, for commands, the receiving worker's
``incarnation`` (a random nonce of its process, sent in its Hello): a command opens only
at the process it was meant for, so a Refused sent to a Hello's address cannot stop
another process listening there. Every token holder can seal anything: workers are
trusted alike, the token is what keeps everyone else out.

**Replay.** Only someone who saw a frame can replay it: an observer of a TCP link between
hosts (loopback and the launcher's private ipc directory cannot be observed without
root). What bounds it:

* each sending socket seals with a random ``stream`` id and a counter ``seq``; a receiver
  drops a frame whose ``seq`` is not above the last it took from that stream (it
  remembers the last ``MAX_STREAMS`` streams), so a replay into a running receiver is
  dropped;
* commands are bound to the worker process (``bind``): replayed to another worker, or to
  the same one after a restart, they do not open;
* left: a router started after the frame was sent knows no streams yet and takes one
  copy of each old worker frame. An old Hello registers a worker at that (real) address,
  marked down after ``--worker-timeout`` without heartbeats of its incarnation; an old
  Output names a request id (random) the new router never issued; an old Stats shows
  stale numbers until the worker's next (every 0.5 s). A KV request is not
  counter-checked (each fetch is a fresh connection): replayed, it gets, while the export
  is held (at most ``--kv-ttl``), the reply its observer already saw on the same link.

``--internal-encryption curve`` closes these across hosts: an observer sees nothing to
replay.

**KV and embedding replies are not sealed**: a MAC over a frame of many megabytes costs a
pass over it, and it is not needed: the reply comes back on the connection the requester
opened to an address taken from a sealed command, so forging it means hijacking that TCP
connection (on-path across hosts, which CURVE prevents; on loopback, root), and the reply
is checked against the descriptor (size, layout) before it is used.

**Without a token** (``--allow-unauthenticated``) frames are sent as they are, without a
trailer, and nothing is checked: anyone who can reach a socket is trusted, as before.

**CURVE** (``--internal-encryption curve``): ZeroMQ's CurveZMQ (Curve25519 key exchange
with ephemeral keys per connection, XSalsa20-Poly1305 on every message) on every TCP
internal socket: the router's events socket, a worker's command socket, the KV and
embedding servers, and the sockets that connect to them (ipc sockets stay plain). Keys:
the server secret key is ``HMAC-SHA256(SHA-256(token), "epdserve/v1/curve-server")``, the
client's the same with ``curve-client`` (Z85-encoded; the public keys are computed from
them with ``zmq.curve_public``); every server uses the server pair, every client the
client pair and the server's public key. It protects what travels on a TCP link (prompt
token ids, generated tokens, KV and embedding frames) from being read or altered by
anyone without the token, and such a peer cannot even complete the handshake (it needs
the server's public key, derived from the token and never sent). It does not protect
against a token holder (every key derives from the token), nor ipc sockets, nor a leaked
token (it lets its holder join; recorded sessions stay secret thanks to the ephemeral
keys), nor a denial of service by connections that fail the handshake. It costs CPU:
every KV frame is encrypted once and decrypted once.
"""

from __future__ import annotations

import argparse
import os

from epdserve.transfer.sealing import ENCRYPTIONS, Keyring


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--auth-token``, ``--allow-unauthenticated`` and ``--internal-encryption``, shared by
    ``worker``, ``router`` and ``serve`` (defaults from the environment, which is how
    ``serve`` hands them to its workers)."""
    parser.add_argument("--auth-token", default=os.environ.get("EPDSERVE_AUTH_TOKEN") or None,
                        help="shared secret that seals every frame between the router and its workers (default: "
                             "$EPDSERVE_AUTH_TOKEN; serve generates a random one and hands it to its workers)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        default=os.environ.get("EPDSERVE_ALLOW_UNAUTHENTICATED") == "1",
                        help="run without an auth token although a socket listens on TCP: anyone who can reach "
                             "it can join as a worker, read prompts and forge outputs")
    parser.add_argument("--internal-encryption", choices=ENCRYPTIONS,
                        default=os.environ.get("EPDSERVE_INTERNAL_ENCRYPTION") or "none",
                        help="curve: encrypt every internal TCP socket with ZeroMQ CURVE, keys derived from the "
                             "auth token (needs one)")


def options_error(args, tcp_listeners: list[str]) -> str | None:
    """Why these options cannot run, or None: a TCP listener without a token (unless
    ``--allow-unauthenticated``), or CURVE without a token or support. ``args``: parsed
    options or a config with the fields of :func:`add_arguments`'s flags."""
    if tcp_listeners and not args.auth_token and not args.allow_unauthenticated:
        return (f"listening on TCP ({', '.join(tcp_listeners)}) needs --auth-token (or $EPDSERVE_AUTH_TOKEN); "
                f"--allow-unauthenticated lets anyone who can reach it in")
    try:
        Keyring(args.auth_token, curve=args.internal_encryption == "curve")
    except ValueError as exc:
        return str(exc)
    return None


def keyring_from(args) -> Keyring:
    """The :class:`Keyring` of parsed options or a config (check :func:`options_error` first).

    Raises:
        ValueError: as :class:`Keyring`.
    """
    return Keyring(args.auth_token, curve=args.internal_encryption == "curve")
