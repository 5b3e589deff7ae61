"""The one guarded client for requests to URLs a user gave (MCP servers, webhooks).

A user-given URL must not reach the host's own network: its loopback services, the
cloud metadata endpoint (link-local), private ranges. An ``OutboundPolicy`` says which
hosts the operator allows anyway (a setting such as ``SAGE_MCP_ALLOWED_HOSTS``), and
the caps. Three gates apply it:

- ``check_url``: the URL's syntax, before any request and on every redirect hop. The
  scheme is ``https``, or ``http`` to an allowed host; no userinfo; a literal address
  must be public unless allowed.
- The network backend (``GuardedNetworkBackend``): each new connection resolves the host
  once, refuses it unless every address is public, then connects to the checked address.
  No second lookup happens, so DNS rebinding cannot swap the address in between. TLS
  still names the host (SNI and the certificate check use the URL's host name).
- The response stream: a body is capped at ``max_response_bytes``. An event stream
  (``text/event-stream``) is capped per event instead, so a long-lived stream lives on.

``async_client(policy)`` returns an ``httpx2.AsyncClient`` wired with all three; the
official MCP SDK takes it (``streamable_http_client(url, http_client=...)``). Refusals
raise ``OutboundRefused`` subclasses, apart from httpx2's network errors.

httpx2's ``AsyncHTTPTransport`` takes no network backend, but httpcore2's public
``AsyncConnectionPool`` does. So ``GuardedTransport`` is a public ``AsyncBaseTransport``
over that pool, converting requests, responses and errors itself.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
)
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpcore2
import httpx2

from sageproject.config import parse_host
from sageproject.errors import ErrorCategory, SageError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]

MCP_SETTING = "SAGE_MCP_ALLOWED_HOSTS"

# NAT64's well-known prefix (RFC 6052): 64:ff9b::7f00:1 reaches 127.0.0.1 via a gateway.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
_DEFAULT_PORTS = {"http": 80, "https": 443}


class OutboundRefused(SageError):
    """A request to a user-given URL that the policy refuses (never sent)."""

    default_category = ErrorCategory.VALIDATION


class UrlRefused(OutboundRefused):
    """The URL itself is refused (``outbound.url_refused``)."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__("outbound.url_refused", message, details=details)


class AddressRefused(OutboundRefused):
    """The host is, or resolves to, a refused address (``outbound.address_refused``)."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__("outbound.address_refused", message, details=details)


class ResponseTooLarge(SageError):
    """A body (or one event of a stream) over the cap (``outbound.response_too_large``)."""

    default_category = ErrorCategory.UPSTREAM

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__("outbound.response_too_large", message, details=details)


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboundPolicy:
    """Where requests to user-given URLs may go, and their caps.

    ``allowed_hosts`` are the operator's: host names or IP addresses, each with an
    optional port (``parse_host``). Only they may use plain ``http`` or a loopback,
    link-local or private address. ``setting`` names their variable in messages.
    The timeouts are caps: a request may ask for shorter ones, never longer.
    """

    setting: str
    allowed_hosts: frozenset[str] = frozenset()
    connect_timeout: float = 10.0
    # Time without a byte, not a whole response: an MCP server holds streams open.
    read_timeout: float = 300.0
    max_response_bytes: int = 4 * 1024 * 1024
    # (host, port or None), parsed once from allowed_hosts.
    _allowed: frozenset[tuple[str, int | None]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", frozenset(self.allowed_hosts))
        # Canonical as hosts are compared: 127.1 and 127.0.0.1 are one address.
        allowed = frozenset(
            (_canonical(host), port) for host, port in map(parse_host, self.allowed_hosts)
        )
        object.__setattr__(self, "_allowed", allowed)

    def allows(self, host: str, port: int) -> bool:
        """Whether the operator allows ``host`` on ``port`` (any port when listed without)."""
        name = _canonical(host)
        return (name, None) in self._allowed or (name, port) in self._allowed


def policy_from(
    setting: str, values: Mapping[str, Any] | None = None, **caps: Any
) -> OutboundPolicy:
    """The policy of the allowed-hosts setting ``setting``, with ``caps`` (timeouts,
    ``max_response_bytes``) over the defaults. ``values`` are the loaded settings
    (``sageproject.config.load``); None reads Django's ``settings.SAGE``."""
    if values is None:
        from django.conf import settings

        values = settings.SAGE
    return OutboundPolicy(
        setting=setting, allowed_hosts=frozenset(values.get(setting) or ()), **caps
    )


def mcp_policy(values: Mapping[str, Any] | None = None, **caps: Any) -> OutboundPolicy:
    """The policy for remote MCP servers (``SAGE_MCP_ALLOWED_HOSTS``)."""
    return policy_from(MCP_SETTING, values, **caps)


