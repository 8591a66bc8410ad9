"""A third-party gRPC implementation (Python grpcio, C core) against a real `tunnel cloud`'s
replica listener. Run by grpc_interop.rs:

    python3 grpc_interop.py PROTO_DIR OUT_DIR ADDR CERT_DIR EXPECTED_REPLICA EXPECTED_NODE

Generates the stubs from proto/tunnel.proto into OUT_DIR, then checks with mTLS: health
SERVING, Peer.Routes' first answer (reset, the node held, the callee's PeerHello in the
initial metadata); an unknown method, an oversized and a malformed request answered with
their statuses while a Routes stream opened before them keeps going; and a client without
a certificate refused. Prints one `ok: ...` line per check; any failure raises.
"""

import os
import sys
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_tools import protoc

proto_dir, out_dir, addr, cert_dir, expected_replica, expected_node = sys.argv[1:7]

status = protoc.main(
    [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        os.path.join(proto_dir, "tunnel.proto"),
    ]
)
assert status == 0, f"protoc failed on tunnel.proto: {status}"
sys.path.insert(0, out_dir)
import tunnel_pb2  # noqa: E402
import tunnel_pb2_grpc  # noqa: E402


def read(name):
    with open(os.path.join(cert_dir, name), "rb") as f:
        return f.read()


# The cloud certificate names `tunnel-cloud` (the default peers.server_name); replicas
# present it to each other, and so does this client.
OPTIONS = [("grpc.ssl_target_name_override", "tunnel-cloud")]
TIMEOUT = 10


def channel(with_client_cert):
    if with_client_cert:
        creds = grpc.ssl_channel_credentials(
            root_certificates=read("ca.crt"),
            private_key=read("cloud.key"),
            certificate_chain=read("cloud.crt"),
        )
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=read("ca.crt"))
    return grpc.secure_channel(addr, creds, options=OPTIONS)


def expect_code(call, code, what):
    try:
        result = call()
    except grpc.RpcError as e:
        assert e.code() == code, f"{what}: expected {code}, got {e.code()}: {e.details()}"
        assert e.details(), f"{what}: {e.code()} without a message naming the problem"
        print(f"ok: {what} -> {e.code().name} ({e.details()})")
        return
    raise AssertionError(f"{what}: expected {code}, got an answer: {result!r}")


def check_serving(ch, what):
    health = health_pb2_grpc.HealthStub(ch)
    for service in ["", "tunnel.v1.Peer"]:
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"{service!r}: {reply}"
    print(f"ok: health {what}: SERVING")


ch = channel(with_client_cert=True)
check_serving(ch, "with mTLS")

peer = tunnel_pb2_grpc.PeerStub(ch)
routes = peer.Routes(
    tunnel_pb2.PeerHello(replica_id="python-interop", instance=42), timeout=60
)
first = next(routes)
assert first.reset, f"the first RouteUpdate must have reset set: {first}"
held = [c.node for c in first.held]
assert expected_node in held, f"{expected_node} not in the reset update's claims: {first}"
assert all(c.connected_at_ms > 0 for c in first.held), f"claims without a time: {first}"
metadata = dict(routes.initial_metadata())
assert "tunnel-peer-bin" in metadata, f"no tunnel-peer-bin in {metadata}"
callee = tunnel_pb2.PeerHello.FromString(metadata["tunnel-peer-bin"])
assert callee.replica_id == expected_replica, f"callee hello: {callee}"
assert callee.instance != 0, f"callee hello: {callee}"
print(f"ok: Peer.Routes first answer: reset, held {held}, callee {callee.replica_id}")

raw = dict(request_serializer=None, response_deserializer=None)
expect_code(
    lambda: ch.unary_unary("/tunnel.v1.Peer/NoSuchMethod", **raw)(b"", timeout=TIMEOUT),
    grpc.StatusCode.UNIMPLEMENTED,
    "unknown method",
)
expect_code(
    lambda: ch.unary_unary("/no.such.Service/Call", **raw)(b"", timeout=TIMEOUT),
    grpc.StatusCode.UNIMPLEMENTED,
    "unknown service",
)
huge = tunnel_pb2.PeerHello(replica_id="x" * (1100 * 1024), instance=1)
expect_code(
    lambda: list(peer.Routes(huge, timeout=TIMEOUT)),
    # tonic's answer to a message over its decoding bound (documented in tunnel.proto).
    grpc.StatusCode.OUT_OF_RANGE,
    "oversized PeerHello (1.1 MiB, the bound is 1 MiB and a little: a forwarded connection's largest chunk)",
)
# The byte-stream method, from the .proto alone: a connection forwarded for a node this
# replica holds no edge session for is refused NOT_FOUND, with the DialResult in the
# status details.
dial_request = tunnel_pb2.DialRequest(target="127.0.0.1:9", connection_id=7, node="nobody")
metadata = [("tunnel-dial-bin", dial_request.SerializeToString())]
try:
    list(peer.Dial(iter([tunnel_pb2.Chunk(data=b"early")]), metadata=metadata, timeout=TIMEOUT))
    raise AssertionError("Peer.Dial for a node not held here was not refused")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.NOT_FOUND, f"Peer.Dial: got {e.code()}: {e.details()}"
    assert "nobody" in e.details(), e.details()
    details = dict(e.trailing_metadata() or ()).get("grpc-status-details-bin")
    result = tunnel_pb2.DialResult.FromString(details)
    assert result.status == tunnel_pb2.DIAL_STATUS_NOT_HELD, result
    print(f"ok: Peer.Dial for a node not held here: NOT_FOUND, {result.message}")
# Field 1 (a string) with a length that runs past the end of the message.
expect_code(
    lambda: list(ch.unary_stream("/tunnel.v1.Peer/Routes", **raw)(b"\x0a\x7f\x01", timeout=TIMEOUT)),
    grpc.StatusCode.INTERNAL,
    "malformed PeerHello",
)
expect_code(
    lambda: list(peer.Routes(tunnel_pb2.PeerHello(), timeout=TIMEOUT)),
    grpc.StatusCode.INVALID_ARGUMENT,
    "PeerHello without a replica_id",
)

# A request whose first message never comes: headers sent, the request stream left open.
never = threading.Event()


def no_message():
    never.wait(30)
    yield b""


expect_code(
    lambda: list(ch.stream_stream("/tunnel.v1.Peer/Routes", **raw)(no_message(), timeout=TIMEOUT)),
    grpc.StatusCode.DEADLINE_EXCEEDED,
    "Routes without its request message (the bound is transport.handshake_timeout, 2 s here)",
)
never.set()

# Nothing else disturbed: the stream opened first still gets its keepalives (one per
# heartbeat interval, 1 s here), and health still answers.
keepalive = next(routes)
assert not keepalive.reset and not keepalive.held and not keepalive.released, keepalive
print("ok: the Routes stream opened before the bad requests still gets keepalives")
routes.cancel()
check_serving(ch, "after the bad requests")
ch.close()

expect_code(
    lambda: health_pb2_grpc.HealthStub(channel(with_client_cert=False)).Check(
        health_pb2.HealthCheckRequest(), timeout=TIMEOUT
    ),
    grpc.StatusCode.UNAVAILABLE,
    "client without a certificate",
)
print("interop: all checks passed")
