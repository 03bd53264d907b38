"""Quotas hold before an op allocates: a hostile tenant's ops, sized on the server, on a real
server on loopback (CPU device) with a second tenant working throughout.

Each op below asks for far more than its tenant's 64 MiB quota from tiny inputs (the size comes
from an argument, a broadcast, an expand, a matmul, or the data). It must be refused before it
runs: the tenant's bytes never pass its quota, and this process's peak resident memory (the
server runs in it) never grows by more than the quota and some slack. The client is the
protocol-level one, so nothing is sized or checked on the client's side.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_trace.runtime.protocol import wire
from gpu_trace.runtime.protocol.wire import MsgType
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.sharing.tenants import Tenant
from tests.integration.test_sharing_memory import Client, _wait_for, _waiting

MiB = 1 << 20
LIMIT = 64 * MiB
#: What this process's peak resident memory may grow by while a refused op is handled: the
#: op's tiny inputs, the meta computation, the other tenant's tensors, the allocator's noise.
SLACK = 64 * MiB

HOSTILE = Tenant("hostile", "hostile-token-0123456789", memory_bytes=LIMIT)
OTHER = Tenant("other", "other-token-0123456789", memory_bytes=LIMIT)
UNLIMITED = Tenant("unlimited", "unlimited-token-0123456789")
PATIENT = Tenant("patient", "patient-token-0123456789", memory_bytes=LIMIT, on_quota="wait")

R = {"v": "r"}  # the server's device
I64, F32 = {"d": "int64"}, {"d": "float32"}
BIG_N = 16384  # [N, 1] and [1, N] float32: 64 KiB each, 1 GiB when combined


@pytest.fixture
def server() -> Iterator[Server]:
    with Server(
        "127.0.0.1:0", tenants=[HOSTILE, OTHER, PATIENT, UNLIMITED], device_memory=1 << 30
    ) as srv:
        yield srv


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    for c in made:
        c.close()


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _peak_rss() -> int | None:
    """This process's peak resident bytes since :func:`_reset_peak` (None: not on this OS)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Start the peak resident memory afresh (Linux: ``5`` to ``clear_refs``)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _op(c: Client, name: str, args: list, kwargs: dict | None = None) -> tuple[int, list]:
    h = next(c.handles)
    return h, [name, args, kwargs or {}, [h]]


def _held(c: Client, name: str, args: list, kwargs: dict | None = None) -> dict:
    h, op = _op(c, name, args, kwargs)
    done = c.batch([op])
    assert done["ok"], done
    return {"h": h}


def _setup(c: Client, case: str) -> list:
    """The hostile op of ``case`` (its small inputs made first, within the quota)."""
    if case == "arange":
        return ["aten::arange.default", [100_000_000], {"dtype": I64, "device": R}]
    if case == "randperm":
        return ["aten::randperm.default", [120_000_000], {"device": R}]
    if case == "eye":
        return ["aten::eye.default", [17000], {"device": R}]
    if case == "expand_clone":
        one = _held(c, "aten::ones.default", [[1]], {"dtype": F32, "device": R})
        wide = _held(c, "aten::expand.default", [one, [100_000_000]])  # a view: no bytes
        return ["aten::clone.default", [wide]]
    if case in ("broadcast_add", "outer_matmul"):
        col = _held(c, "aten::ones.default", [[BIG_N, 1]], {"dtype": F32, "device": R})
        row = _held(c, "aten::ones.default", [[1, BIG_N]], {"dtype": F32, "device": R})
        return ["aten::add.Tensor" if case == "broadcast_add" else "aten::mm.default", [col, row]]
    if case == "composite_matmul":  # a small result from huge temporaries: the operands
        # broadcast to [100, 100, 1, 4096] and [100, 100, 4096, 1], each copied (164 MB)
        a = _held(c, "aten::ones.default", [[100, 1, 1, 4096]], {"dtype": F32, "device": R})
        b = _held(c, "aten::ones.default", [[1, 100, 4096, 1]], {"dtype": F32, "device": R})
        return ["aten::matmul.default", [a, b]]
    if case in ("repeat", "tile"):  # tile decomposes into repeat (sized by its parts)
        one = _held(c, "aten::ones.default", [[1]], {"dtype": F32, "device": R})
        return [f"aten::{case}.default", [one, [100_000_000]]]
    if case == "repeat_interleave":  # the output's size is the sum of the repeats' values
        repeats = _held(c, "aten::full.default", [[4], 50_000_000], {"dtype": I64, "device": R})
        return ["aten::repeat_interleave.Tensor", [repeats]]
    if case == "bincount":  # ... the input's largest value
        top = _held(c, "aten::full.default", [[1], 100_000_000], {"dtype": I64, "device": R})
        return ["aten::bincount.default", [top]]
    if case == "nonzero":  # ... how many elements are not zero: at most all, 8 bytes each
        x = _held(c, "aten::ones.default", [[6_000_000]], {"dtype": F32, "device": R})
        return ["aten::nonzero.default", [x]]
    if case == "boolean_index":
        x = _held(c, "aten::ones.default", [[6_000_000, 2]], {"dtype": F32, "device": R})
        mask = _held(c, "aten::ones.default", [[6_000_000]], {"dtype": {"d": "bool"}, "device": R})
        return ["aten::index.Tensor", [x, [mask]]]
    raise AssertionError(case)


