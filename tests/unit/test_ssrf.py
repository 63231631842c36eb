"""The SSRF guard for callback URLs (no DNS: the resolver is passed in) and the pinned transport."""

from __future__ import annotations

import http.server
import ipaddress
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from app.webhooks.ssrf import CallbackRefused, Guard, Reason, Target, numeric_ipv4, pinned_transport, refusal

NAMES = {
    "public.example": ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"],
    "mixed.example": ["93.184.216.34", "10.0.0.5"],  # one bad record is enough to refuse
    "metadata.example": ["169.254.169.254"],
    "v6only.example": ["fd00::1"],
    "dns64.example": ["64:ff9b::5db8:d822"],  # 93.184.216.34 through NAT64: fine
}


def resolver(host: str, port: int) -> list[str]:
    if host in NAMES:
        return NAMES[host]
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


def literal_only(host: str, port: int) -> list[str]:
    raise AssertionError(f"an IP literal was resolved: {host}")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1/", Reason.LOOPBACK),
        ("http://[::1]/", Reason.LOOPBACK),
        ("http://169.254.169.254/latest/meta-data/", Reason.LINK_LOCAL),
        ("http://10.0.0.1/", Reason.PRIVATE),
        ("http://2130706433/", Reason.LOOPBACK),  # decimal 127.0.0.1
        ("http://[::ffff:10.0.0.1]/", Reason.PRIVATE),  # IPv4-mapped
        ("http://[::ffff:7f00:1]/", Reason.LOOPBACK),
        ("http://0x7f000001/", Reason.LOOPBACK),  # hex
        ("http://0x7f.1/", Reason.LOOPBACK),
        ("http://017700000001/", Reason.LOOPBACK),  # octal
        ("http://0177.1/", Reason.LOOPBACK),
        ("http://127.1:8000/", Reason.LOOPBACK),
        ("https://0/", Reason.UNSPECIFIED),
        ("http://0.0.0.0/", Reason.UNSPECIFIED),
        ("http://[::]/", Reason.UNSPECIFIED),
        ("http://192.168.1.10/", Reason.PRIVATE),
        ("http://172.16.5.4/", Reason.PRIVATE),
        ("http://100.64.0.1/", Reason.PRIVATE),  # carrier-grade NAT
        ("http://[fd12::1]/", Reason.PRIVATE),
        ("http://[fe80::1]/", Reason.LINK_LOCAL),
        ("http://224.0.0.1/", Reason.MULTICAST),
        ("http://[ff02::1]/", Reason.MULTICAST),
        ("http://240.0.0.1/", Reason.RESERVED),
        ("http://255.255.255.255/", Reason.RESERVED),
        ("http://[64:ff9b::a00:1]/", Reason.PRIVATE),  # NAT64 of 10.0.0.1
        ("http://[2002:a00:1::]/", Reason.PRIVATE),  # 6to4 of 10.0.0.1
        ("http://[::a00:1]/", Reason.PRIVATE),  # IPv4-compatible 10.0.0.1
        ("http://[::5db8:d822]/", Reason.RESERVED),  # IPv4-compatible, public: a deprecated form
    ],
)
def test_internal_addresses_are_refused_in_every_spelling(url: str, reason: Reason) -> None:
    with pytest.raises(CallbackRefused) as refused:
        Guard(resolver=literal_only).check(url)
    assert refused.value.reason == reason
    assert refused.value.status == 422 and refused.value.code == "callback_url_refused"
    assert refused.value.details["reason"] == str(reason)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://mixed.example/hook", Reason.PRIVATE),
        ("https://metadata.example/", Reason.LINK_LOCAL),
        ("http://v6only.example/", Reason.PRIVATE),
        ("http://nowhere.example/", Reason.UNRESOLVABLE),
    ],
)
def test_every_resolved_record_is_checked(url: str, reason: Reason) -> None:
    with pytest.raises(CallbackRefused) as refused:
        Guard(resolver=resolver).check(url)
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://public.example/", Reason.SCHEME),
        ("file:///etc/passwd", Reason.SCHEME),
        ("gopher://public.example:70/", Reason.SCHEME),
        ("http://0177.0.0.1/", Reason.INVALID_URL),  # httpx refuses this octal form outright
        ("http://1.2.3.4.5/", Reason.INVALID_URL),
        ("http://256.1.1.1/", Reason.INVALID_URL),
        ("http://%31%32%37.0.0.1/", Reason.INVALID_URL),
        ("http:///nohost", Reason.INVALID_URL),
        ("not a url", Reason.SCHEME),
        ("http://public.example/" + "x" * 2100, Reason.INVALID_URL),
    ],
)
def test_malformed_and_non_http_urls_are_refused(url: str, reason: Reason) -> None:
    with pytest.raises(CallbackRefused) as refused:
        Guard(resolver=resolver).check(url)
    assert refused.value.reason == reason


