"""fedpeft's SuperLink launcher (fedpeft.runtime.flower.superlink): the peer filter in front of Flower's app, in
process on Flower's real SuperLink app. tests/test_flower_security.py plays the attacks on real processes."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys

import pytest

from fedpeft.runtime.flower import superlink
from fedpeft.runtime.flower.internals import superlink_public_paths
from fedpeft.runtime.flower.superlink import ControlFromError, ControlFromFilter, parse_control_from


async def _echo(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"reached Flower"})


def ask(peer: str, path: str, headers: dict[str, str] | None = None, allowed: str = "127.0.0.1/32") -> int:
    """The status a request from ``peer`` for ``path`` gets through the filter (the path as the server reads
    it: no client normalizes it first)."""
    app = ControlFromFilter(_echo, parse_control_from([allowed]), superlink_public_paths())
    scope = {"type": "http", "method": "POST", "path": path, "client": (peer, 40000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(event: dict) -> None:
        sent.append(event)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("path", ["/v1/control/register-node", "/v1/control/start-run", "/v1/control/list-nodes",
                                  "/v1/control/unregister-node", "/v1/runtime/acquire-task",
                                  "/v1/runtime/pull-messages", "/docs", "/openapi.json", "/", "/v1/fleet",
                                  "/v1/fleet/../control/start-run", "//v1/control/start-run",
                                  "/V1/control/start-run", "/v1/fleet/pull-messages/../../control/start-run",
                                  "/v1/some-router-a-later-flower-adds"])
def test_an_outsider_reaches_nothing_but_the_fleet_api(path, caplog):
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        assert ask("10.9.8.7", path) == 403
        assert ask("127.0.0.1", path) == 200  # this machine: passed on to Flower
    assert f"refused POST {path} from 10.9.8.7: the peer is outside --control-from" in caplog.text


@pytest.mark.parametrize("path", sorted(superlink_public_paths()))
def test_the_fleet_api_and_health_are_served_to_everyone(path):
    assert ask("10.9.8.7", path) == 200


def test_forwarding_headers_are_refused_even_from_this_machine(caplog):
    for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
        assert ask("127.0.0.1", "/v1/control/list-nodes", {header: "127.0.0.1"}) == 403
    assert ask("127.0.0.1", "/v1/fleet/pull-messages", {"X-Forwarded-For": "10.0.0.1"}) == 200
    assert "it carries a forwarding header" in caplog.text


def test_networks_ipv6_and_ipv4_mapped_peers():
    assert ask("10.0.0.77", "/v1/control/list-runs", allowed="10.0.0.0/24") == 200
    assert ask("10.0.1.77", "/v1/control/list-runs", allowed="10.0.0.0/24") == 403
    assert ask("::ffff:10.0.0.77", "/v1/control/list-runs", allowed="10.0.0.0/24") == 200
    assert ask("fd00::5", "/v1/control/list-runs", allowed="fd00::/64") == 200
    assert ask("fd01::5", "/v1/control/list-runs", allowed="fd00::/64") == 403


def test_local_means_loopback_and_this_machines_addresses(monkeypatch):
    from types import SimpleNamespace

    nic = {"eth0": [SimpleNamespace(address="192.168.7.20"), SimpleNamespace(address="fe80::1%eth0"),
                    SimpleNamespace(address="02:42:ac:11:00:02")]}
    monkeypatch.setattr(superlink.psutil, "net_if_addrs", lambda: nic)
    local = parse_control_from(["local"])
    for address in ("127.0.0.1", "127.5.5.5", "::1", "192.168.7.20", "fe80::1"):
        assert any(ipaddress.ip_address(address) in net for net in local), address
    assert not any(ipaddress.ip_address("192.168.7.21") in net for net in local)


def test_any_turns_the_filter_off_with_a_warning_and_bad_values_are_one_line_errors(caplog, monkeypatch):
    assert parse_control_from(["any"]) is None
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        superlink.install(None)
    assert "--control-from any: whoever reaches this SuperLink can submit runs" in caplog.text
    for values, message in ((["10.0.0.300"], "'10.0.0.300' is not an address or network"),
                            (["any", "10.0.0.0/8"], "cannot be combined")):
        with pytest.raises(ControlFromError, match=message) as err:
            parse_control_from(values)
        assert "\n" not in str(err.value)
    monkeypatch.setenv(superlink.GRPC_CONTROL_API_ENV, "1")
    with pytest.raises(ControlFromError, match="gRPC Control API that --control-from cannot filter"):
        superlink.install(parse_control_from(["local"]))


def test_the_command_line_refuses_a_bad_network_before_starting_flower(capsys, monkeypatch):
    monkeypatch.setattr(superlink, "run_flower_superlink", lambda: pytest.fail("Flower must not start"))
    with pytest.raises(SystemExit) as done:
        superlink.main(["--control-from", "nonsense", "--insecure"])
    assert done.value.code == 2
    assert capsys.readouterr().err.startswith("error: --control-from 'nonsense' is not an address or network")


def test_an_abbreviated_option_is_not_taken_for_control_from(monkeypatch):
    """`--control-f any` must not silently open the Control API: only the full option name is the launcher's;
    anything else goes to Flower (which refuses what it does not know)."""
    installed, started = [], []
    monkeypatch.setattr(superlink, "install", installed.append)
    monkeypatch.setattr(superlink, "serve", lambda allowed: started.append((list(sys.argv), allowed)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    superlink.main(["--control-f", "any", "--insecure"])
    assert installed == [parse_control_from([superlink.LOCAL])]  # the default, not 'any'
    assert started == [(["flower-superlink", "--control-f", "any", "--insecure"], installed[0])]


def test_a_control_from_that_refuses_the_superlinks_own_superexec_is_one_warning(caplog):
    """The SuperExec Flower starts dials the Runtime API at the address it is given (tests/test_flower_internals.py:
    [::1] for --host ::), so it connects from there; its command becomes fedpeft's SuperExec, which waits for its
    ServerApps (tests/test_flower_shutdown.py plays both on real processes)."""
    flower = ["flower-superexec", "--insecure", "--runtime-api-address", "[::1]:9093", "--parent-pid", "7"]
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        command = superlink.superexec_command(flower, "[::1]:9093", allowed=parse_control_from(["127.0.0.1/32"]))
    assert command == [sys.executable, "-m", "fedpeft.runtime.flower.superexec", *flower[1:]]
    assert [r.getMessage() for r in caplog.records] == [(
        "--control-from does not admit ::1, the address this SuperLink's own SuperExec and ServerApps connect from "
        "(they dial the Runtime API at [::1]:9093, from --host): they would be refused and no run could start; add "
        "--control-from local (or --control-from ::1)")]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        for address, allowed in (("[::1]:9093", ["local"]), ("127.0.0.1:9093", ["127.0.0.1/32"]),
                                 ("[::1]:9093", ["::1", "10.0.0.0/8"]), ("[::1]:9093", ["any"])):
            superlink.superexec_command(flower, address, allowed=parse_control_from(allowed))
    assert not caplog.records


def test_the_superexec_dials_from_the_address_or_every_address_of_a_name():
    from ipaddress import ip_address

    assert superlink.dialled_from("[::1]:9093") == [ip_address("::1")]
    assert superlink.dialled_from("10.0.0.1:9093") == [ip_address("10.0.0.1")]
    assert ip_address("127.0.0.1") in superlink.dialled_from("localhost:9093")
    assert superlink.dialled_from("no-such-host.invalid:9093") == []
