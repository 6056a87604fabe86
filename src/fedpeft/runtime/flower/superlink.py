"""``flower-superlink`` whose Control and Runtime APIs answer only this machine (or the networks you name).

Flower 1.41 serves every SuperLink API from one FastAPI app on one ``--host/--port``: the Fleet API
(SuperNodes), the Control API (``flwr run``, ``flwr supernode register / unregister``, ``flwr ls``)
and the Runtime API (the SuperExec and the ServerApp's Grid). In the open-source package the Control
API has no authentication (its account plugin accepts everyone) and the Runtime API hands a task token
to whoever asks ``/v1/runtime/acquire-task``. So anyone who can reach the SuperLink's port, TLS
certificate in hand, could register their own SuperNode key, submit their own app (whose ServerApp
code then runs on the server machine) or take the operator's next ServerApp task.

This launcher runs Flower's own entry point unchanged, except that one ASGI middleware is put in
front of that app: a request from a peer outside ``--control-from`` may reach the Fleet API
(``/v1/fleet/...``) and ``/health`` only; anything else (Control, Runtime, ``/docs``, any route a
later Flower adds) gets HTTP 403 and a log line. A request carrying a forwarding header
(``X-Forwarded-For``, ``Forwarded``, ``X-Real-IP``) is refused everything but the Fleet API and
``/health`` whoever sends it: behind a proxy the peer address is the proxy's, so it proves nothing.

    python -m fedpeft.runtime.flower.superlink [--control-from NET ...] <flower-superlink arguments>

``--control-from`` (repeatable): ``local`` (the default: loopback and every address of this
machine's interfaces, which is where the SuperLink's own SuperExec connects from), an address or a
network (``10.0.0.5``, ``10.0.0.0/24``, ``fd00::/64``), or ``any`` (no filter, logged as a warning).
Flower's extra gRPC Control API (``FLWR_INTERNAL_GRPC_CONTROL_API=1``) would bypass the filter, so
it is refused unless ``--control-from any``. The hook depends on Flower internals
(``internals.wrap_superlink_app``), checked by tests/test_flower_internals.py.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import psutil

from fedpeft.errors import UserError
from fedpeft.runtime.flower.internals import (
    GRPC_CONTROL_API_ENV,
    run_flower_superlink,
    superlink_public_paths,
    wrap_superlink_app,
)

log = logging.getLogger("fedpeft")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOCAL = "local"
ANY = "any"
FORWARDING_HEADERS = frozenset({b"x-forwarded-for", b"forwarded", b"x-real-ip"})
REFUSAL = (b'{"detail": "this SuperLink serves its Control and Runtime APIs only to the addresses given by '
           b'--control-from (fedpeft.runtime.flower.superlink); from elsewhere only the Fleet API"}')


USAGE = """fedpeft's SuperLink launcher: python -m fedpeft.runtime.flower.superlink [--control-from NET ...] ARGS
  --control-from NET  who may use the Control and Runtime APIs (repeatable): local (default: this machine),
                      an address or network (10.0.0.5, 10.0.0.0/24), or any; everyone gets the Fleet API
ARGS are flower-superlink's:
"""


class ControlFromError(UserError, ValueError):
    """A ``--control-from`` value that is not ``local``, ``any``, an address or a network."""


def this_machine() -> list[Network]:
    """Loopback and every address of this machine's network interfaces, each as a one-address network."""
    networks: list[Network] = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            try:
                networks.append(ipaddress.ip_network(address.address.split("%")[0]))
            except ValueError:
                continue  # a MAC address (AF_PACKET) and the like
    return networks


def parse_control_from(values: Iterable[str]) -> list[Network] | None:
    """The networks ``--control-from`` values name; None for ``any`` (no filter)."""
    values = list(values)
    if ANY in values:
        if len(values) > 1:
            raise ControlFromError(f"--control-from any lets everyone in; it cannot be combined with {values}")
        return None
    networks: list[Network] = []
    for value in values:
        if value == LOCAL:
            networks.extend(this_machine())
            continue
        try:
            networks.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise ControlFromError(f"--control-from {value!r} is not an address or network: give e.g. 10.0.0.5, "
                                   "10.0.0.0/24, fd00::/64, local (this machine) or any") from None
    return networks


def peer_address(host: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The peer's IP address (an IPv4-mapped IPv6 address as IPv4), or None when there is none to read."""
    if not host:
        return None
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class ControlFromFilter:
    """ASGI middleware: the SuperLink's public paths for everyone, the rest for ``allowed`` peers only."""

    def __init__(self, app: ASGIApp, allowed: list[Network], public_paths: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed
        self.public_paths = public_paths

    def admits(self, scope: Scope) -> str | None:
        """None if the request may pass, else why it may not."""
        if scope.get("path") in self.public_paths:
            return None
        if any(name.lower() in FORWARDING_HEADERS for name, _ in scope.get("headers", [])):
            return "it carries a forwarding header"
        client = scope.get("client")
        address = peer_address(client[0] if client else None)
        if address is None:
            return "its peer address is unknown"
        if any(address in network for network in self.allowed):
            return None
        return "the peer is outside --control-from"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan events
            return
        why = self.admits(scope)
        if why is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        log.warning("refused %s %s from %s: %s (only the Fleet API and /health are served to it)",
                    scope.get("method", scope["type"]), scope.get("path", "")[:200],
                    client[0] if client else "an unknown peer", why)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(REFUSAL)).encode())]})
        await send({"type": "http.response.body", "body": REFUSAL})


def install(allowed: list[Network] | None) -> None:
    """Make ``flower-superlink`` in this process filter its app's peers (nothing for ``allowed`` None)."""
    if allowed is None:
        log.warning("--control-from any: whoever reaches this SuperLink can submit runs (their ServerApp runs on "
                    "this machine, their ClientApp on every SuperNode) and register or remove SuperNodes")
        return
    if os.environ.get(GRPC_CONTROL_API_ENV) == "1":
        raise ControlFromError(f"{GRPC_CONTROL_API_ENV}=1 starts a gRPC Control API that --control-from cannot "
                               "filter: unset it, or give --control-from any")
    public = superlink_public_paths()
    # outermost: runs before Flower's own middleware sees the request
    wrap_superlink_app(lambda app: app.add_middleware(ControlFromFilter, allowed=allowed, public_paths=public))
    log.info("SuperLink Control and Runtime APIs served to %s only", ", ".join(str(n) for n in allowed))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--control-from", action="append", default=None, metavar="NET")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(rest):
        print(USAGE)  # then Flower's own options
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        install(parse_control_from(args.control_from or [LOCAL]))
    except ControlFromError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = ["flower-superlink", *rest]
    run_flower_superlink()


if __name__ == "__main__":
    main()
