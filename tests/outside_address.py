"""Run a program with every HTTP connection it opens (httpx, as Flower's clients use) made from another
loopback address, 127.0.0.2 by default: to a SuperLink that serves its Control API to 127.0.0.1/32 only,
such a program is a peer from another machine.

    python tests/outside_address.py [--from 127.0.0.3] flwr supernode register key.pub CONNECTION
    python tests/outside_address.py -m fedpeft.runtime.flower.fast_supernode --superlink ...

``flwr`` runs Flower's CLI; ``-m MODULE`` runs a module as ``python -m`` would.
"""

from __future__ import annotations

import runpy
import sys

import httpx

OUTSIDE = "127.0.0.2"


def connect_from(address: str) -> None:
    """Make every httpx transport created from now on in this process bind ``address`` before connecting."""
    original = httpx.HTTPTransport.__init__

    def init(self: httpx.HTTPTransport, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("local_address", address)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    httpx.HTTPTransport.__init__ = init  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    address = OUTSIDE
    if argv[:1] == ["--from"]:
        address, argv = argv[1], argv[2:]
    connect_from(address)
    if argv[:1] == ["flwr"]:
        from flwr.cli.app import app

        sys.argv = argv
        app()
    elif argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        raise SystemExit("usage: outside_address.py [--from ADDRESS] (flwr ARGS | -m MODULE ARGS)")


if __name__ == "__main__":
    main(sys.argv[1:])
