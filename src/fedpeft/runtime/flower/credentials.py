"""Test credentials for a secured Flower deployment: a CA, a SuperLink TLS certificate and SuperNode keys.

``make_credentials(out_dir, hosts=[...], supernodes=N)`` writes

* ``ca.crt`` / ``ca.key``: a self-signed certificate authority (RSA 4096); give ``ca.crt`` to every
  SuperNode (``--root-certificates``) and to ``flwr`` (``root-certificates`` of the connection);
* ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by the CA, valid for localhost,
  127.0.0.1, ::1 and every name or IP address in ``hosts`` (the SuperLink's own SuperExec connects
  to 127.0.0.1, so that one must stay);
* ``supernode-I`` / ``supernode-I.pub``: an ECDSA P-384 key pair per SuperNode in OpenSSH format,
  the kind Flower's SuperNode authentication takes (``flwr supernode register supernode-I.pub``,
  ``flower-supernode --auth-supernode-private-key supernode-I``);
* ``partition_keys.yaml``: ``{0: "SHA256:...", 1: "SHA256:..."}``, the fingerprint of each ``supernode-I.pub``,
  which pins partition I to SuperNode I's key in a run (``runtime.flower.partition_keys``,
  :func:`partition_keys_setting` gives the ``--set`` argument).

The certificates carry the key identifiers and key usages that strict X.509 checking (Python 3.13's
default ``VERIFY_X509_STRICT``) requires. Private keys are created readable by their owner only.
These are for tests and trials. In production use certificates from your own PKI.
Written with the ``cryptography`` package (a Flower dependency), not by shelling out to openssl.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from fedpeft.keys import pinned_key_fingerprint

PARTITION_KEYS_FILE = "partition_keys.yaml"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpeft test"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for h in ["localhost", "127.0.0.1", "::1", *hosts]:
        try:
            entry: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(h))
        except ValueError:
            entry = x509.DNSName(h)
        if entry not in entries:
            entries.append(entry)
    return x509.SubjectAlternativeName(entries)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data``; a private key is created owner-only (0600) before any byte of it is written."""
    mode = 0o600 if private else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # an existing file keeps its old mode through O_CREAT
        f.write(data)


def make_credentials(out_dir: str | Path, *, hosts: list[str] | None = None, supernodes: int = 2,
                     days: int = 365) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    plain = serialization.NoEncryption()

    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    ca_cert = (x509.CertificateBuilder().subject_name(_name("fedpeft test CA")).issuer_name(_name("fedpeft test CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    _write(out / "ca.key", ca_key.private_bytes(pem, pkcs8, plain), private=True)
    _write(out / "ca.crt", ca_cert.public_bytes(pem))

    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server_cert = (x509.CertificateBuilder().subject_name(_name("fedpeft SuperLink")).issuer_name(ca_cert.subject)
                   .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
                   .add_extension(_san(list(hosts or [])), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False)
                   .sign(ca_key, hashes.SHA256()))
    _write(out / "server.key", server_key.private_bytes(pem, pkcs8, plain), private=True)
    _write(out / "server.pem", server_cert.public_bytes(pem))

    for i in range(supernodes):
        key = ec.generate_private_key(ec.SECP384R1())
        _write(out / f"supernode-{i}", key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, plain), private=True)
        _write(out / f"supernode-{i}.pub", key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                          serialization.PublicFormat.OpenSSH) + b"\n")
    _write(out / PARTITION_KEYS_FILE, (pins_yaml(partition_keys(out, supernodes)) + "\n").encode())
    return out


def partition_keys(folder: str | Path, supernodes: int) -> dict[int, str]:
    """{I: the SHA256 fingerprint of ``folder/supernode-I.pub``} for I < ``supernodes``: each partition pinned to the
    key of the SuperNode that serves it."""
    folder = Path(folder)
    return {i: pinned_key_fingerprint((folder / f"supernode-{i}.pub").read_text()) for i in range(supernodes)}


def pins_yaml(pins: dict[int, str]) -> str:
    """``pins`` as a one-line YAML mapping, ``{0: "SHA256:...", 1: "SHA256:..."}``."""
    return "{" + ", ".join(f'{i}: "{fingerprint}"' for i, fingerprint in sorted(pins.items())) + "}"


def partition_keys_setting(pins: dict[int, str]) -> str:
    """The ``fedpeft run`` argument that pins the partitions to ``pins`` (shell-quoted)."""
    return f"--set 'runtime.flower.partition_keys={pins_yaml(pins)}'"
