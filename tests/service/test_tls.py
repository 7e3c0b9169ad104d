"""TLS and mTLS: certificates made here (a throw-away CA), real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.config import EngineConfig
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.cli import main
from service.server import GenServer, ServerConfig
from tests.service.conftest import new_loop, start_server, stop_server
from tests.service.fake_engine import FakeEngine

Code = grpc.StatusCode


@dataclass
class Pem:
    cert: bytes
    key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(cn: str) -> tuple[Pem, object, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)), key, cert


def make_leaf(ca_key, ca_cert: x509.Certificate, cn: str, *, server: bool) -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(
                   [ExtendedKeyUsageOID.SERVER_AUTH if server
                    else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


@dataclass
class Pki:
    ca: Pem
    server: Pem
    client: Pem
    rogue_ca: Pem  # a CA the server does not trust
    rogue_client: Pem
    dir: Path

    def write(self, name: str, data: bytes) -> str:
        path = self.dir / name
        path.write_bytes(data)
        return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    ca, ca_key, ca_cert = make_ca("genserve test CA")
    rogue_ca, rogue_key, rogue_cert = make_ca("rogue CA")
    return Pki(ca=ca, server=make_leaf(ca_key, ca_cert, "localhost", server=True),
               client=make_leaf(ca_key, ca_cert, "client-1", server=False),
               rogue_ca=rogue_ca,
               rogue_client=make_leaf(rogue_key, rogue_cert, "rogue", server=False),
               dir=tmp_path_factory.mktemp("pki"))


def _engine(tokenizer, tiny_model_dir):
    return FakeEngine(tokenizer, EngineConfig(model=str(tiny_model_dir), max_model_len=256))


@pytest.fixture(scope="module")
def tls_server(pki, tokenizer, tiny_model_dir):
    running, _ = start_server(_engine(tokenizer, tiny_model_dir), structured=None,
                              tls_cert=pki.write("server.pem", pki.server.cert),
                              tls_key=pki.write("server.key", pki.server.key))
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def mtls_server(pki, tokenizer, tiny_model_dir):
    running, _ = start_server(_engine(tokenizer, tiny_model_dir), structured=None,
                              tls_cert=pki.write("server.pem", pki.server.cert),
                              tls_key=pki.write("server.key", pki.server.key),
                              tls_client_ca=pki.write("ca.pem", pki.ca.cert))
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def mtls_server_with_health_port(pki, tokenizer, tiny_model_dir):
    running, _ = start_server(_engine(tokenizer, tiny_model_dir), structured=None,
                              tls_cert=pki.write("server.pem", pki.server.cert),
                              tls_key=pki.write("server.key", pki.server.key),
                              tls_client_ca=pki.write("ca.pem", pki.ca.cert), health_port=0)
    yield running
    stop_server(running)


def _req() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hello TLS", stopping=pb.StoppingCriteria(
        max_new_tokens=4))


def _generate(channel: grpc.Channel) -> pb.GenerateResponse:
    return pb_grpc.GenerationServiceStub(channel).Generate(_req(), timeout=10)


def _secure(address: str, root: bytes, client: Pem | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=root, private_key=client.key if client else None,
        certificate_chain=client.cert if client else None)
    return grpc.secure_channel(address, creds)


def test_tls_call_health_and_reflection_on_one_port(tls_server, pki):
    with _secure(tls_server.address, pki.ca.cert) as ch:
        assert _generate(ch).usage.completion_tokens == 4
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "genserve.v1.GenerationService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10
                                ).status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
        (resp,) = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for s in resp.list_services_response.service}
        assert {"genserve.v1.GenerationService", "grpc.health.v1.Health"} <= names


def test_tls_by_host_name(tls_server, pki):
    with _secure(f"localhost:{tls_server.server.port}", pki.ca.cert) as ch:
        assert _generate(ch).usage.completion_tokens == 4


def test_plaintext_client_fails_against_tls(tls_server):
    with grpc.insecure_channel(tls_server.address) as ch, pytest.raises(grpc.RpcError) as e:
        _generate(ch)
    assert e.value.code() == Code.UNAVAILABLE


def test_client_that_does_not_trust_the_server_fails(tls_server, pki):
    with _secure(tls_server.address, pki.rogue_ca.cert) as ch, \
            pytest.raises(grpc.RpcError) as e:
        _generate(ch)
    assert e.value.code() == Code.UNAVAILABLE


def test_mtls_without_client_cert_fails(mtls_server, pki):
    with _secure(mtls_server.address, pki.ca.cert) as ch, pytest.raises(grpc.RpcError) as e:
        _generate(ch)
    assert e.value.code() == Code.UNAVAILABLE


def test_mtls_with_an_untrusted_client_cert_fails(mtls_server, pki):
    with _secure(mtls_server.address, pki.ca.cert, pki.rogue_client) as ch, \
            pytest.raises(grpc.RpcError) as e:
        _generate(ch)
    assert e.value.code() == Code.UNAVAILABLE


def test_mtls_with_client_cert_works(mtls_server, pki):
    with _secure(mtls_server.address, pki.ca.cert, pki.client) as ch:
        assert _generate(ch).usage.completion_tokens == 4
        assert health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_mtls_rejects_plaintext(mtls_server):
    with grpc.insecure_channel(mtls_server.address) as ch, pytest.raises(grpc.RpcError) as e:
        _generate(ch)
    assert e.value.code() == Code.UNAVAILABLE


def test_incomplete_tls_config_is_refused(pki):
    with pytest.raises(ValueError, match="--tls-key"):
        ServerConfig(tls_cert="server.pem")
    with pytest.raises(ValueError, match="--tls-cert"):
        ServerConfig(tls_key="server.key")
    with pytest.raises(ValueError, match="mTLS"):
        ServerConfig(tls_client_ca="ca.pem")


def test_cli_refuses_a_cert_without_key(capsys, monkeypatch):
    monkeypatch.setattr("service.cli.setup_logging", lambda *a, **k: None)  # keep pytest's
    assert main(["serve", "--tls-cert", "server.pem"]) == 2
    assert "--tls-key" in capsys.readouterr().err


def test_unreadable_key_fails_the_start_naming_the_file(pki, tokenizer, tiny_model_dir,
                                                         tmp_path):
    loop, thread = new_loop()
    config = ServerConfig(host="127.0.0.1", port=0, structured=None,
                          tls_cert=pki.write("server.pem", pki.server.cert),
                          tls_key=str(tmp_path / "nope.key"))

    async def make():  # grpc.aio objects belong to the loop they are created on
        return GenServer(config, _engine(tokenizer, tiny_model_dir))

    server = asyncio.run_coroutine_threadsafe(make(), loop).result(10)
    try:
        with pytest.raises(OSError, match="TLS key .*nope.key"):
            asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    finally:
        asyncio.run_coroutine_threadsafe(server.drain(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_health_port_answers_plaintext_probes_beside_an_mtls_port(mtls_server_with_health_port):
    """What a kubelet gRPC probe does: plaintext Health/Check, on --health-port, while the
    main port accepts only mutually authenticated TLS; nothing else is on that port."""
    running = mtls_server_with_health_port
    with grpc.insecure_channel(f"127.0.0.1:{running.server.health_port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "genserve.v1.GenerationService", "fmaas.GenerationService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationServiceStub(ch).Generate(_req(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(running.address) as ch, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
