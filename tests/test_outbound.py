"""The guarded client for user-given URLs (``sageproject.outbound``).

No network beyond loopback: host names resolve through a replaced resolver, and the
"public" server of the rebinding case is a scripted socket layer (httpcore2's mock
stream). Real servers run on 127.0.0.1: ``http.server`` in a thread, and an MCP server
of the official SDK (``tests.mcp_servers``).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpcore2
import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sageproject import config, outbound
from sageproject.errors import ErrorCategory
from sageproject.outbound import (
    AddressRefused,
    OutboundPolicy,
    OutboundRefused,
    ResponseTooLarge,
    UrlRefused,
    async_client,
    check_url,
)
from tests.mcp_servers import McpServer

SETTING = "SAGE_MCP_ALLOWED_HOSTS"
PUBLIC = "93.184.216.34"
CAP = 1000


def policy(*allowed: str, **caps: Any) -> OutboundPolicy:
    return OutboundPolicy(setting=SETTING, allowed_hosts=frozenset(allowed), **caps)


class Handler(BaseHTTPRequestHandler):
    """Answers by path: /ok, /big, /chunked, /events, /big-event, /redirect?to=URL."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.server.requests.append(self.path)  # type: ignore[attr-defined]
        path, _, query = self.path.partition("?")
        if path == "/redirect":
            self.send_response(307)
            self.send_header("Location", query.removeprefix("to="))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(4):
                self.wfile.write(b"1f4\r\n" + b"x" * 500 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path in ("/events", "/big-event"):
            # Many small events (more than the cap in all), or one event over it.
            events = [b"data: " + b"e" * 90 + b"\n\n"] * 30
            if path == "/big-event":
                events = [b"data: " + b"e" * (CAP + 10) + b"\n\n"]
            body = b"".join(events)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            body = b"x" * (CAP * 2) if path == "/big" else b"hello"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Server(ThreadingHTTPServer):
    """A plain HTTP server on 127.0.0.1; ``requests`` lists the paths it saw."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[str] = []
        threading.Thread(target=self.serve_forever, args=(0.01,), daemon=True).start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that stops reading at the cap breaks the pipe: expected here

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    httpd = Server()
    yield httpd
    httpd.close()


def url_of(httpd: Server, path: str = "/ok") -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}{path}"


def resolving(table: dict[str, list[str]]):
    """A resolver answering from ``table`` (every lookup recorded in ``.calls``)."""

    async def resolve(host: str, port: int) -> list[outbound.IPAddress]:
        resolve.calls.append(host)
        return [ipaddress.ip_address(a) for a in table[host]]

    resolve.calls = []
    return resolve


class Recording(httpcore2.AsyncNetworkBackend):
    """The socket layer of a "public" server: records where it is asked to connect
    (and the TLS name) and answers one canned response per connection."""

    def __init__(self) -> None:
        self.connected: list[tuple[str, int]] = []
        self.tls_names: list[str | None] = []

    async def connect_tcp(self, host: str, port: int, **kwargs: Any) -> Any:
        self.connected.append((host, port))
        backend = self

        class Stream(httpcore2.AsyncMockStream):
            async def start_tls(self, ssl_context: Any, server_hostname: Any = None, **kw: Any):
                backend.tls_names.append(server_hostname)
                return self

        return Stream([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"])


async def refused(url: str, pol: OutboundPolicy | None = None, **client: Any) -> OutboundRefused:
    async with async_client(pol or policy(), **client) as http:
        with pytest.raises(OutboundRefused) as caught:
            await http.get(url)
    return caught.value


# --- the URL check --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("https://127.0.0.1", "loopback"),
        ("http://0.0.0.0", "unspecified"),
        ("http://[::1]", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://10.0.0.1", "private"),
        ("http://192.168.1.1", "private"),
        ("https://172.16.5.4", "private"),
        ("https://100.64.0.1", "shared (carrier-grade NAT)"),
        ("https://[fd00::1]", "private"),
        ("https://[fe80::1]", "link-local"),
        ("https://224.0.0.1", "multicast"),
        ("https://255.255.255.255", "reserved"),
        ("http://[::ffff:127.0.0.1]", "loopback"),
        ("https://[::ffff:169.254.169.254]", "link-local"),
        ("https://[64:ff9b::a00:1]", "private"),
        ("https://2130706433", "loopback"),
        ("https://0x7f.1", "loopback"),
    ],
)
async def test_it_refuses_a_literal_address_that_is_not_public(url, kind):
    error = await refused(url)
    assert (error.code, error.details["kind"]) == ("outbound.url_refused", kind)
    assert error.category is ErrorCategory.VALIDATION
    assert f"{kind} address; only hosts in {SETTING}" in error.message


async def test_it_refuses_the_metadata_address_naming_it():
    error = await refused("http://169.254.169.254/latest/meta-data")
    assert error.message.startswith("169.254.169.254 is a link-local address")


async def test_it_refuses_a_loopback_server_that_is_not_allowed(server):
    error = await refused(url_of(server))
    assert error.message.startswith("127.0.0.1 is a loopback address")
    assert server.requests == []


def test_it_refuses_plain_http_to_a_host_not_allowed():
    with pytest.raises(UrlRefused, match=f"http is only allowed for hosts in {SETTING}"):
        check_url("http://mcp.example.com/mcp", policy())


@pytest.mark.parametrize(
    "url", ["https://user:secret@mcp.example.com/", "ftp://mcp.example.com/", "https:///x"]
)
def test_it_refuses_userinfo_other_schemes_and_no_host(url):
    with pytest.raises(UrlRefused) as caught:
        check_url(url, policy())
    assert "secret" not in caught.value.message


def test_it_accepts_https_to_a_public_name_without_dns():
    assert check_url("https://mcp.example.com/mcp", policy()).host == "mcp.example.com"


def test_an_allowed_host_may_use_http_and_a_private_address():
    allowed = policy("127.0.0.1", "mcp.internal:8080")
    assert check_url("http://127.0.0.1:9/mcp", allowed)
    assert check_url("http://mcp.internal:8080/mcp", allowed)
    with pytest.raises(UrlRefused):
        check_url("http://mcp.internal:8081/mcp", allowed)


# --- the connect-time check -----------------------------------------------------------


async def test_it_refuses_a_name_that_resolves_to_loopback():
    # localhost through the real resolver: no DNS server is asked for it.
    error = await refused("https://localhost:1/")
    assert isinstance(error, AddressRefused)
    assert error.code == "outbound.address_refused"
    assert error.message.startswith("localhost resolves to ")
    assert error.details["kind"] == "loopback"


async def test_it_refuses_a_name_the_resolver_maps_to_loopback(monkeypatch):
    monkeypatch.setattr(outbound, "resolve", resolving({"mcp.example.test": ["127.0.0.1"]}))
    error = await refused("https://mcp.example.test/mcp")
    assert error.message == (
        "mcp.example.test resolves to 127.0.0.1, a loopback address; "
        f"only hosts in {SETTING} may reach one"
    )


async def test_it_refuses_a_name_with_any_address_that_is_not_public():
    resolver = resolving({"mixed.example.test": [PUBLIC, "10.1.2.3"]})
    socket_layer = Recording()
    error = await refused(
        "https://mixed.example.test/", resolver=resolver, network_backend=socket_layer
    )
    assert error.details == {"host": "mixed.example.test", "address": "10.1.2.3", "kind": "private"}
    assert socket_layer.connected == []


async def test_it_connects_to_the_address_it_checked():
    # DNS rebinding: the name answers a public address, then loopback. The connection
    # uses the first answer (checked) and never asks again.
    answers = [[PUBLIC], ["127.0.0.1"]]

    async def rebinding(host: str, port: int) -> list[outbound.IPAddress]:
        rebinding.calls += 1
        return [ipaddress.ip_address(a) for a in answers.pop(0)]

    rebinding.calls = 0
    socket_layer = Recording()
    async with async_client(policy(), resolver=rebinding, network_backend=socket_layer) as http:
        response = await http.get("https://rebind.example.test/mcp")
    assert response.text == "ok"
    assert rebinding.calls == 1
    assert socket_layer.connected == [(PUBLIC, 443)]
    # TLS still names the host: SNI and the certificate check use it.
    assert socket_layer.tls_names == ["rebind.example.test"]


async def test_a_new_connection_is_checked_again():
    answers = [[PUBLIC], ["127.0.0.1"]]

    async def rebinding(host: str, port: int) -> list[outbound.IPAddress]:
        return [ipaddress.ip_address(a) for a in answers.pop(0)]

    socket_layer = Recording()
    for expected in ("ok", AddressRefused):
        async with async_client(policy(), resolver=rebinding, network_backend=socket_layer) as http:
            if expected == "ok":
                assert (await http.get("https://rebind.example.test/")).text == "ok"
            else:
                with pytest.raises(AddressRefused, match=r"resolves to 127\.0\.0\.1"):
                    await http.get("https://rebind.example.test/")
    assert socket_layer.connected == [(PUBLIC, 443)]


# --- an allowed loopback server -------------------------------------------------------


async def test_it_reaches_an_allowed_loopback_server_over_http(server):
    async with async_client(policy("127.0.0.1")) as http:
        response = await http.get(url_of(server))
    assert (response.status_code, response.text) == (200, "hello")


async def test_it_does_not_follow_a_redirect(server):
    target = Server()
    try:
        allowed = policy(f"127.0.0.1:{server.server_address[1]}")
        to = url_of(target, "/ok")
        async with async_client(allowed) as http:
            response = await http.get(url_of(server, f"/redirect?to={to}"))
        assert response.status_code == 307
        # Asked to follow, the hop is checked like the first request, and refused.
        error = await refused(url_of(server, f"/redirect?to={to}"), allowed, follow_redirects=True)
        assert error.message.startswith("127.0.0.1 is a loopback address")
        assert target.requests == []
    finally:
        target.close()


async def test_it_refuses_a_body_over_the_cap(server):
    async with async_client(policy("127.0.0.1", max_response_bytes=CAP)) as http:
        for path in ("/big", "/chunked"):
            with pytest.raises(ResponseTooLarge) as caught:
                await http.get(url_of(server, path))
            assert caught.value.code == "outbound.response_too_large"
            assert caught.value.category is ErrorCategory.UPSTREAM


async def test_it_caps_an_event_stream_per_event(server):
    async with async_client(policy("127.0.0.1", max_response_bytes=CAP)) as http:
        many = await http.get(url_of(server, "/events"))
        assert len(many.content) > CAP
        with pytest.raises(ResponseTooLarge, match="one event of the stream"):
            await http.get(url_of(server, "/big-event"))


async def test_it_times_out_on_a_server_that_never_answers():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # the kernel completes the handshake; nobody ever answers
    try:
        port = silent.getsockname()[1]
        async with async_client(policy("127.0.0.1", read_timeout=0.2)) as http:
            with pytest.raises(httpx2.ReadTimeout) as caught:
                await http.get(f"http://127.0.0.1:{port}/")
        assert str(caught.value) == "127.0.0.1 sent nothing for 0.2 s (read timeout)"
    finally:
        silent.close()


async def test_a_request_cannot_lengthen_the_policys_timeout():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        port = silent.getsockname()[1]
        async with async_client(policy("127.0.0.1", read_timeout=0.2)) as http:
            with pytest.raises(httpx2.ReadTimeout):
                await http.get(f"http://127.0.0.1:{port}/", timeout=60)
    finally:
        silent.close()


# --- through the official MCP SDK -----------------------------------------------------


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def list_tools(url: str, pol: OutboundPolicy) -> list[str]:
    async with (
        async_client(pol) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return [tool.name for tool in (await session.list_tools()).tools]


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[McpServer]:
    with McpServer(tools=[add]) as server:
        yield server


async def test_the_mcp_sdk_reaches_an_allowed_server(mcp_server):
    assert await list_tools(mcp_server.url, policy("127.0.0.1")) == ["add"]


async def test_the_mcp_sdk_is_refused_a_server_not_allowed(mcp_server):
    seen = len(mcp_server.requests)
    with pytest.raises(BaseException) as caught:
        await list_tools(mcp_server.url, policy())
    error = outbound.outbound_error(caught.value)
    assert isinstance(error, UrlRefused)
    assert error.message.startswith("127.0.0.1 is a loopback address")
    assert len(mcp_server.requests) == seen


async def test_the_mcp_sdk_does_not_follow_a_redirect_elsewhere(server, mcp_server):
    # The SDK follows redirects within the endpoint's origin only; another origin fails
    # the request with its own error, and the other server sees nothing.
    seen = len(mcp_server.requests)
    allowed = policy("127.0.0.1")
    redirecting = url_of(server, f"/redirect?to={mcp_server.url}")
    with pytest.raises(BaseException) as caught:
        await list_tools(redirecting, allowed)
    assert outbound.outbound_error(caught.value) is None
    assert "not followed" in str(_mcp_error(caught.value))
    assert len(mcp_server.requests) == seen


def _mcp_error(exc: BaseException) -> BaseException | None:
    if isinstance(exc, MCPError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _mcp_error(inner)) is not None:
                return found
    return None


def test_the_mcp_policy_comes_from_its_setting():
    loaded = config.load({"SAGE_MCP_ALLOWED_HOSTS": "127.0.0.1,mcp.internal:8080"})
    mcp = outbound.mcp_policy(loaded.values, read_timeout=5)
    assert mcp.setting == SETTING
    assert mcp.allows("127.0.0.1", 1) and mcp.allows("MCP.internal.", 8080)
    assert not mcp.allows("mcp.internal", 80)
    assert mcp.read_timeout == 5


# --- TLS to a pinned address ----------------------------------------------------------


def certificate_files(tmp_path: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for ``name`` it signed: (ca, cert, key) PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def build(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            ).add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False
            ).add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("test CA", ca_key, "test CA", ca_key, ca=True)
    cert = build(name, key, "test CA", ca_key, ca=False)
    paths = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


async def test_tls_checks_the_host_name_on_the_pinned_address(tmp_path):
    ca, cert, key = certificate_files(tmp_path, "mcp.example.test")
    httpd = Server()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    httpd.socket = served.wrap_socket(httpd.socket, server_side=True)
    try:
        port = httpd.server_address[1]
        names = {"mcp.example.test": ["127.0.0.1"], "other.example.test": ["127.0.0.1"]}
        pol = policy("mcp.example.test", "other.example.test")
        trusted = ssl.create_default_context(cafile=str(ca))
        async with async_client(pol, resolver=resolving(names), verify=trusted) as http:
            response = await http.get(f"https://mcp.example.test:{port}/ok")
            assert response.text == "hello"
            # The same address under another name: its certificate does not match.
            with pytest.raises(httpx2.ConnectError, match="certificate verify failed"):
                await http.get(f"https://other.example.test:{port}/ok")
    finally:
        httpd.close()


def test_an_allowed_international_name_is_written_in_its_ascii_form():
    assert check_url("http://bücher.example/mcp", policy("xn--bcher-kva.example"))