# ------------------------------------------------------------------ addresses


def address_kind(address: IPAddress) -> str | None:
    """Why ``address`` is refused ("loopback", "link-local", ...), or None when public.

    An IPv6 address that embeds an IPv4 one (mapped, compatible, NAT64, 6to4) is
    judged by the IPv4 address it reaches.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return address_kind(embedded)
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address in _SHARED:
        return "shared (carrier-grade NAT)"
    if address.is_reserved:  # before private: Python counts 240/4 as both
        return "reserved"
    if address.is_private:
        return "private"
    if not address.is_global:  # documentation, benchmarking and other special ranges
        return "reserved"
    return None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    # IPv4-compatible (::a.b.c.d, deprecated): :: and ::1 are IPv6's own.
    if int(address) >> 32 == 0 and int(address) > 1:
        return ipaddress.IPv4Address(int(address))
    return None


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


def literal_address(host: str) -> IPAddress | None:
    """``host`` as an IP address when it is one, in any form the resolver would take
    (``127.1``, ``2130706433``, ``0x7f.0.0.1``); None for a host name."""
    host = host.strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        # inet_aton is what getaddrinfo applies to such hosts: judge them alike.
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to (TCP), in the resolver's order.

    The guarded backend calls this once per new connection; tests replace it
    (``monkeypatch.setattr(outbound, "resolve", ...)``) or pass ``resolver=``.
    """
    literal = literal_address(host)
    if literal is not None:
        return [literal]
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise httpcore2.ConnectError(f"cannot resolve {host}: {exc}") from exc
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


# ------------------------------------------------------------------ URLs


def check_url(url: str | httpx2.URL, policy: OutboundPolicy) -> httpx2.URL:
    """Check a user-given URL without DNS; return it parsed.

    Raises ``UrlRefused`` when the scheme is not ``https`` (``http`` only to an
    allowed host), the URL carries a user or password, it names no host, or it
    names a literal address that is not public (``details["kind"]`` says which) and
    not allowed. A host name's addresses are checked at connect time instead.
    Messages name the host, never the path, query or userinfo.
    """
    try:
        parsed = httpx2.URL(url)
    except httpx2.InvalidURL as exc:
        raise UrlRefused(f"not a URL: {exc}") from None
    # The ASCII form (IDNA) is the one connections and the allowed list use.
    scheme, host = parsed.scheme, parsed.raw_host.decode("ascii")
    if scheme not in _DEFAULT_PORTS:
        raise UrlRefused(
            f"only https URLs are allowed (got {scheme or 'no'} scheme)", scheme=scheme
        )
    if not host:
        raise UrlRefused("the URL names no host")
    if parsed.userinfo:
        raise UrlRefused(
            f"a URL to {host} must not carry a user name or password; send credentials as headers",
            host=host,
        )
    port = parsed.port or _DEFAULT_PORTS[scheme]
    if policy.allows(host, port):
        return parsed
    literal = literal_address(host)
    kind = address_kind(literal) if literal is not None else None
    if kind is not None:
        raise UrlRefused(
            f"{literal} is {_article(kind)} {kind} address; only hosts in {policy.setting} "
            "may reach one",
            host=host,
            address=str(literal),
            kind=kind,
        )
    if scheme == "http":
        shown = f"[{host}]" if ":" in host else host
        raise UrlRefused(
            f"http://{shown}: http is only allowed for hosts in {policy.setting}; use https",
            host=host,
        )
    return parsed


def _canonical(host: str) -> str:
    literal = literal_address(host)
    return str(literal) if literal is not None else host.lower().rstrip(".")


# ------------------------------------------------------------------ the network backend