CASES = [
    "arange",
    "randperm",
    "eye",
    "expand_clone",
    "broadcast_add",
    "outer_matmul",
    "composite_matmul",
    "repeat",
    "tile",
    "repeat_interleave",
    "bincount",
    "nonzero",
    "boolean_index",
]


@pytest.mark.parametrize("case", CASES)
def test_an_op_over_the_quota_is_refused_before_it_allocates(
    server: Server, clients: list[Client], case: str
) -> None:
    hostile, other = Client(server, HOSTILE), Client(server, OTHER)
    clients += [hostile, other]
    a = _held(other, "aten::ones.default", [[1024]], {"dtype": F32, "device": R})
    # Sizing an op that decomposes loads torch's dispatch-mode machinery once per process (tens
    # of MiB): loaded here, by the other tenant's small one, not inside the measured window.
    _held(other, "aten::tile.default", [a, [2]])
    name, args, *kwargs = _setup(hostile, case)
    h, op = _op(hostile, name, args, kwargs[0] if kwargs else None)
    tm = server.memory.tenants[HOSTILE.name]
    peak_before = tm.peak_bytes
    measured = _reset_peak()
    rss_before = _rss()
    done = hostile.batch([op])
    peak_rss = _peak_rss()
    assert not done["ok"], done
    assert done["error"]["type"] == "QuotaError", done["error"]
    assert done["error"]["quota"]["asked"] > LIMIT - peak_before
    # Refused before it ran: its bytes never counted, and never held.
    assert tm.peak_bytes == peak_before <= LIMIT
    assert hostile.session.account.peak_bytes <= LIMIT
    if measured and rss_before is not None and peak_rss is not None:
        assert peak_rss - rss_before < LIMIT + SLACK
    # The other tenant works throughout, and the hostile one goes on within its quota.
    out = next(other.handles)
    assert other.batch([["aten::add.Tensor", [a, a], {"alpha": 2}, [out]]])["ok"]
    assert torch.equal(other.fetch(out), torch.full((1024,), 3.0))
    small = _held(hostile, "aten::ones.default", [[4]], {"dtype": F32, "device": R})
    assert torch.equal(hostile.fetch(small["h"]), torch.ones(4))


def test_an_op_over_the_device_is_refused_before_it_allocates(server: Server) -> None:
    """A tenant without a quota is still held to the device's capacity (1 GiB here), before."""
    c = Client(server, UNLIMITED)
    try:
        h, op = _op(c, "aten::eye.default", [17000], {"device": R})  # 1.16 GB of float32
        done = c.batch([op])
        assert not done["ok"] and done["error"]["quota"]["kind"] == "capacity", done
        assert server.memory.peak_bytes <= server.memory.capacity_bytes
        assert c.session.account.peak_bytes == 0
    finally:
        c.close()


def _calls(c: Client, stream: list[int], defs: list | None = None) -> dict:
    """A batch of template calls (the op stream of ``(template id, numbers...)``)."""
    data = array("q", stream).tobytes()
    c.seq += 1
    head: dict = {"seq": c.seq, "ops": [], "free": [], "xb": len(data)}
    if defs:
        head["defs"] = defs
    c.writer.send(*wire.split_frame(MsgType.BATCH, head, [data]))
    return c.until(MsgType.DONE)


