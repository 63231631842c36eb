"""The SSRF guard for callback URLs, and a transport that connects only to the address it checked.

A callback URL is parsed the way the HTTP client (httpx) will parse it, so the host checked is the
host connected to. An IP literal in any spelling the C resolver accepts (`2130706433`, `0x7f.1`,
`017700000001`: inet_aton's forms, which WHATWG URL parsing shares) is read as that address; a name
is resolved and *every* A/AAAA record must pass, because the client may pick any. An address passes
unless it is unspecified, loopback, link-local, multicast, private or otherwise not globally routable
(also when it hides inside an IPv6 form: `::ffff:10.0.0.1`, 6to4, NAT64 `64:ff9b::/96`), or unless an
allow-listed CIDR (`webhook_allow_cidrs`) holds it. The check runs at submit and again before each
attempt (DNS can change), and the attempt then connects to the addresses this check returned (the
first MAX_ADDRESSES of them), never resolving again (no window for DNS rebinding), while the URL's host
stays the Host header and SNI. An attempt has one wall-clock deadline for connecting, TLS, sending
and reading together: every socket operation waits at most the time left, so a receiver that never
answers, or trickles a byte a second, holds a delivery slot no longer than the deadline.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from app.core.errors import InvalidRequest

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]
MAX_URL_LENGTH = 2048
SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: not global, not "private" to Python
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d
NUMBER = re.compile(r"(0[xX][0-9a-fA-F]*|[0-9]+)")
# Addresses one attempt tries: a name with dozens of records (all unreachable) would otherwise spend
# the whole deadline on connects; three covers a dual-stack pair and a fallback.
MAX_ADDRESSES = 3


class Reason(enum.StrEnum):
    INVALID_URL = "invalid_url"
    SCHEME = "scheme"
    UNRESOLVABLE = "unresolvable"
    UNSPECIFIED = "unspecified"
    LOOPBACK = "loopback"
    LINK_LOCAL = "link_local"
    MULTICAST = "multicast"
    PRIVATE = "private"
    RESERVED = "reserved"
    DISABLED = "endpoint_disabled"  # answered 410 Gone (app/webhooks/delivery.py)


class CallbackRefused(InvalidRequest):
    """A callback URL the guard refuses: 422, with `details.reason` one of `Reason`."""

    code = "callback_url_refused"

    def __init__(self, message: str, *, reason: Reason, **details: Any) -> None:
        super().__init__(message, reason=str(reason), **details)
        self.reason = reason


@dataclass(frozen=True)
class Target:
    """A checked callback: connect to `addresses` (in order) for `host`, and nowhere else."""

    url: str
    host: str  # as the client sends it to the network layer (IDNA, no brackets)
    port: int
    addresses: tuple[str, ...]


def system_resolver(host: str, port: int) -> list[str]:
    """Every A and AAAA record of `host`, in the resolver's order, without duplicates."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Guard:
    """Checks callback URLs. Built from the settings' allow-list; the resolver is injectable (tests)."""

    def __init__(self, allow_cidrs: Iterable[str] = (), resolver: Resolver = system_resolver) -> None:
        self.allow = tuple(ipaddress.ip_network(c, strict=False) for c in allow_cidrs)
        self.resolver = resolver

    def check(self, url: str) -> Target:
        """The URL's checked target; raises CallbackRefused. Blocking (DNS): call off the event loop."""
        host, port = parse(url)
        literal = ip_literal(host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = [_address(a) for a in self.resolver(host, port)]
            except (OSError, UnicodeError, ValueError) as exc:
                raise CallbackRefused(
                    f"callback host {host!r} does not resolve ({exc})", reason=Reason.UNRESOLVABLE, host=host
                ) from exc
            if not addresses:
                raise CallbackRefused(
                    f"callback host {host!r} has no address", reason=Reason.UNRESOLVABLE, host=host
                )
        for ip in addresses:
            reason = refusal(ip)
            if reason is not None and not self.allowed(ip):
                # The address a name resolved to stays here: naming it would map the internal network
                # for whoever submits names to probe.
                where = f"is {ip}" if literal is not None else "resolves to"
                raise CallbackRefused(
                    f"callback URL refused: {host!r} {where} a {reason.replace('_', '-')} address",
                    reason=reason,
                    host=host,
                )
        return Target(url=url, host=host, port=port, addresses=tuple(str(ip) for ip in addresses))

    def allowed(self, ip: IP) -> bool:
        return any(
            a in net for a in (ip, *embedded_ipv4(ip)) for net in self.allow if a.version == net.version
        )


def parse(url: str) -> tuple[str, int]:
    """The (host, port) httpx will connect to for `url`; only http and https, no odd host spellings."""
    if len(url) > MAX_URL_LENGTH:
        raise CallbackRefused(f"callback_url is longer than {MAX_URL_LENGTH}", reason=Reason.INVALID_URL)
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise CallbackRefused(f"callback_url is not a valid URL: {exc}", reason=Reason.INVALID_URL) from exc
    if parsed.scheme not in ("http", "https"):
        raise CallbackRefused("callback_url must be http or https", reason=Reason.SCHEME)
    host = parsed.raw_host.decode("ascii")
    if not host or "%" in host:  # empty, percent-encoded, or an IPv6 zone: nothing to deliver to
        raise CallbackRefused(f"callback_url has no usable host: {host!r}", reason=Reason.INVALID_URL)
    return host, parsed.port or (443 if parsed.scheme == "https" else 80)


def ip_literal(host: str) -> IP | None:
    """The address `host` spells, in any form the resolver would read as one; None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if not NUMBER.fullmatch(labels[-1]):
        return None  # a name (WHATWG: a host whose last label is a number is an IPv4 address)
    value = numeric_ipv4(labels)
    if value is None:
        raise CallbackRefused(
            f"callback host {host!r} is not a valid IPv4 address", reason=Reason.INVALID_URL
        )
    return value


def numeric_ipv4(labels: Sequence[str]) -> ipaddress.IPv4Address | None:
    """inet_aton's reading: 1 to 4 parts, each decimal, 0x-hex or 0-octal, the last filling the
    remaining bytes (`127.1` is 127.0.0.1, `2130706433` too). None if the parts are no such address."""
    if not 1 <= len(labels) <= 4:
        return None
    values = []
    for part in labels:
        if part[:2].lower() == "0x":
            digits, base = part[2:] or "0", 16
        elif len(part) > 1 and part.startswith("0"):
            digits, base = part[1:], 8
        else:
            digits, base = part, 10
        try:
            values.append(int(digits, base))
        except ValueError:
            return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (4 - len(head)):
        return None
    return ipaddress.IPv4Address(sum(v << 8 * (3 - i) for i, v in enumerate(head)) + last)


def embedded_ipv4(ip: IP) -> tuple[ipaddress.IPv4Address, ...]:
    """IPv4 addresses an IPv6 address carries (and reaches): mapped, 6to4, NAT64, IPv4-compatible."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return ()
    if ip.ipv4_mapped is not None:
        return (ip.ipv4_mapped,)
    if ip.sixtofour is not None:
        return (ip.sixtofour,)
    if any(ip in net for net in (*NAT64, IPV4_COMPATIBLE)) and int(ip) > 1:
        return (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF),)
    return ()


