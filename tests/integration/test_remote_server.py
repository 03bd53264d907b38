"""The forwarding server on loopback, spoken to in raw protocol: sessions, ops, isolation, fuzzing."""

from __future__ import annotations

import json
import socket
import time
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_trace.runtime.protocol import auth, wire
from gpu_trace.runtime.protocol.wire import MsgType
from gpu_trace.runtime.server.server import Server

TOKEN = "test-token-0123456789"


@pytest.fixture
def server() -> Iterator[Server]:
    with Server("127.0.0.1:0", token=TOKEN, handshake_timeout_s=2.0) as srv:
        yield srv


_open: list[Raw] = []


@pytest.fixture(autouse=True)
def _close_raw_clients() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


class Raw:
    """A protocol-level client: what a (possibly hostile) peer can send."""

    def __init__(
        self,
        address: str,
        token: str = TOKEN,
        hello: dict | None = None,
        binary: Any = False,
    ) -> None:
        host, port = address.rsplit(":", 1)
        # 60 s: a session's first op may wait for a worker process to be made (a busy machine)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        _open.append(self)
        self.reader = wire.FrameReader(self.sock, wire.MAX_FRAME)
        self.writer = wire.FrameWriter(self.sock)
        mtype, body = self.reader.read()
        assert mtype == MsgType.CHALLENGE
        nonce = bytes.fromhex(json.loads(body)["nonce"])
        msg = hello or {"v": 1, "mac": auth.mac(token, nonce), "client": {"host": "test"}}
        if binary is not False:
            msg["binary"] = binary  # True: DONE_OK and DONE_VALUE are read
        self.writer.send(wire.json_frame(MsgType.HELLO, msg))
        self.welcome = self.reader.read()
        self.seq = 0

    def batch(
        self, ops: list, free: list | None = None, blobs: list | None = None, data: bytes = b""
    ) -> dict:
        self.seq += 1
        head = {"seq": self.seq, "ops": ops, "free": free or []}
        if blobs:
            head["blobs"] = blobs
        self.writer.send(*wire.split_frame(MsgType.BATCH, head, [data]))
        return self.until(MsgType.DONE)

    def until(self, want: int) -> dict:
        self.data = []
        while True:
            mtype, body = self.reader.read()
            if mtype == MsgType.DATA:
                head, data = wire.decode_split(body)
                self.data.append((head, bytearray(data)))
            if mtype == MsgType.CHUNK:
                self.data[-1][1].extend(wire.decode_chunk(body)[2])
            if want == MsgType.DONE and mtype in (MsgType.DONE_OK, MsgType.DONE_VALUE):
                self.kind = mtype
                return _binary_done(mtype, body)
            if mtype == want:
                self.kind = mtype
                return json.loads(body) if body else {}
            if mtype == MsgType.ERROR:
                raise wire.ProtocolError(json.loads(body)["message"])

    def fetch(self, handle: int) -> torch.Tensor:
        done = self.batch([["rt::fetch", [{"h": handle}, 99], {}, None]])
        assert done["ok"], done
        head, data = self.data[0]
        from gpu_trace.runtime.protocol import values

        dt, shape, _ = values.tensor_meta(head["dtype"], head["shape"], head["nbytes"])
        return values.tensor_from_bytes(dt, shape, data)

    def close(self) -> None:
        self.sock.close()


def _binary_done(mtype: int, body: bytes) -> dict:
    """A DONE_OK or DONE_VALUE as the JSON DONE it stands for."""
    if mtype == MsgType.DONE_OK:
        seq, *t = wire.DONE_OK_BODY.unpack(body)
        return {"seq": seq, "ok": True, "error": None, "results": {}, "t": t}
    seq, t, index, value = wire.decode_done_value(body)
    return {"seq": seq, "ok": True, "error": None, "results": {str(index): value}, "t": t}


