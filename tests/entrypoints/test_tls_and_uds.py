"""vLLM's --ssl-* flags (HTTPS, and client certificates checked against --ssl-ca-certs when
--ssl-cert-reqs asks) and --uds (a Unix domain socket instead of a TCP port), on live servers;
wrong combinations and missing files are refused before the model loads. Certificates are made
with the openssl command (a local CA, a server certificate for 127.0.0.1, a client certificate)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import REPO_ROOT, LiveServer, running_server

MODEL = "tiny-llama"
API_KEY = "sk-tls"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def signed_pair(folder: Path, name: str, extensions: str) -> None:
    (folder / f"{name}.ext").write_text(extensions)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}", cwd=folder)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=folder)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificates")
    folder = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=vllm-lite test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    signed_pair(folder, "server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    signed_pair(folder, "client", "extendedKeyUsage=clientAuth\n")
    return folder


def trusting(certificates: Path, with_client_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certificates / "ca.pem"))
    if with_client_certificate:
        context.load_cert_chain(certificates / "client.pem", certificates / "client.key")
    return context


@pytest.fixture(scope="module")
def https_server(tiny_llama: Path, certificates: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[LiveServer]:
    args = ("--max-model-len", "128", "--ssl-keyfile", str(certificates / "server.key"),
            "--ssl-certfile", str(certificates / "server.pem"), "--ssl-ca-certs", str(certificates / "ca.pem"),
            "--ssl-cert-reqs", "2")
    log = tmp_path_factory.mktemp("https") / "server.log"
    with running_server(tiny_llama, log, MODEL, API_KEY, args, scheme="https",
                        client_options={"verify": trusting(certificates, with_client_certificate=True)}) as live:
        yield live


def test_https_serves_a_client_with_a_certificate_the_ca_signed(https_server: LiveServer, certificates: Path) -> None:
    with httpx.Client(verify=trusting(certificates, with_client_certificate=True), timeout=60) as client:
        reply = client.post(f"{https_server.base_url}/v1/completions", headers=AUTH, json=COMPLETION)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_https_refuses_plain_http_and_clients_without_a_certificate(https_server: LiveServer,
                                                                     certificates: Path) -> None:
    with pytest.raises(httpx.TransportError):  # --ssl-cert-reqs 2: the handshake fails
        with httpx.Client(verify=trusting(certificates, with_client_certificate=False), timeout=10) as client:
            client.post(f"{https_server.base_url}/v1/completions", headers=AUTH, json=COMPLETION)
    plain = https_server.base_url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain}/health", timeout=10)


def test_uds_serves_on_the_socket_only(tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "server.sock"
    transport = {"transport": httpx.HTTPTransport(uds=str(path))}
    with running_server(tiny_llama, tmp_path / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "128", "--uds", str(path)), client_options=transport) as live:
        with httpx.Client(timeout=60, transport=httpx.HTTPTransport(uds=str(path))) as client:
            reply = client.post("http://localhost/v1/completions", headers=AUTH, json=COMPLETION)
        assert reply.status_code == 200, reply.text
        assert path.is_socket()
        with pytest.raises(httpx.TransportError):  # --port is not listened on
            httpx.get(f"{live.base_url}/health", timeout=5)


@pytest.mark.parametrize(("args", "message"), [
    (("--ssl-keyfile", "{certs}/server.key"), "--ssl-keyfile needs --ssl-certfile"),
    (("--ssl-certfile", "{certs}/missing.pem"), "--ssl-certfile: no such file"),
    (("--ssl-certfile", "{certs}/server.pem", "--ssl-ca-certs", "{certs}/nope.pem"), "--ssl-ca-certs: no such file"),
    (("--uds", "{certs}/s.sock", "--api-server-count", "2"), "--uds serves one API server"),
])
def test_wrong_tls_and_socket_flags_fail_before_the_model_loads(certificates: Path, args: tuple[str, ...],
                                                                  message: str) -> None:
    """The model named does not exist: a refusal that came after loading would name it instead."""
    command = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(certificates / "no-model"),
               *(arg.format(certs=certificates) for arg in args)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