def refusal(ip: IP) -> Reason | None:
    """Why a callback may not go to `ip` (None: a global unicast address)."""
    inner = embedded_ipv4(ip)
    for candidate in inner:
        reason = _category(candidate)
        if reason is not None:
            return reason
    if isinstance(ip, ipaddress.IPv6Address) and (ip.ipv4_mapped is not None or any(ip in n for n in NAT64)):
        return None  # it reaches exactly the IPv4 address just checked (a DNS64 network answers so)
    if inner and ip in IPV4_COMPATIBLE:
        return Reason.RESERVED  # deprecated form: nothing legitimate uses it
    return _category(ip)


def _category(ip: IP) -> Reason | None:
    if ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in THIS_NETWORK):
        return Reason.UNSPECIFIED
    if ip.is_loopback:
        return Reason.LOOPBACK
    if ip.is_link_local:
        return Reason.LINK_LOCAL
    if ip.is_multicast:
        return Reason.MULTICAST
    if ip.is_reserved:
        return Reason.RESERVED
    if ip.is_private or (isinstance(ip, ipaddress.IPv4Address) and ip in SHARED):
        return Reason.PRIVATE
    if not ip.is_global:
        return Reason.RESERVED
    return None


def _address(text: str) -> IP:
    return ipaddress.ip_address(text.split("%", 1)[0])


