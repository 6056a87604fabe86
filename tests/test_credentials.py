"""The test credentials of `fedpeft flower credentials`: a TLS handshake under strict X.509 checking, and
private keys that were never readable by others."""

import socket
import ssl
import stat
import threading

from fedpeft.runtime.flower.credentials import make_credentials


def test_server_certificate_passes_a_strict_tls_handshake(tmp_path):
    creds = make_credentials(tmp_path / "creds", supernodes=1)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(creds / "server.pem", creds / "server.key")
    client_ctx = ssl.create_default_context(cafile=str(creds / "ca.crt"))
    client_ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # Python 3.13's default: needs key identifiers
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        errors: list[BaseException] = []

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except BaseException as exc:  # reported below  # noqa: BLE001
                errors.append(exc)

        thread = threading.Thread(target=serve)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as raw, \
                client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.recv(2) == b"ok"
        thread.join(timeout=10)
    assert not errors


def test_private_keys_are_owner_only(tmp_path):
    creds = make_credentials(tmp_path / "creds", supernodes=2)
    for name in ("ca.key", "server.key", "supernode-0", "supernode-1"):
        assert stat.S_IMODE((creds / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((creds / "ca.crt").stat().st_mode) == 0o644


def test_the_command_prints_and_writes_the_setting_that_pins_each_partition_to_its_key(tmp_path, capsys):
    """`fedpeft flower credentials` ends with the --set argument that pins partition I to supernode-I.pub's
    fingerprint (`ssh-keygen -lf` prints the same), also written to partition_keys.yaml; a run on a SuperLink takes it."""
    import shlex

    from fedpeft.cli import main
    from fedpeft.config import load_config
    from fedpeft.keys import pinned_key_fingerprint

    assert main(["flower", "credentials", str(tmp_path / "creds"), "--supernodes", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    pins = {i: pinned_key_fingerprint((tmp_path / "creds" / f"supernode-{i}.pub").read_text()) for i in range(3)}
    assert out[-1] == ("  --set 'runtime.flower.partition_keys={"
                       + ", ".join(f'{i}: "{pins[i]}"' for i in range(3)) + "}'")
    assert "partition_keys.yaml" in out[-2]
    option, setting = shlex.split(out[-1])
    assert option == "--set"
    cfg = load_config(None, ["runtime.flower.superlink=10.0.0.1:8000", "runtime.flower.num_supernodes=3", setting])
    assert cfg.runtime.flower.partition_keys == pins
    written = (tmp_path / "creds" / "partition_keys.yaml").read_text().strip()
    assert f"runtime.flower.partition_keys={written}" == setting