def test_a_public_name_passes_with_every_address_to_connect_to() -> None:
    target = Guard(resolver=resolver).check("https://public.example/hooks?x=1")
    assert target == Target(
        url="https://public.example/hooks?x=1",
        host="public.example",
        port=443,
        addresses=("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"),
    )


def test_public_literals_pass_in_any_spelling() -> None:
    guard = Guard(resolver=literal_only)
    assert guard.check("http://134744072:8080/").addresses == ("8.8.8.8",)  # decimal 8.8.8.8
    assert guard.check("http://[2001:4860:4860::8888]/").addresses == ("2001:4860:4860::8888",)
    assert Guard(resolver=resolver).check("http://dns64.example/").addresses == ("64:ff9b::5db8:d822",)


def test_the_allow_list_admits_its_cidrs_only() -> None:
    guard = Guard(["127.0.0.0/8", "10.1.0.0/16"], resolver=literal_only)
    assert guard.check("http://127.0.0.2:9000/hook").addresses == ("127.0.0.2",)
    assert (
        guard.check("http://[::ffff:127.0.0.1]/").host == "::ffff:127.0.0.1"
    )  # mapped form of an allowed one
    assert guard.check("http://10.1.2.3/").port == 80
    for url in ("http://10.2.0.1/", "http://[::1]/", "http://169.254.169.254/"):
        with pytest.raises(CallbackRefused):
            guard.check(url)


def test_numeric_ipv4_reads_as_inet_aton_does() -> None:
    for text in (
        "127.0.0.1",
        "127.1",
        "2130706433",
        "0x7f000001",
        "0x7F.0.0.1",
        "0177.0.0.01",
        "017700000001",
    ):
        assert numeric_ipv4(text.split(".")) == ipaddress.IPv4Address("127.0.0.1"), text
        assert socket.inet_aton(text) == socket.inet_aton("127.0.0.1")  # what the C library would reach
    for text in ("1.2.3.4.5", "256.0.0.1", "1.2.65536", "4294967296", "08.0.0.1", "0xg.1"):
        assert numeric_ipv4(text.split(".")) is None, text


def test_classification_of_bare_addresses() -> None:
    assert refusal(ipaddress.ip_address("::ffff:10.0.0.1")) == Reason.PRIVATE
    assert refusal(ipaddress.ip_address("8.8.8.8")) is None
    assert refusal(ipaddress.ip_address("::ffff:8.8.8.8")) is None  # reaches exactly 8.8.8.8


class _Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = (self.headers.get("host") or "").encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def echo() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    # A short poll: `shutdown()` waits for the loop to look (0.5 s by default, per test).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_pinned_transport_connects_to_the_checked_address_and_keeps_the_host(echo: int) -> None:
    # "receiver.invalid" resolves nowhere: reaching the server proves no lookup was made; 127.0.0.2
    # refuses the connection (the server listens on 127.0.0.1 only), so the next address is tried.
    target = Target(url="", host="receiver.invalid", port=echo, addresses=("127.0.0.2", "127.0.0.1"))
    with httpx.Client(transport=pinned_transport(target), timeout=2) as client:
        answer = client.get(f"http://receiver.invalid:{echo}/hook")
        assert answer.status_code == 200
        assert answer.text == f"receiver.invalid:{echo}"  # the Host header is the URL's
        with pytest.raises(httpx.ConnectError, match="not checked"):
            client.get(f"http://other.invalid:{echo}/")