class Deadline:
    """One attempt's wall-clock limit (monotonic). `left` is what the next socket operation may wait."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.at = clock() + seconds

    def left(self, timeout: float | None, error: type[Exception]) -> float:
        remaining = self.at - self.clock()
        if remaining <= 0:
            raise error("the delivery attempt ran past its deadline")
        return remaining if timeout is None else min(timeout, remaining)


class DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read, write and TLS handshake waits at most until the deadline (CPython
    bounds a whole handshake by the socket timeout). Writes go to the socket one `send` at a time,
    each with the time left: httpcore's own loop would give every partial send the full timeout."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: Deadline) -> None:
        self.stream = stream
        self.deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.stream.read(max_bytes, self.deadline.left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        sock = self.stream.get_extra_info("socket")
        while buffer:
            sock.settimeout(self.deadline.left(timeout, httpcore.WriteTimeout))
            try:
                sent = sock.send(buffer)
            except TimeoutError as exc:
                raise httpcore.WriteTimeout(str(exc)) from exc
            except OSError as exc:
                raise httpcore.WriteError(str(exc)) from exc
            buffer = buffer[sent:]

    def close(self) -> None:
        self.stream.close()

    def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = self.deadline.left(timeout, httpcore.ConnectTimeout)
        return DeadlineStream(self.stream.start_tls(ssl_context, server_hostname, left), self.deadline)

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class PinnedBackend(httpcore.SyncBackend):
    """Connects to the checked addresses only (the first MAX_ADDRESSES): the name is never resolved
    again, and a connection for any other host (there should be none: redirects are not followed) is
    refused. With a deadline, the connects and the connection share it."""

    def __init__(self, target: Target, deadline: Deadline | None = None) -> None:
        self.target = target
        self.deadline = deadline

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        if host != self.target.host or port != self.target.port:
            raise httpcore.ConnectError(f"{host}:{port} was not checked; only {self.target.host} was")
        error: Exception | None = None
        for address in self.target.addresses[:MAX_ADDRESSES]:  # in the resolver's order, as a client would
            try:
                if self.deadline is None:
                    return super().connect_tcp(address, port, timeout, local_address, socket_options)
                left = self.deadline.left(timeout, httpcore.ConnectTimeout)
                stream = super().connect_tcp(address, port, left, local_address, socket_options)
                return DeadlineStream(stream, self.deadline)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error


@functools.cache
def tls_context(verify: bool) -> ssl.SSLContext:
    """The process's TLS context for deliveries (certifi's CAs; none with verify=False), shared by
    every attempt's transport: building one reads and parses the CA bundle, about 20 ms of CPU,
    which each attempt paid twice."""
    return httpx.create_ssl_context(verify=verify, trust_env=False)


def pinned_transport(
    target: Target, *, verify: bool = True, deadline: Deadline | None = None
) -> httpx.HTTPTransport:
    """An httpx transport that reaches `target` at its checked addresses; the URL's host stays the
    Host header and the TLS server name (the certificate is verified against it). No proxies. With a
    `deadline`, no socket operation of the attempt waits past it."""
    context = tls_context(verify)
    transport = httpx.HTTPTransport(verify=context, trust_env=False)
    # httpx takes no network backend, but its pool is httpcore's, which does: replace the pool.
    transport._pool = httpcore.ConnectionPool(
        ssl_context=context,
        max_connections=1,
        network_backend=PinnedBackend(target, deadline),
    )
    return transport