class GuardedNetworkBackend(httpcore2.AsyncNetworkBackend):
    """httpcore2's network backend with the address check and the pinning.

    ``connect_tcp`` resolves the host once (``resolver``, default ``resolve``),
    refuses it unless every address is public or the host is allowed, then opens
    the connection to a checked address through ``inner`` (httpcore2's AnyIO
    backend by default). The host name is not passed down, so nothing resolves it
    again; httpcore2 still uses it for TLS (SNI and the certificate's name).
    """

    def __init__(
        self,
        policy: OutboundPolicy,
        *,
        resolver: Resolver | None = None,
        inner: httpcore2.AsyncNetworkBackend | None = None,
    ) -> None:
        self._policy = policy
        self._resolver = resolver
        self._inner = inner if inner is not None else httpcore2.AnyIOBackend()

    async def checked_addresses(self, host: str, port: int) -> list[IPAddress]:
        """The addresses to connect to, each checked; raises ``AddressRefused``."""
        resolver = self._resolver or resolve  # looked up now: tests may replace it
        addresses = await resolver(host, port)
        if not addresses:
            raise httpcore2.ConnectError(f"{host} resolves to no address")
        if self._policy.allows(host, port):
            return addresses
        for address in addresses:
            kind = address_kind(address)
            if kind is None:
                continue
            what = f"{kind} address"
            named = (
                f"{address} is {_article(kind)} {what}"
                if literal_address(host) is not None
                else f"{host} resolves to {address}, {_article(kind)} {what}"
            )
            raise AddressRefused(
                f"{named}; only hosts in {self._policy.setting} may reach one",
                host=host,
                address=str(address),
                kind=kind,
            )
        return addresses

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore2's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        try:
            with anyio.fail_after(timeout):
                addresses = await self.checked_addresses(host, port)
                failure: httpcore2.ConnectError | None = None
                for address in addresses:
                    try:
                        return await self._inner.connect_tcp(
                            str(address),
                            port,
                            local_address=local_address,
                            socket_options=socket_options,
                        )
                    except httpcore2.ConnectError as exc:
                        failure = exc
                assert failure is not None
                raise failure
        except TimeoutError:
            raise httpcore2.ConnectTimeout(
                f"no connection to {host}:{port} within {timeout} s"
            ) from None

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore2's interface)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        raise AddressRefused("a Unix socket is never an outbound destination")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# ------------------------------------------------------------------ the transport

# httpcore2's errors as httpx2's (subclasses first), so callers see httpx2's as usual.
_ERRORS: tuple[tuple[type[Exception], type[httpx2.TransportError]], ...] = (
    (httpcore2.ConnectTimeout, httpx2.ConnectTimeout),
    (httpcore2.ReadTimeout, httpx2.ReadTimeout),
    (httpcore2.WriteTimeout, httpx2.WriteTimeout),
    (httpcore2.PoolTimeout, httpx2.PoolTimeout),
    (httpcore2.TimeoutException, httpx2.TimeoutException),
    (httpcore2.ConnectError, httpx2.ConnectError),
    (httpcore2.ReadError, httpx2.ReadError),
    (httpcore2.WriteError, httpx2.WriteError),
    (httpcore2.NetworkError, httpx2.NetworkError),
    (httpcore2.UnsupportedProtocol, httpx2.UnsupportedProtocol),
    (httpcore2.LocalProtocolError, httpx2.LocalProtocolError),
    (httpcore2.RemoteProtocolError, httpx2.RemoteProtocolError),
    (httpcore2.ProtocolError, httpx2.ProtocolError),
)


@contextlib.contextmanager
def _httpx2_errors(request: httpx2.Request, timeouts: Mapping[str, float]) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for core, ours in _ERRORS:
            if isinstance(exc, core):
                raise ours(_error_message(exc, request, timeouts), request=request) from exc
        raise


def _error_message(exc: Exception, request: httpx2.Request, timeouts: Mapping[str, float]) -> str:
    host = request.url.host
    if isinstance(exc, httpcore2.ReadTimeout):
        return f"{host} sent nothing for {timeouts['read']} s (read timeout)"
    if isinstance(exc, httpcore2.WriteTimeout):
        return f"{host} took nothing for {timeouts['write']} s (write timeout)"
    if isinstance(exc, httpcore2.ConnectTimeout):
        return f"no connection to {host} within {timeouts['connect']} s (connect timeout)"
    return f"{host}: {exc}" if str(exc) else f"{host}: {type(exc).__name__}"


class GuardedTransport(httpx2.AsyncBaseTransport):
    """An httpx2 transport that applies an ``OutboundPolicy`` to every request.

    Each request (each redirect hop too) passes ``check_url``; its connection comes
    from an httpcore2 pool over ``GuardedNetworkBackend``; its timeouts are capped
    by the policy's; its body is capped (``ResponseTooLarge``).
    """

    def __init__(
        self,
        policy: OutboundPolicy,
        *,
        resolver: Resolver | None = None,
        network_backend: httpcore2.AsyncNetworkBackend | None = None,
        verify: Any = True,
        limits: httpx2.Limits | None = None,
    ) -> None:
        limits = limits or httpx2.Limits(max_connections=20, max_keepalive_connections=5)
        self._policy = policy
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=httpx2.create_ssl_context(verify=verify, trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=GuardedNetworkBackend(policy, resolver=resolver, inner=network_backend),
        )

    def _timeouts(self, request: httpx2.Request) -> dict[str, float]:
        asked = request.extensions.get("timeout") or {}
        caps = {
            "connect": self._policy.connect_timeout,
            "read": self._policy.read_timeout,
            "write": self._policy.read_timeout,
            "pool": self._policy.connect_timeout,
        }
        return {
            name: cap if asked.get(name) is None else min(cap, asked[name])
            for name, cap in caps.items()
        }

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        check_url(request.url, self._policy)
        assert isinstance(request.stream, AsyncIterable)
        timeouts = self._timeouts(request)
        core_request = httpcore2.Request(
            method=request.method,
            url=httpcore2.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions={**request.extensions, "timeout": timeouts},
        )
        with _httpx2_errors(request, timeouts):
            response = await self._pool.handle_async_request(core_request)
        headers = httpx2.Headers(response.headers)
        cap = self._policy.max_response_bytes
        events = headers.get("content-type", "").lower().startswith("text/event-stream")
        length = headers.get("content-length", "")
        if not events and length.isdigit() and int(length) > cap:
            await response.aclose()
            raise ResponseTooLarge(
                f"{request.url.host} announced {length} bytes; the cap is {cap}",
                host=request.url.host,
                max_bytes=cap,
            )
        assert isinstance(response.stream, AsyncIterable)
        return httpx2.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_CappedStream(
                response.stream, request=request, cap=cap, events=events, timeouts=timeouts
            ),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