def _wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_ops_run_and_results_come_back(server: Server) -> None:
    c = Raw(server.address)
    assert c.welcome[0] == MsgType.WELCOME
    done = c.batch(
        [
            [
                "aten::ones.default",
                [[2, 3]],
                {"dtype": {"d": "float32"}, "device": {"v": "r"}},
                [1],
            ],
            ["aten::add.Tensor", [{"h": 1}, {"h": 1}], {"alpha": 3}, [2]],
            ["aten::sum.default", [{"h": 2}], {}, [3]],
            ["aten::_local_scalar_dense.default", [{"h": 3}], {}, None],
        ]
    )
    assert done["ok"] and done["results"] == {"3": 24.0}
    assert len(done["t"]) == 5
    assert torch.equal(c.fetch(2), torch.full((2, 3), 4.0))
    c.close()


def test_uploads_inline_and_chunked(server: Server) -> None:
    c = Raw(server.address)
    small = torch.arange(6, dtype=torch.int64)
    done = c.batch(
        [["aten::clone.default", [{"b": 1}], {}, [1]]],
        blobs=[[1, "int64", [6], 48]],
        data=small.numpy().tobytes(),
    )
    assert done["ok"], done
    assert torch.equal(c.fetch(1), small)
    big = torch.randn(600_000)  # 2.4 MB: three chunks
    data = big.numpy().tobytes()
    c.writer.send(
        wire.json_frame(
            MsgType.PUT, {"blob": 2, "dtype": "float32", "shape": [600_000], "nbytes": len(data)}
        ),
        *wire.chunk_frames(2, memoryview(data)),
    )
    assert c.batch([["aten::clone.default", [{"b": 2}], {}, [2]]])["ok"]
    assert torch.equal(c.fetch(2), big)
    c.close()


def test_op_errors_name_the_op_and_the_session_goes_on(server: Server) -> None:
    c = Raw(server.address)
    done = c.batch(
        [
            ["aten::ones.default", [[3]], {}, [1]],
            ["aten::view.default", [{"h": 1}, [7]], {}, [2]],
            ["aten::neg.default", [{"h": 1}], {}, [3]],
        ]
    )
    assert not done["ok"]
    assert done["error"]["index"] == 1 and done["error"]["op"] == "aten::view.default"
    assert "invalid" in done["error"]["message"]
    assert c.batch([["aten::neg.default", [{"h": 1}], {}, [4]]])["ok"]


def _stream_batch(c: Raw, defs: list, stream: list[int], ops: list | None = None) -> dict:
    """A batch in the op-stream form: templates, then their calls as int64s."""
    from array import array

    c.seq += 1
    data = array("q", stream).tobytes()
    head = {"seq": c.seq, "ops": ops or [], "free": [], "defs": defs, "xb": len(data)}
    c.writer.send(*wire.split_frame(MsgType.BATCH, head, [data]))
    return c.until(MsgType.DONE)


def test_template_calls_run_like_json_ops(server: Server) -> None:
    c = Raw(server.address)
    assert json.loads(c.welcome[1])["templates"] is True
    ones = ["aten::ones.default", [[3]], {"dtype": {"d": "float32"}, "device": {"v": "r"}}, [1]]
    defs = [
        [1, "aten::mul.Tensor", [{"xh": 0}, 3.0], {}, [1], 2],
        [2, "aten::add_.Tensor", [{"xh": 0}, {"xh": 1}], {"alpha": 2}, [None], 2],
        [3, "aten::cat.default", [[{"xh": 0}, {"xh": 1}]], {}, [2], 3],
    ]
    # JSON op (id 0), then x2 = x1 * 3, x1 += 2 * x2, x3 = cat(x1, x2), x4 = x3 * 3
    done = _stream_batch(c, defs, [0, 1, 1, 2, 2, 1, 2, 3, 1, 2, 3, 1, 3, 4], [ones])
    assert done["ok"], done
    x1 = torch.ones(3) + 2 * torch.full((3,), 3.0)
    assert torch.equal(c.fetch(3), torch.cat([x1, torch.full((3,), 3.0)]))
    assert torch.equal(c.fetch(4), torch.cat([x1, torch.full((3,), 3.0)]) * 3)
    # A call naming a handle that does not exist fails as an op; the session goes on.
    done = _stream_batch(c, [], [1, 99, 5, 1, 1, 6])
    assert not done["ok"] and done["error"]["index"] == 0
    assert done["error"]["op"] == "aten::mul.Tensor"
    assert "unknown tensor handle 99" in done["error"]["message"]
    assert _stream_batch(c, [], [1, 1, 7])["ok"]
    # A template's constants cannot name tensors; an op off the allow-list is refused.
    bad = [
        [4, "aten::add.Tensor", [{"xh": 0}, {"h": 1}], {}, [1], 2],
        [5, "aten::from_file.default", ["/etc/passwd"], {}, [0], 1],
    ]
    done = _stream_batch(c, bad, [4, 1, 8])
    assert not done["ok"] and "constants cannot name tensors" in done["error"]["message"]
    done = _stream_batch(c, [], [5, 9])
    assert not done["ok"] and "allow-list" in done["error"]["message"]


