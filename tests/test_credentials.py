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
