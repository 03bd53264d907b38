"""Memory quotas and accounting on a real CUDA device (skipped without a GPU).

The tenants' byte sums must match what the CUDA caching allocator says it has handed out
(``torch.cuda.memory_allocated``): storages are counted rounded up to its 512-byte blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from gpu_trace.runtime.server.server import Server  # noqa: E402
from gpu_trace.runtime.sharing.tenants import Tenant  # noqa: E402
from tests.integration.test_sharing_memory import Client  # noqa: E402

A = Tenant("a", "a-token-0123456789abc", memory_fraction=0.25)
B = Tenant("b", "b-token-0123456789abc")
SMALL = Tenant("small", "small-token-0123456789", memory_bytes=1 << 20)


@pytest.fixture
def server() -> Iterator[Server]:
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    clients: list[Client] = []
    with Server("127.0.0.1:0", device="cuda:0", tenants=[A, B, SMALL]) as srv:
        srv.test_clients = clients  # type: ignore[attr-defined]
        yield srv
        for c in clients:
            c.close()


def client(server: Server, tenant: Tenant) -> Client:
    c = Client(server, tenant)
    server.test_clients.append(c)  # type: ignore[attr-defined]
    return c


def empty(handle: int, numel: int, dtype: str = "float32") -> list:
    kwargs = {"dtype": {"d": dtype}, "device": {"v": "r"}}
    return ["aten::empty.memory_format", [[numel]], kwargs, [handle]]


def sync(c: Client) -> None:
    assert c.batch([["rt::sync", [], {}, None]])["ok"]


def used(server: Server) -> int:
    return sum(t["used_bytes"] for t in server.memory.snapshot().values())


def test_tenant_sums_match_the_caching_allocator(server: Server) -> None:
    # No cached blocks: a request served from a larger cached block whose rest is under 1 MiB
    # gets the whole block, and memory_allocated() counts it all.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    a, b = client(server, A), client(server, B)
    # Sizes on both sides of the allocator's 512-byte rounding, and views that add nothing.
    ops_a = [
        empty(1, 1),
        empty(2, 127),
        empty(3, 128),
        empty(4, 129),
        empty(5, 4097, "int8"),
        ["aten::view.default", [{"h": 4}, [129, 1]], {}, [6]],
        ["aten::add.Tensor", [{"h": 3}, {"h": 3}], {}, [7]],
        empty(8, (3 << 20) + 3),  # large blocks round the same way
    ]
    assert a.batch(ops_a)["ok"]
    assert b.batch([empty(1, 1000, "float64"), empty(2, 33, "float16")])["ok"]
    sync(a)
    sync(b)
    assert used(server) == torch.cuda.memory_allocated() - base
    assert server.memory.snapshot()["a"]["used_bytes"] == (
        512 + 512 + 512 + 1024 + 4608 + 512 + (((3 << 20) + 3) * 4 + 511) // 512 * 512
    )
    assert a.batch([], free=[1, 2, 8])["ok"]
    sync(a)
    assert used(server) == torch.cuda.memory_allocated() - base
    a.close()
    b.close()
    server.test_clients.clear()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 20
    while used(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    torch.cuda.synchronize()
    assert used(server) == 0 and torch.cuda.memory_allocated() == base


def test_quota_is_enforced_on_the_device(server: Server) -> None:
    c = client(server, SMALL)
    assert c.batch([empty(1, 200_000)])["ok"]  # 800,000 bytes
    done = c.batch([empty(2, 100_000)])
    assert done["error"]["type"] == "QuotaError"
    assert done["error"]["quota"]["asked"] == 400_384  # rounded to 512-byte blocks
    assert c.batch([empty(3, 10_000)])["ok"]


def test_out_of_memory_fails_that_session_only() -> None:
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    total = torch.cuda.get_device_properties(0).total_memory
    # A server told the device is four times its size: allocations pass the accounting and
    # run out of real memory.
    with Server("127.0.0.1:0", device="cuda:0", tenants=[A, B], device_memory=4 * total) as srv:
        greedy, other = Client(srv, B), Client(srv, A)
        try:
            assert other.batch([empty(1, 1000)])["ok"]
            chunk = 40 << 30  # bytes per allocation (float64)
            for h in range(1, 4 * total // chunk + 2):
                done = greedy.batch([empty(h, chunk // 8, "float64")])
                if not done["ok"]:
                    break
            assert done["error"]["type"] == "OutOfMemoryError", done
            assert greedy.batch([], free=list(range(1, h)))["ok"]
            assert greedy.batch([empty(100, 1000)])["ok"]
            assert other.batch([["aten::add.Tensor", [{"h": 1}, {"h": 1}], {}, [2]]])["ok"]
            sync(other)
        finally:
            greedy.close()
            other.close()


def test_busy_time_comes_from_cuda_events(server: Server) -> None:
    c = client(server, B)
    ops = [
        ["aten::randn.default", [[2048, 2048]], {"device": {"v": "r"}}, [1]],
        ["aten::mm.default", [{"h": 1}, {"h": 1}], {}, [2]],
        ["aten::mm.default", [{"h": 2}, {"h": 1}], {}, [3]],
    ]
    assert c.batch(ops)["ok"]
    sync(c)
    sync(c)  # events of earlier batches are read when a later one runs
    assert c.session.usage.busy_ns > 0
    assert server.executor._streams[c.session.id] != torch.cuda.default_stream()