# An SSE event ends at a blank line; any of the three line ends may be used.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class _EventMeter:
    """Sizes of the events of a byte stream, fed chunk by chunk.

    A cap, not a parser: it only finds where events end. The last three bytes are
    kept, so an end split across two chunks is still seen.
    """

    def __init__(self) -> None:
        self._open = 0  # bytes of the event not yet ended
        self._tail = b""

    def feed(self, chunk: bytes) -> int:
        """The largest event this chunk ends or extends, in bytes."""
        seen = self._tail + chunk
        largest, start = 0, 0  # start: where the open event began within chunk
        for match in _EVENT_END.finditer(seen):
            end = match.end() - len(self._tail)
            if end <= 0:
                continue  # an end already counted with the previous chunk
            largest = max(largest, self._open + end - start)
            self._open, start = 0, end
        self._open += len(chunk) - start
        self._tail = seen[-3:]
        return max(largest, self._open)


class _CappedStream(httpx2.AsyncByteStream):
    """A response body that stops at the cap: in total, or per event for an event stream."""

    def __init__(
        self,
        stream: AsyncIterable[bytes],
        *,
        request: httpx2.Request,
        cap: int,
        events: bool,
        timeouts: Mapping[str, float],
    ) -> None:
        self._stream = stream
        self._request = request
        self._cap = cap
        self._events = events
        self._timeouts = timeouts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        counted, meter = 0, _EventMeter() if self._events else None
        with _httpx2_errors(self._request, self._timeouts):
            async for chunk in self._stream:
                if meter is not None:
                    counted = meter.feed(chunk)
                else:
                    counted += len(chunk)
                if counted > self._cap:
                    what = "one event of the stream" if self._events else "the response"
                    raise ResponseTooLarge(
                        f"{what} from {self._request.url.host} exceeds {self._cap} bytes",
                        host=self._request.url.host,
                        max_bytes=self._cap,
                    )
                yield chunk

    async def aclose(self) -> None:
        close = getattr(self._stream, "aclose", None)
        if close is not None:
            await close()


def async_client(
    policy: OutboundPolicy,
    *,
    headers: Mapping[str, str] | None = None,
    auth: httpx2.Auth | None = None,
    follow_redirects: bool = False,
    max_redirects: int = 5,
    resolver: Resolver | None = None,
    network_backend: httpcore2.AsyncNetworkBackend | None = None,
    verify: Any = True,
) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` whose every request obeys ``policy``.

    Redirects are not followed unless asked; a followed hop passes the same checks.
    No environment is trusted: no proxy variables, no ``.netrc`` credentials.
    ``resolver`` and ``network_backend`` replace the DNS lookup and the socket layer
    (tests); ``verify`` is httpx2's (an ``ssl.SSLContext`` for a private CA).
    Use it as an async context manager, or ``aclose`` it.
    """
    timeout = httpx2.Timeout(
        policy.read_timeout, connect=policy.connect_timeout, pool=policy.connect_timeout
    )
    return httpx2.AsyncClient(
        transport=GuardedTransport(
            policy, resolver=resolver, network_backend=network_backend, verify=verify
        ),
        headers=dict(headers or {}),
        auth=auth,
        timeout=timeout,
        follow_redirects=follow_redirects,
        max_redirects=max_redirects,
        trust_env=False,
    )


def outbound_error(exc: BaseException) -> SageError | None:
    """The guarded client's error inside ``exc``, or None.

    The MCP SDK runs requests in task groups, so a refusal reaches its caller wrapped
    in exception groups or chained; this finds it there.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (OutboundRefused, ResponseTooLarge)):
            return current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None
