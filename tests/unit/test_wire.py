"""Wire protocol: frames, bounds, tensor encoding, argument validation, authentication."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from array import array

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_trace.runtime.protocol import auth, values, wire
from gpu_trace.runtime.protocol.wire import MsgType, ProtocolError


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    return a, b


def test_frames_round_trip_in_order() -> None:
    a, b = _pair()
    writer = wire.FrameWriter(a)
    reader = wire.FrameReader(b, wire.MAX_FRAME)
    writer.send(wire.json_frame(MsgType.HELLO, {"x": 1}), wire.frame(MsgType.PING, b"12345678"))
    writer.send(*wire.split_frame(MsgType.BATCH, {"seq": 3}, [b"abc", memoryview(b"de")]))
    assert reader.read() == (MsgType.HELLO, b'{"x":1}')
    assert reader.read() == (MsgType.PING, b"12345678")
    mtype, body = reader.read()
    head, data = wire.decode_split(body)
    assert (mtype, head, bytes(data)) == (MsgType.BATCH, {"seq": 3}, b"abcde")
    a.close()
    with pytest.raises(wire.ConnectionClosed):
        reader.read()
    b.close()


def test_oversized_frame_is_refused_before_reading_its_body() -> None:
    a, b = _pair()
    reader = wire.FrameReader(b, 1000)
    a.sendall(wire.HEADER.pack(1001, MsgType.BATCH))  # the body never comes
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        reader.read()
    a.close()
    b.close()


def test_unknown_message_type_is_refused() -> None:
    a, b = _pair()
    reader = wire.FrameReader(b, 1000)
    a.sendall(wire.HEADER.pack(0, 200))
    with pytest.raises(ProtocolError, match="unknown message type"):
        reader.read()
    a.close()
    b.close()


def test_calls_frames_round_trip() -> None:
    """A batch of template calls travels without JSON: seq, span, frees and the op stream."""
    a, b = _pair()
    stream = array("q", [2, 1, -9, 1 << 62]).tobytes()
    a.sendall(wire.calls_frame(7, (1 << 63) - 1, [3, 4, -5], stream))
    a.sendall(wire.calls_frame(8, 0, [], b""))
    reader = wire.FrameReader(b, wire.MAX_FRAME)
    mtype, body = reader.read()
    seq, span, flags, frees, ops = wire.decode_calls(body)
    assert (mtype, seq, span, flags, frees) == (MsgType.CALLS, 7, (1 << 63) - 1, 0, [3, 4, -5])
    assert wire.int64s(ops) == [2, 1, -9, 1 << 62]
    seq, span, flags, frees, ops = wire.decode_calls(reader.read()[1])
    assert (seq, span, flags, frees, bytes(ops)) == (8, 0, 0, [], b"")
    a.close()
    b.close()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "truncated"),
        (wire.CALLS_HEAD.pack(1, 0, 2, 0) + bytes(8), "frees"),  # 2 frees, 1 there
        (wire.CALLS_HEAD.pack(1, 0, wire.MAX_FREES + 1, 0), "frees"),
        (wire.CALLS_HEAD.pack(-1, 0, 0, 0), "header"),
        (wire.CALLS_HEAD.pack(1, -5, 0, 0), "header"),
        (wire.CALLS_HEAD.pack(1, 0, 0, 6), "header"),  # unknown flags
    ],
)
def test_malformed_calls_are_protocol_errors(body: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode_calls(body)


@pytest.mark.parametrize(
    "value",
    [
        0,
        -(1 << 63),
        (1 << 63) - 1,
        1.5,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        True,
        False,
    ],
)
def test_done_value_carries_a_number_exactly(value: object) -> None:
    t = (1, 2, 3, 4, 5)
    frame = wire.done_value_frame(9, t, 3, value)
    assert frame is not None
    mtype = wire.HEADER.unpack_from(frame)[1]
    seq, times, index, got = wire.decode_done_value(frame[wire.HEADER.size :])
    assert (mtype, seq, times, index) == (MsgType.DONE_VALUE, 9, list(t), 3)
    assert type(got) is type(value)
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(got)
    else:
        assert got == value and str(got) == str(value)  # -0.0 stays -0.0


@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, None, "x", 1j, [1.0], {"f": "nan"}])
def test_done_value_refuses_what_it_cannot_carry(value: object) -> None:
    assert wire.done_value_frame(1, (0, 0, 0, 0, 0), 0, value) is None  # the JSON DONE then


def test_malformed_done_values_and_dones_are_protocol_errors() -> None:
    good = wire.done_value_frame(1, (0, 0, 0, 0, 0), 0, 2.5)[wire.HEADER.size :]
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode_done_value(good[:-1])
    bad_kind = wire.DONE_VALUE_HEAD.pack(1, 0, 0, 0, 0, 0, 0, 3) + bytes(8)
    with pytest.raises(ProtocolError, match="unknown kind"):
        wire.decode_done_value(bad_kind)


def test_receive_timeout_raises_and_keeps_a_partial_frame() -> None:
    """A reader sleeps in recv up to the socket's receive timeout, then says so; bytes of a
    frame that had started arriving are kept for the next read."""
    a, b = _pair()
    reader = wire.FrameReader(b, wire.MAX_FRAME)
    reader.set_timeout(0.05)
    with pytest.raises(TimeoutError):
        reader.read()
    ping = wire.frame(MsgType.PING, wire.PING_BODY.pack(42))
    a.sendall(ping[:3])
    with pytest.raises(TimeoutError):
        reader.read()
    a.sendall(ping[3:])
    assert reader.read() == (MsgType.PING, wire.PING_BODY.pack(42))
    reader.set_timeout(None)  # no timeout: blocks until the peer closes
    a.close()
    with pytest.raises(wire.ConnectionClosed):
        reader.read()
    b.close()


def test_spin_polls_until_data_comes_or_gives_up() -> None:
    """A reader polls for up to its budget: True once data came (a frame may be read at once),
    False when the budget ran out or ``stop()`` says someone else has work."""
    a, b = _pair()
    ping = wire.frame(MsgType.PING, wire.PING_BODY.pack(7))
    assert not wire.FrameReader(b, wire.MAX_FRAME).spin(200_000)  # nothing comes
    busy = threading.Lock()
    with busy:  # stops at once, however long the budget
        assert not wire.FrameReader(b, wire.MAX_FRAME).spin(1 << 62, busy.locked)
    reader = wire.FrameReader(b, wire.MAX_FRAME)
    threading.Timer(0.05, a.sendall, (ping,)).start()
    assert reader.spin(1 << 62)  # comes while polling
    assert reader.next_frame() == (MsgType.PING, wire.PING_BODY.pack(7))
    a.sendall(ping)
    assert reader.spin(1 << 62) and reader.spin(0)  # a whole frame buffered: True at once
    assert reader.next_frame() == (MsgType.PING, wire.PING_BODY.pack(7))
    a.close()
    with pytest.raises(wire.ConnectionClosed):
        reader.spin(1 << 62)
    b.close()


def test_spin_budget_follows_the_peer() -> None:
    """After a poll that found nothing, the budget halves (to a sixteenth at least) when what
    came next took longer than the budget's cap, and is whole again when it did not."""
    a, b = _pair()
    reader = wire.FrameReader(b, wire.MAX_FRAME)
    ping = wire.frame(MsgType.PING, wire.PING_BODY.pack(7))
    cap = 1_000_000  # 1 ms
    for expected in (cap, cap // 2, cap // 4, cap // 8, cap // 16, cap // 16):
        assert not reader.spin(cap)  # found nothing; the ping comes 20 ms later
        assert reader._spin == expected
        time.sleep(0.02)
        a.sendall(ping)
        reader.read()
    assert not reader.spin(cap)
    a.sendall(ping)  # at once, well within the cap
    reader.read()
    assert not reader.spin(cap) and reader._spin == cap  # whole again
    a.close()
    b.close()


def test_spin_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_trace import config

    assert config.spin_us() == config.DEFAULT_SPIN_US
    assert config.spin_us(0) == 0
    monkeypatch.setenv("GPU_TRACE_SPIN_US", "50")
    assert config.spin_us() == 50 and config.spin_us(0) == 0
    for bad, message in (("soon", "must be a number"), ("-1", "GPU_TRACE_SPIN_US must be")):
        monkeypatch.setenv("GPU_TRACE_SPIN_US", bad)
        with pytest.raises(ValueError, match=message):
            config.spin_us()


def test_chunks_cover_large_payloads() -> None:
    data = memoryview(bytes(range(256)) * ((wire.CHUNK_BYTES * 2 + 100) // 256 + 1))
    frames = wire.chunk_frames(7, data)
    a, b = _pair()
    reader = wire.FrameReader(b, wire.MAX_FRAME)
    writer = wire.FrameWriter(a)
    t = threading.Thread(target=writer.send, args=frames)
    t.start()
    got = bytearray()
    while len(got) < len(data):
        mtype, body = reader.read()
        ident, offset, part = wire.decode_chunk(body)
        assert (mtype, ident, offset) == (MsgType.CHUNK, 7, len(got))
        got += part
    t.join()
    assert bytes(got) == bytes(data)
    a.close()
    b.close()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.bool,
        torch.uint8,
        torch.complex64,
    ],
)
def test_tensor_bytes_round_trip_bitwise(dtype: torch.dtype) -> None:
    src = (torch.randn(3, 5) * 100).to(dtype).t()  # non-contiguous on purpose
    name = values.encode_dtype(dtype)["d"]
    data = values.tensor_bytes(src)
    dt, shape, nbytes = values.tensor_meta(name, list(src.shape), len(data))
    out = values.tensor_from_bytes(dt, shape, data)
    assert out.dtype == dtype and out.shape == src.shape
    assert torch.equal(
        out.view(torch.uint8) if dtype != torch.bool else out,
        src.contiguous().view(torch.uint8) if dtype != torch.bool else src,
    )


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes", "match"),
    [
        ("float33", [2], 8, "unknown dtype"),
        ("float32", [2, -1], 8, "non-negative"),
        ("float32", [2], 9, "does not match"),
        ("float32", "2", 8, "shape must be"),
        ("float32", [1] * 40, 4, "shape must be"),
        ("float32", [1 << 40, 1 << 20], (1 << 60) * 4, "non-negative|limit"),
        ("float32", [True], 4, "non-negative"),
    ],
)
def test_tensor_meta_validation(dtype: object, shape: object, nbytes: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        values.tensor_meta(dtype, shape, nbytes)


def _decoder(table: dict[int, object] | None = None) -> values.ArgDecoder:
    table = table or {}

    def handle(h: int) -> object:
        if h not in table:
            raise KeyError(h)
        return table[h]

    return values.ArgDecoder(handle, lambda b: f"blob{b}", torch.device("cpu"))


def test_arguments_decode_to_torch_values() -> None:
    d = _decoder({5: "tensor5"})
    assert d.decode_args(
        [
            {"h": 5},
            1,
            2.5,
            None,
            True,
            "mean",
            [1, 2],
            {"d": "bfloat16"},
            {"v": "r"},
            {"m": "channels_last"},
            {"c": [1, 2]},
            {"b": 3},
            {"l": "strided"},
        ]
    ) == [
        "tensor5",
        1,
        2.5,
        None,
        True,
        "mean",
        [1, 2],
        torch.bfloat16,
        torch.device("cpu"),
        torch.channels_last,
        complex(1, 2),
        "blob3",
        torch.strided,
    ]
    assert d.decode_kwargs({"dim": 1, "keepdim": False}) == {"dim": 1, "keepdim": False}


@pytest.mark.parametrize(
    "bad",
    [
        {"h": 0},
        {"h": -1},
        {"h": "1"},
        {"h": 1, "b": 2},
        {"x": 1},
        {"d": "torch.float32"},
        {"v": "cuda:7"},
        {"m": "__class__"},
        {"c": [1]},
        1 << 64,
        "x" * 5000,
        [[[[[1]]]]],
        list(range(wire.MAX_LIST + 1)),
    ],
)
def test_bad_arguments_are_protocol_errors(bad: object) -> None:
    with pytest.raises(ProtocolError):
        _decoder().decode(bad)


def test_bad_keyword_names_are_refused() -> None:
    with pytest.raises(ProtocolError):
        _decoder().decode_kwargs({"__import__('os')": 1})
    with pytest.raises(ProtocolError):
        _decoder().decode_kwargs([1])


def test_encode_refuses_what_cannot_travel() -> None:
    for value in (object(), 1 << 70, torch.sparse_coo):
        with pytest.raises(TypeError):
            values.encode_scalar_like(value)
    assert values.encode_scalar_like(torch.float16) == {"d": "float16"}
    assert values.encode_scalar_like(torch.device("cpu")) == {"v": "cpu"}


def test_auth_mac_verifies_only_the_right_token_and_nonce() -> None:
    token = "t" * 20
    nonce = auth.new_nonce()
    answer = auth.mac(token, nonce)
    assert auth.verify(token, nonce, answer)
    assert not auth.verify("u" * 20, nonce, answer)
    assert not auth.verify(token, auth.new_nonce(), answer)
    assert not auth.verify(token, nonce, None)
    assert not auth.verify(token, nonce, answer[:-1])
    with pytest.raises(ValueError):
        auth.check_token("short")


def test_token_file_is_private_and_found_by_clients(home: object) -> None:
    token, path = auth.server_token()
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    assert auth.client_token() == token


# ---- fuzzing the decoders -----------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(json_values)
def test_fuzz_argument_decoder_never_fails_unexpectedly(value: object) -> None:
    with contextlib.suppress(ProtocolError, KeyError):
        _decoder({1: "t"}).decode(value)


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=300))
def test_fuzz_frame_and_body_decoders(data: bytes) -> None:
    for decode in (
        wire.decode_json,
        wire.decode_split,
        wire.decode_chunk,
        wire.decode_ping,
        wire.decode_pong,
        wire.decode_calls,
        wire.decode_done_value,
    ):
        with contextlib.suppress(ProtocolError):
            decode(data)
    a, b = _pair()
    b.settimeout(0.05)
    a.sendall(data)
    a.close()
    reader = wire.FrameReader(b, 256)
    try:
        while True:
            reader.read()
    except (ProtocolError, wire.ConnectionClosed, TimeoutError):
        pass
    b.close()


# ---- admin requests ------------------------------------------------------------------------------


def test_admin_requests_are_validated() -> None:
    assert wire.decode_admin(b'{"op": "list"}') == {"op": "list"}
    assert wire.decode_admin(b'{"op": "evict", "session": 7}') == {"op": "evict", "session": 7}
    for body in (
        b'{"op": "shutdown"}',
        b'{"op": "list", "all": true}',
        b'{"op": "evict"}',
        b'{"op": "evict", "session": "7"}',
        b'{"op": "evict", "session": 0}',
        b'{"op": 1}',
        b"[]",
        b"not json",
    ):
        with pytest.raises(ProtocolError):
            wire.decode_admin(body)
