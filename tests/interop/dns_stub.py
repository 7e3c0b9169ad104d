"""A minimal authoritative DNS server on UDP for tests: one name, several A/AAAA records.

It plays the part of a headless Kubernetes Service's DNS: a name that resolves to every
replica's address. A gRPC client pointed at ``dns://127.0.0.1:PORT/NAME:PORT`` resolves
NAME through it. Other names get NXDOMAIN; other record types an empty answer.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading

_A, _AAAA, _IN = 1, 28, 1


def _read_name(packet: bytes, offset: int) -> tuple[str, int]:
    labels: list[str] = []
    while True:
        length = packet[offset]
        offset += 1
        if length == 0:
            return ".".join(labels), offset
        labels.append(packet[offset:offset + length].decode("ascii", "replace"))
        offset += length


class DnsStub:
    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name = name.rstrip(".").lower()
        self.addresses = [ipaddress.ip_address(a) for a in addresses]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.queries: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> DnsStub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()  # recvfrom raises OSError: the thread ends
        self._thread.join(5)

    def answer(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        ident, flags, qdcount = struct.unpack(">HHH", query[:6])
        if flags & 0x8000 or qdcount != 1:
            return None
        name, end = _read_name(query, 12)
        qtype, qclass = struct.unpack(">HH", query[end:end + 4])
        question = query[12:end + 4]
        self.queries.append((name, qtype))
        records = []
        if name.rstrip(".").lower() == self.name and qclass == _IN:
            for addr in self.addresses:
                if (qtype, addr.version) in ((_A, 4), (_AAAA, 6)):
                    rdata = addr.packed
                    # name as a pointer to the question's (offset 12), IN, TTL 1 s
                    records.append(struct.pack(">HHHIH", 0xC00C, qtype, _IN, 1, len(rdata))
                                   + rdata)
            rcode = 0
        else:
            rcode = 3  # NXDOMAIN
        header = struct.pack(">HHHHHH", ident, 0x8400 | (flags & 0x0100) | rcode, 1,
                             len(records), 0, 0)  # QR, AA, RD copied
        return header + question + b"".join(records)

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            try:
                reply = self.answer(query)
            except (IndexError, struct.error):
                reply = None
            if reply is not None:
                try:
                    self.sock.sendto(reply, peer)
                except OSError:
                    return