def test_a_template_call_is_sized_by_its_own_tensors(server: Server, clients: list[Client]) -> None:
    """A template is sized per signature of the tensors each call names: reused with a small
    tensor, then with a huge view, the second call is refused before it allocates."""
    c = Client(server, HOSTILE)
    clients.append(c)
    small = _held(c, "aten::ones.default", [[4]], {"dtype": F32, "device": R})["h"]
    one = _held(c, "aten::ones.default", [[1]], {"dtype": F32, "device": R})
    wide = _held(c, "aten::expand.default", [one, [100_000_000]])["h"]
    clone = [1, "aten::clone.default", [{"xh": 0}], {}, [1], 2]
    done = _calls(c, [1, small, 100], defs=[clone])
    assert done["ok"], done
    assert torch.equal(c.fetch(100), torch.ones(4))
    done = _calls(c, [1, wide, 101])
    assert not done["ok"] and done["error"]["type"] == "QuotaError", done
    assert done["error"]["quota"]["asked"] == 400_000_000
    assert server.memory.tenants[HOSTILE.name].peak_bytes <= LIMIT
    assert _calls(c, [1, small, 102])["ok"]  # and the small one still runs


def test_an_op_sized_by_its_data_runs_when_it_fits(server: Server, clients: list[Client]) -> None:
    """Bounds of data-dependent ops are upper bounds: within the quota the op runs and is right."""
    c = Client(server, HOSTILE)
    clients.append(c)
    repeats = _held(c, "aten::arange.default", [4], {"dtype": I64, "device": R})
    h, op = _op(c, "aten::repeat_interleave.Tensor", [repeats])
    assert c.batch([op])["ok"]
    assert torch.equal(c.fetch(h), torch.tensor([1, 2, 2, 3, 3, 3]))
    mask = _held(c, "aten::gt.Scalar", [repeats, 1])
    h, op = _op(c, "aten::index.Tensor", [repeats, [mask]])
    assert c.batch([op])["ok"]
    assert torch.equal(c.fetch(h), torch.tensor([2, 3]))


def test_an_op_that_cannot_be_sized_is_refused_with_why(
    server: Server, clients: list[Client]
) -> None:
    c = Client(server, HOSTILE)
    clients.append(c)
    x = _held(c, "aten::ones.default", [[4, 2]], {"dtype": F32, "device": R})
    y = _held(c, "aten::ones.default", [[3, 3]], {"dtype": F32, "device": R})
    h, op = _op(c, "aten::histogramdd.default", [x, [2, 2]])
    done = c.batch([op])
    assert not done["ok"]
    assert "cannot tell what this op would allocate before it runs" in done["error"]["message"]
    # Arguments the op refuses on meta: the meta kernel's error, and nothing ran.
    h, op = _op(c, "aten::add.Tensor", [x, y])
    done = c.batch([op])
    assert not done["ok"]
    assert done["error"]["message"].startswith("RuntimeError: Attempting to broadcast")
    assert len(c.session.handles) == 2


def test_a_refused_op_on_an_upload_waits_and_runs_with_its_upload(
    server: Server, clients: list[Client]
) -> None:
    """A ``wait`` tenant's op refused before it ran waits; the upload it took is put back (and
    counted again) so that it runs, later, on the same bytes."""
    holder, waiter = Client(server, PATIENT), Client(server, PATIENT)
    clients += [holder, waiter]
    quarter = LIMIT // 4 // 4  # float32 elements of a quarter of the quota
    held = [
        _held(holder, "aten::ones.default", [[quarter]], {"dtype": F32, "device": R})
        for _ in range(3)
    ]
    data = torch.arange(quarter, dtype=torch.float32)
    out = next(waiter.handles)
    waiter.send(
        [["aten::repeat.default", [{"b": 1}, [2]], {}, [out]]],
        blobs=[[1, "float32", [quarter], quarter * 4]],
        data=data.numpy().tobytes(),
    )
    _wait_for(lambda: _waiting(server, PATIENT) == 1)
    assert waiter.session.blobs.pending_bytes == quarter * 4  # back, and counted
    assert server.memory.tenants[PATIENT.name].peak_bytes <= LIMIT
    holder.batch([], free=[held[0]["h"]])
    done = waiter.until(MsgType.DONE)
    assert done["ok"], done
    assert torch.equal(waiter.fetch(out), torch.cat([data, data]))
    assert waiter.session.blobs.pending_bytes == 0
    assert server.memory.tenants[PATIENT.name].peak_bytes <= LIMIT


# ---- the runtime's own ops -------------------------------------------------------------------------

LONG = LIMIT // 4 // 16 + 1  # 16 rows of this many float32: just over the quota