def _calls(c: Raw, stream: list[int], free: list[int] | None = None) -> dict:
    """A batch of template calls as a CALLS frame (no JSON)."""
    c.seq += 1
    c.writer.send(wire.calls_frame(c.seq, 0, free or [], array("q", stream).tobytes()))
    return c.until(MsgType.DONE)


def test_calls_frames_and_binary_replies(server: Server) -> None:
    """Template calls in a CALLS frame run like a BATCH's op stream. A client that said
    ``binary`` gets DONE_OK, or DONE_VALUE for one number, when nothing failed (a JSON DONE
    otherwise); one that did not gets JSON DONEs, for CALLS frames too."""
    defs = [
        [1, "aten::mul.Tensor", [{"xh": 0}, 3.0], {}, [1], 2],
        [2, "aten::sum.default", [{"xh": 0}], {}, [1], 2],
        [3, "aten::_local_scalar_dense.default", [{"xh": 0}], {}, None, 1],
    ]
    ones = ["aten::ones.default", [[3]], {}, [1]]
    c = Raw(server.address, binary=True)
    assert json.loads(c.welcome[1])["binary"] is True
    assert _stream_batch(c, defs, [0], [ones])["ok"] and c.kind == MsgType.DONE_OK
    done = _calls(c, [1, 1, 2, 2, 2, 3, 3, 3])  # x2 = x1 * 3, x3 = x2.sum(), x3.item()
    assert c.kind == MsgType.DONE_VALUE and done["results"] == {"2": 9.0}
    assert _calls(c, [1, 3, 4])["ok"] and c.kind == MsgType.DONE_OK  # x4 = x3 * 3
    done = _calls(c, [1, 1, 5, 1, 99, 6])  # an op error comes in a JSON DONE
    assert c.kind == MsgType.DONE and not done["ok"] and done["error"]["index"] == 1
    assert done["error"]["op"] == "aten::mul.Tensor"
    assert _calls(c, [], free=[2])["ok"]  # a frame of frees only
    done = _calls(c, [1, 2, 5])
    assert not done["ok"] and "unknown tensor handle 2" in done["error"]["message"]
    assert c.fetch(4).item() == 27.0

    plain = Raw(server.address)
    assert _stream_batch(plain, defs, [0], [ones])["ok"] and plain.kind == MsgType.DONE
    done = _calls(plain, [1, 1, 2, 2, 2, 3, 3, 3])
    assert plain.kind == MsgType.DONE and done["results"] == {"2": 9.0}


