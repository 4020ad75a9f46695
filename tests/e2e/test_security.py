"""TLS, mutual TLS and API keys on a live server, through the SDK and the CLI."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from duoserve_client import Client, tls_credentials
from duoserve_client.errors import UnauthenticatedError, UnavailableError
from tests.e2e.harness import ServerProcess, start_server

pytestmark = pytest.mark.slow

KEY = "s3cret-key-for-tests"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    for name, san in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr", cwd=d)  # fmt: skip
        extensions = ["-extfile", f"{name}.ext"] if san else []
        if san:
            (d / f"{name}.ext").write_text(san + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-out", f"{name}.pem", *extensions, cwd=d)  # fmt: skip
    (d / "keys").write_text(f"# API keys\n\n{KEY}\nanother-key\n")
    return d


@pytest.fixture(scope="module")
def secure_server(pki: Path) -> Iterator[ServerProcess]:
    server = start_server(
        *("--dtype", "float32", "--metrics-port", "0"),
        *("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")),
        *("--tls-client-ca", str(pki / "ca.pem"), "--api-key-file", str(pki / "keys")),
        wait=False,
    )
    with Client(server.target, credentials=mtls(pki)) as client:
        client.wait_until_ready(240)  # the health service needs no key
    yield server
    assert server.stop() == 0


def mtls(pki: Path) -> grpc.ChannelCredentials:
    return tls_credentials(pki / "ca.pem", pki / "client.pem", pki / "client.key")


def test_a_client_with_its_certificate_and_a_key_is_served(secure_server: ServerProcess, pki: Path) -> None:
    with Client(secure_server.target, credentials=mtls(pki), api_key=KEY) as client:
        assert "Paris" in client.chat([("user", "What is the capital of France?")], max_tokens=16).text
        assert [c for c in client.stream("Hello", max_tokens=3, ignore_eos=True)][
            -1
        ].finish_reason == "length"
    with Client(secure_server.target, credentials=mtls(pki), api_key="another-key") as client:
        assert client.list_models()[0].name == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.parametrize("api_key", [None, "wrong-key", f"{KEY}x"])
def test_calls_without_a_known_key_are_unauthenticated(
    secure_server: ServerProcess, pki: Path, api_key: str | None
) -> None:
    with Client(secure_server.target, credentials=mtls(pki), api_key=api_key, retries=0) as client:
        assert client.health() == "SERVING"  # probes stay open
        with pytest.raises(UnauthenticatedError, match="authorization: Bearer"):
            client.generate("Hello", max_tokens=2)
        with pytest.raises(UnauthenticatedError):
            list(client.stream("Hello", max_tokens=2))
        with pytest.raises(UnauthenticatedError):
            client.tokenize("Hello")


def test_without_a_client_certificate_or_without_tls_nothing_connects(
    secure_server: ServerProcess, pki: Path
) -> None:
    no_client_cert = tls_credentials(pki / "ca.pem")
    with (
        Client(secure_server.target, credentials=no_client_cert, api_key=KEY, retries=0, timeout=5) as client,
        pytest.raises(UnavailableError),
    ):
        client.generate("Hello", max_tokens=2)
    with (
        Client(secure_server.target, api_key=KEY, retries=0, timeout=5) as client,
        pytest.raises(UnavailableError),
    ):
        client.generate("Hello", max_tokens=2)


def test_the_cli_speaks_tls_and_sends_the_key(secure_server: ServerProcess, pki: Path) -> None:
    base = [
        sys.executable, "-m", "duoserve_client.cli", "--target", secure_server.target, "--retries", "0",
        "--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key"),
    ]  # fmt: skip
    ok = subprocess.run([*base, "--api-key", KEY, "generate", "--raw", "Hello", "--max-tokens", "4"],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    refused = subprocess.run([*base, "generate", "--raw", "Hello", "--max-tokens", "4"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 16 and "UNAUTHENTICATED" in refused.stderr  # 16: the status code


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--api-key-file", "none"), "--api-key-file="),
        (("--tls-cert", "none.pem", "--tls-key", "none.key"), "--tls-key="),
        (("--tls-cert", "none.pem"), "--tls-cert and --tls-key go together"),
    ],
    ids=["api-key-file", "tls-files", "tls-key-missing"],
)
def test_a_bad_security_setting_is_refused_before_any_process_starts(
    tmp_path: Path, flags: tuple[str, ...], said: str
) -> None:
    # File names are made absolute under tmp_path, where nothing exists.
    server = start_server(
        "--metrics-port", "0", *(f if f.startswith("--") else str(tmp_path / f) for f in flags), wait=False
    )
    assert server.process.wait(60) == 2
    log = server.log()
    assert said in log
    assert "starting worker" not in log and "starting scheduler" not in log