def test_a_whole_function_is_sized_before_it_runs(server: Server, clients: list[Client]) -> None:
    """``rt::fn`` (here attention over an expanded view, no bytes of its own) is refused by its
    output's size before the function runs."""
    c = Client(server, HOSTILE)
    clients.append(c)
    one = _held(c, "aten::ones.default", [[1]], {"dtype": F32, "device": R})
    q = _held(c, "aten::expand.default", [one, [1, 1, 16, LONG]])
    out = next(c.handles)
    done = c.batch([["rt::fn", ["sdpa", [q, q, q], {}, [False] * 3, 0], {}, [out]]])
    assert not done["ok"] and done["error"]["type"] == "QuotaError", done
    assert done["error"]["quota"]["asked"] == 16 * LONG * 4
    assert server.memory.tenants[HOSTILE.name].peak_bytes <= LIMIT
    # A function that fits runs, and its result is right.
    small = _held(c, "aten::ones.default", [[1, 1, 4, 8]], {"dtype": F32, "device": R})
    done = c.batch([["rt::fn", ["sdpa", [small, small, small], {}, [False] * 3, 0], {}, [out]]])
    assert done["ok"], done
    assert torch.equal(c.fetch(out), torch.ones(1, 1, 4, 8))


def test_a_backward_is_sized_before_it_runs(server: Server, clients: list[Client]) -> None:
    """``rt::backward`` makes one gradient per input of the function, of the input's size: an
    expanded key's gradient is its full size, refused before the backward runs."""
    c = Client(server, HOSTILE)
    clients.append(c)
    q = _held(c, "aten::ones.default", [[1, 1, 1, 16]], {"dtype": F32, "device": R})
    one = _held(c, "aten::ones.default", [[1]], {"dtype": F32, "device": R})
    k = _held(c, "aten::expand.default", [one, [1, 1, LONG, 16]])
    v = _held(c, "aten::expand.default", [one, [1, 1, LONG, 1]])
    out = next(c.handles)
    fn = ["rt::fn", ["sdpa", [q, k, v], {}, [True] * 3, 77], {}, [out]]
    assert c.batch([fn])["ok"]
    grad = _held(c, "aten::ones.default", [[1, 1, 1, 1]], {"dtype": F32, "device": R})
    hs = [next(c.handles) for _ in range(3)]
    done = c.batch([["rt::backward", [77, [grad]], {}, hs]])
    assert not done["ok"] and done["error"]["type"] == "QuotaError", done
    assert done["error"]["quota"]["asked"] == 16 * 4 + LONG * 16 * 4 + LONG * 4
    assert server.memory.tenants[HOSTILE.name].peak_bytes <= LIMIT
    assert len(c.session.handles) == 6  # no gradient kept
    assert 77 not in c.session.graphs  # the failed backward used its graph up


def test_a_backward_that_waits_runs_on_its_graph(server: Server, clients: list[Client]) -> None:
    holder, waiter = Client(server, PATIENT), Client(server, PATIENT)
    clients += [holder, waiter]
    quarter = LIMIT // 4 // 4
    held = [
        _held(holder, "aten::ones.default", [[quarter]], {"dtype": F32, "device": R})
        for _ in range(3)
    ]
    length = quarter // 16  # the key's gradient: a quarter of the quota
    q = _held(waiter, "aten::ones.default", [[1, 1, 1, 16]], {"dtype": F32, "device": R})
    one = _held(waiter, "aten::ones.default", [[1]], {"dtype": F32, "device": R})
    k = _held(waiter, "aten::expand.default", [one, [1, 1, length, 16]])
    v = _held(waiter, "aten::expand.default", [one, [1, 1, length, 1]])
    out = next(waiter.handles)
    assert waiter.batch([["rt::fn", ["sdpa", [q, k, v], {}, [True] * 3, 78], {}, [out]]])["ok"]
    grad = _held(waiter, "aten::ones.default", [[1, 1, 1, 1]], {"dtype": F32, "device": R})
    hs = [next(waiter.handles) for _ in range(3)]
    waiter.send([["rt::backward", [78, [grad]], {}, hs]])
    _wait_for(lambda: _waiting(server, PATIENT) == 1)
    assert 78 in waiter.session.graphs  # put back for the run to come
    holder.batch([], free=[held[0]["h"]])
    done = waiter.until(MsgType.DONE)
    assert done["ok"], done
    dv = waiter.fetch(hs[2])  # attention spread evenly over the key's rows
    assert dv.shape == (1, 1, length, 1)
    assert torch.allclose(dv, torch.full_like(dv, 1 / length))
    assert 78 not in waiter.session.graphs
    assert server.memory.tenants[PATIENT.name].peak_bytes <= LIMIT