@pytest.mark.parametrize(
    "body",
    [
        wire.CALLS_HEAD.pack(1, 0, 0, 0) + array("q", [7, 1]).tobytes(),  # unknown template
        wire.CALLS_HEAD.pack(1, 0, 0, 0) + b"\x01\x00\x00",  # not whole int64s
        wire.CALLS_HEAD.pack(1, 0, 3, 0) + bytes(8),  # frees past the end
        wire.CALLS_HEAD.pack(1, 0, 0, 9),  # unknown flags
        b"\x01\x02",  # truncated header
    ],
)
def test_malformed_calls_close_the_session(server: Server, body: bytes) -> None:
    c = Raw(server.address, binary=True)
    c.writer.send(wire.HEADER.pack(len(body), MsgType.CALLS) + body)
    with pytest.raises(wire.ProtocolError):
        c.until(MsgType.DONE)


@pytest.mark.parametrize(
    ("defs", "stream"),
    [
        ([[1, "aten::neg.default", [{"xh": 0}], {}, [1], 1]], [1, 1]),  # outs name hole 1 of 1
        ([[1, "aten::neg.default", [{"xh": 0}], {}, [1], 3]], [1, 1, 2, 3]),  # holes misnumbered
        ([], [7, 1, 2]),  # unknown template
    ],
)
def test_malformed_op_streams_close_the_session(server: Server, defs: list, stream: list) -> None:
    c = Raw(server.address)
    with pytest.raises(wire.ProtocolError):
        _stream_batch(c, defs, stream)


@pytest.mark.parametrize(
    "op",
    [
        ["aten::from_file.default", ["/etc/passwd"], {}, [1]],
        ["aten::_unsafe_index.Tensor", [{"h": 1}, [None]], {}, [2]],
        ["builtins::eval", ["1"], {}, None],
        ["torch.ops.aten.add", [], {}, None],
        ["rt::nope", [], {}, None],
        ["aten::empty.memory_format", [[1 << 40, 1 << 20]], {}, [3]],
    ],
)
def test_ops_off_the_allow_list_or_too_big_are_refused(server: Server, op: list) -> None:
    c = Raw(server.address)
    c.batch([["aten::ones.default", [[3]], {}, [1]]])
    done = c.batch([op])
    assert not done["ok"]
    assert c.batch([["aten::neg.default", [{"h": 1}], {}, [9]]])["ok"]


def test_an_output_handle_for_a_number_is_an_op_error(server: Server) -> None:
    """An op whose outs name a handle for a result that is not a tensor fails as an op (the
    session goes on), JSON op and template call alike."""
    c = Raw(server.address, binary=True)
    c.batch([["aten::ones.default", [[1]], {}, [1]]])
    done = c.batch([["aten::_local_scalar_dense.default", [{"h": 1}], {}, [2]]])
    assert not done["ok"] and "outs do not match" in done["error"]["message"]
    defs = [[1, "aten::_local_scalar_dense.default", [{"xh": 0}], {}, [1], 2]]
    done = _stream_batch(c, defs, [1, 1, 3])
    assert not done["ok"] and "outs do not match" in done["error"]["message"]
    assert c.batch([["aten::_local_scalar_dense.default", [{"h": 1}], {}, None]])["results"] == {
        "0": 1.0
    }


def test_unsafe_index_put_is_made_safe(server: Server) -> None:
    c = Raw(server.address)
    c.batch(
        [
            ["aten::zeros.default", [[3]], {}, [1]],
            ["aten::ones.default", [[1]], {}, [2]],
            ["aten::full.default", [[1], 10], {"dtype": {"d": "int64"}}, [3]],
        ]
    )
    done = c.batch(
        [
            [
                "aten::_index_put_impl_.default",
                [{"h": 1}, [{"h": 3}], {"h": 2}, False, True],
                {},
                [None],
            ]
        ]
    )
    assert not done["ok"] and "out of bounds" in done["error"]["message"]


def test_sessions_cannot_reach_each_others_tensors(server: Server) -> None:
    a, b = Raw(server.address), Raw(server.address)
    assert a.batch([["aten::ones.default", [[3]], {}, [1]]])["ok"]
    done = b.batch([["aten::neg.default", [{"h": 1}], {}, [2]]])
    assert not done["ok"] and "unknown tensor handle 1" in done["error"]["message"]
    assert b.batch([["aten::zeros.default", [[2]], {}, [1]]])["ok"]  # same number, own table
    assert torch.equal(a.fetch(1), torch.ones(3))


