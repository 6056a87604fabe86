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

The launcher also runs Flower's SuperLink as a daemon that cleans up after itself:

* SIGTERM does what Ctrl-C (SIGINT) does, and either signal stops the SuperLink within seconds: Flower serves
  with uvicorn, which on either one waits for every open request to end, a ``flwr run --stream`` log stream
  included (it lasts as long as its run); here it waits at most ``GRACE_S`` (``internals.bound_superlink_shutdown``).
* Its SuperExec runs through :mod:`fedpeft.runtime.flower.superexec` (``internals.wrap_superexec_command``),
  which waits for the ServerApp processes it starts: Flower's own leaves each finished one a zombie.
* It is the subreaper of everything it starts (Linux), waits for whatever is re-parented to it, and on the way
  out stops (SIGTERM, then SIGKILL) and waits for every process still below it.
* At startup, when its SuperExec would connect to the Runtime API from an address outside ``--control-from``
  (``--host ::`` dials ``[::1]``, ``--host 0.0.0.0`` dials 127.0.0.1, any other host itself), it logs one warning:
  the filter would refuse the SuperExec, so no run could start. A warning, not a refusal: the launcher infers
  the address the kernel will pick and resolves host names itself, which it can get wrong.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import psutil

from fedpeft.errors import UserError
from fedpeft.runtime.flower.internals import (
    FLOWER_VERSION,
    GRPC_CONTROL_API_ENV,
    bound_superlink_shutdown,
    run_flower_superlink,
    superlink_public_paths,
    wrap_superexec_command,
    wrap_superlink_app,
)
from fedpeft.runtime.flower.processes import become_subreaper, reap_on_sigchld, stop_descendants

log = logging.getLogger("fedpeft")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOCAL = "local"
ANY = "any"
FORWARDING_HEADERS = frozenset({b"x-forwarded-for", b"forwarded", b"x-real-ip"})
GRACE_S = 3.0  # how long a stopping SuperLink waits for open requests, and its processes for SIGTERM
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


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def dialled_from(runtime_address: str) -> list[Address]:
    """The addresses a process on this machine connects from when it dials ``runtime_address`` (host:port, [v6]:port):
    the host itself for an address of this machine (loopback or an interface's), every address a host name resolves
    to (the client may try any); none when the name does not resolve."""
    host = runtime_address.rsplit(":", 1)[0].strip("[]")
    address = peer_address(host)
    if address is not None:
        return [address]
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):  # (a label over 63 characters is a UnicodeError)
        return []
    found = [peer_address(str(info[4][0])) for info in infos]
    return sorted({a for a in found if a is not None}, key=lambda a: (a.version, int(a)))


def superexec_command(command: list[str], runtime_address: str, *, allowed: list[Network] | None) -> list[str]:
    """The command the SuperLink starts its SuperExec with: fedpeft's, which waits for its ServerApps, in place of
    ``flower-superexec``; logs one warning if the SuperExec would dial the Runtime API from outside ``allowed``."""
    if allowed is not None:
        outside = [a for a in dialled_from(runtime_address) if not any(a in net for net in allowed)]
        if outside:
            log.warning("--control-from does not admit %s, the address this SuperLink's own SuperExec and ServerApps "
                        "connect from (they dial the Runtime API at %s, from --host): they would be refused and no run "
                        "could start; add --control-from local (or --control-from %s)", ", ".join(map(str, outside)),
                        runtime_address, " --control-from ".join(map(str, outside)))
    if command and Path(command[0]).name == "flower-superexec":
        return [sys.executable, "-m", "fedpeft.runtime.flower.superexec", *command[1:]]
    log.warning("the SuperExec command %r is not flower-superexec (a Flower other than %s?): started as it is, so the "
                "ServerApps it ends may stay zombies until it stops", command[:1], FLOWER_VERSION)
    return command


def serve(allowed: list[Network] | None) -> None:
    """Run ``flower-superlink`` (its arguments in ``sys.argv``) in this process until SIGTERM or SIGINT, then stop
    every process it started (see the module's docstring)."""
    try:
        become_subreaper()
        # this process's only children: the SuperExec (Flower's lifespan reads 0 as its status) and orphans
        reap_on_sigchld()
        # SIGTERM does what SIGINT does: KeyboardInterrupt, once uvicorn is done
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        wrap_superexec_command(functools.partial(superexec_command, allowed=allowed))
        bound_superlink_shutdown(GRACE_S)
        run_flower_superlink()  # returns after SIGTERM / SIGINT (uvicorn.run swallows the KeyboardInterrupt)
    except KeyboardInterrupt:
        log.info("stopped before the SuperLink was serving")
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        left = stop_descendants(GRACE_S)
        if left:
            log.warning("processes still running after SIGKILL: %s", ", ".join(str(p.pid) for p in left))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--control-from", action="append", default=None, metavar="NET")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(rest):
        print(USAGE)  # then Flower's own options
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        allowed = parse_control_from(args.control_from or [LOCAL])
        install(allowed)
    except ControlFromError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = ["flower-superlink", *rest]
    serve(allowed)


if __name__ == "__main__":
    main()