def test_bad_token_and_bad_hello_are_refused(server: Server) -> None:
    c = Raw(server.address, token="wrong-token-0123456789")
    assert c.welcome[0] == MsgType.ERROR and b"authentication" in c.welcome[1]
    c = Raw(server.address, hello={"v": 99, "mac": "00", "client": {}})
    assert c.welcome[0] == MsgType.ERROR
    c = Raw(server.address, binary="yes")
    assert c.welcome[0] == MsgType.ERROR and b"'binary' must be a boolean" in c.welcome[1]
    assert not server.sessions


def test_frees_and_disconnect_release_everything(server: Server) -> None:
    c = Raw(server.address)
    c.batch(
        [
            ["aten::ones.default", [[1000]], {}, [1]],
            ["aten::ones.default", [[10]], {}, [2]],
            ["aten::slice.Tensor", [{"h": 1}, 0, 0, 5], {}, [3]],
        ]
    )
    (session,) = server.sessions.values()
    assert len(session.handles) == 3 and session.account.bytes == 4040
    c.batch([], free=[1, 2])
    assert len(session.handles) == 1 and session.account.bytes == 4000  # the view keeps its base
    c.close()
    _wait_for(
        lambda: (
            not server.sessions
            and session.closed
            and not session.handles
            # the account is released after the handles are gone (one change for all of them)
            and session.account.bytes == 0
        )
    )


def test_ping_answers_with_server_times(server: Server) -> None:
    c = Raw(server.address)
    t0 = time.perf_counter_ns()
    c.writer.send(wire.frame(MsgType.PING, wire.PING_BODY.pack(t0)))
    mtype, body = c.reader.read()
    echoed, t1, t2 = wire.decode_pong(body)
    assert mtype == MsgType.PONG and echoed == t0 and t1 <= t2


def test_silent_client_is_dropped_at_handshake(server: Server) -> None:
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(5)
    assert s.recv(4096)  # the challenge
    time.sleep(2.5)  # past the handshake timeout: the server hangs up
    rest = b""
    while chunk := s.recv(4096):
        rest += chunk
    _wait_for(lambda: not server._conns)
    s.close()


# ---- fuzzing the live server --------------------------------------------------------------------

_names = st.sampled_from(
    [
        "aten::add.Tensor",
        "aten::ones.default",
        "aten::view.default",
        "aten::cat.default",
        "aten::index.Tensor",
        "aten::empty.memory_format",
        "rt::fetch",
        "rt::meta",
        "rt::seed",
        "rt::mark",
        "rt::elapsed",
        "rt::flags",
        "rt::mem_info",
        "aten::from_file.default",
        "nope",
        "",
    ]
)
_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 66), 1 << 66)
    | st.floats()
    | st.text(max_size=8)
    | st.builds(lambda h: {"h": h}, st.integers(-2, 6))
    | st.builds(lambda b: {"b": b}, st.integers(-2, 6))
    | st.builds(lambda k, n: {k: n}, st.sampled_from(["xh", "xb"]), st.integers(-2, 6))
    | st.builds(
        lambda k, v: {k: v},
        st.sampled_from(["d", "v", "m", "l", "c", "zz"]),
        st.text(max_size=10) | st.integers(),
    )
)
_arg = st.recursive(_leaf, lambda c: st.lists(c, max_size=4), max_leaves=8)
_op = st.one_of(
    st.lists(_arg, max_size=5),
    st.tuples(
        _names,
        st.lists(_arg, max_size=4),
        st.dictionaries(st.text(max_size=6), _arg, max_size=2),
        st.none()
        | st.lists(
            st.none() | st.integers(-1, 1 << 63) | st.lists(st.integers(0, 9), max_size=3),
            max_size=3,
        ),
    ).map(list),
)
#: A template definition ([id, name, args, kwargs, outs, holes]) or anything list-shaped.
_def = st.one_of(
    st.lists(_arg, max_size=6),
    st.tuples(
        st.integers(-1, 5),
        _names,
        st.lists(_arg, max_size=4),
        st.dictionaries(st.text(max_size=6), _arg, max_size=2),
        st.lists(st.integers(-1, 6) | st.none(), max_size=3),
        st.integers(-1, 8),
    ).map(list),
)
_batch = st.fixed_dictionaries(
    {"seq": st.integers(0, 1 << 62), "ops": st.lists(_op, max_size=6)},
    optional={
        "free": st.lists(st.integers(-5, 20) | st.text(max_size=3), max_size=5),
        "blobs": st.lists(st.lists(_leaf, max_size=4), max_size=2),
        "tp": st.text(max_size=60),
        "defs": st.lists(_def, max_size=3),
        # the op stream (template calls as int64s), sent as the batch's first blob
        "_stream": st.lists(
            st.integers(-2, 8) | st.integers(-(1 << 63), (1 << 63) - 1), max_size=12
        ),
        "xb": st.integers(-8, 200),
    },
)
#: A CALLS body: a header of any numbers, then int64s (frees and the op stream).
_calls_body = st.builds(
    lambda seq, span, nfree, flags, vals: (
        wire.CALLS_HEAD.pack(seq, span, nfree, flags) + array("q", vals).tobytes()
    ),
    st.integers(-2, 1 << 62),
    st.integers(-2, 1 << 62),
    st.integers(0, 8) | st.integers(0, (1 << 32) - 1),
    st.integers(0, 3),
    st.lists(st.integers(-2, 8) | st.integers(-(1 << 63), (1 << 63) - 1), max_size=12),
)
_frame = st.one_of(
    st.tuples(st.just(MsgType.BATCH), _batch),
    st.tuples(st.just(MsgType.CALLS), _calls_body),
    st.tuples(
        st.sampled_from(
            [MsgType.PUT, MsgType.CHUNK, MsgType.PING, MsgType.DONE, MsgType.HELLO, 0, 77]
        ),
        st.binary(max_size=64),
    ),
    st.tuples(
        st.just(MsgType.PUT),
        st.dictionaries(st.sampled_from(["blob", "dtype", "shape", "nbytes"]), _leaf),
    ),
)


def test_fuzz_server_survives_thousands_of_adversarial_messages(server: Server) -> None:
    victim = Raw(server.address)
    victim.batch([["aten::arange.default", [10], {}, [1]]])
    state = {"conn": None, "sent": 0}

    @settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_frame)
    def throw(msg: tuple) -> None:
        if state["conn"] is None:
            state["conn"] = Raw(server.address)
        c = state["conn"]
        mtype, body = msg
        try:
            if mtype == MsgType.BATCH:
                blob = b"\x00" * 16
                if "_stream" in body:
                    body = dict(body)
                    blob = array("q", body.pop("_stream")).tobytes()
                    body.setdefault("xb", len(blob))
                c.writer.send(*wire.split_frame(MsgType.BATCH, body, [blob]))
            elif isinstance(body, dict):
                c.writer.send(wire.json_frame(mtype, body))
            else:
                c.writer.send(wire.HEADER.pack(len(body), mtype) + body)
            c.writer.send(wire.frame(MsgType.PING, wire.PING_BODY.pack(1)))
            c.until(MsgType.PONG)  # the server is still answering this connection
        except (wire.ProtocolError, wire.ConnectionClosed, TimeoutError, OSError, ValueError):
            c.close()
            state["conn"] = None  # the server closed it: a fresh session next time
        state["sent"] += 1

    throw()
    if state["conn"] is not None:
        state["conn"].close()
    assert state["sent"] >= 3000
    assert torch.equal(victim.fetch(1), torch.arange(10))  # the other session is unaffected
    _wait_for(lambda: len(server.sessions) == 1)
    (only,) = server.sessions.values()
    assert len(only.handles) == 1
    assert server.executor._thread is not None and server.executor._thread.is_alive()
