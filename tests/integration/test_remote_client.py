"""The forwarding client against a real server on loopback: values, training, errors, lifetime."""

from __future__ import annotations

import gc
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

from gpu_trace import runtime
from gpu_trace.runtime.client import composites
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.server.server import Server

TOKEN = "client-test-token-0123"


def start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    """`gpu-trace serve` in its own process (its random generator is its own)."""
    env = {**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpu_trace",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--device",
            "cpu",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "serving cpu on" in line, line
    return proc, line.split(" on ")[1].split()[0]


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    proc, address = start_server()
    yield address
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=20)
    assert proc.stderr is not None
    proc.stderr.close()


@pytest.fixture
def dev(served: str) -> Iterator[torch.device]:
    device = runtime.connect(served, token=TOKEN)
    yield device
    runtime.disconnect()
    assert not composites.is_patched()


def test_values_round_trip_and_print(dev: torch.device) -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    r = x.to(dev)
    assert type(r) is rt.RemoteTensor and r.device == dev
    assert r.shape == (3, 4) and r.stride() == (4, 1)
    y = (r * 2 + 1).t()
    assert torch.equal(y.cpu(), (x * 2 + 1).t())
    assert y.tolist() == (x * 2 + 1).t().tolist()
    assert r.sum().item() == 66.0
    assert bool((r > 5).any())
    assert "remote:0" in repr(r) and "11." in repr(r)
    assert torch.equal(torch.zeros(2, 3, device=dev).cpu(), torch.zeros(2, 3))
    assert torch.tensor([1.5, 2.5], device=dev).tolist() == [1.5, 2.5]
    assert torch.arange(5, device=dev).cpu().tolist() == [0, 1, 2, 3, 4]
    cpu_dst = torch.empty(3, 4)
    cpu_dst.copy_(r)
    assert torch.equal(cpu_dst, x)


def test_seeded_randomness_matches_local(dev: torch.device) -> None:
    torch.manual_seed(123)
    remote = torch.randn(5, device=dev).cpu()
    torch.manual_seed(123)
    assert torch.equal(remote, torch.randn(5))


def test_large_tensors_are_chunked_both_ways(dev: torch.device) -> None:
    x = torch.randn(3_000_000)  # 12 MB
    r = x.to(dev)
    assert torch.equal((r + 0).cpu(), x)


def test_data_dependent_shapes(dev: torch.device) -> None:
    x = torch.tensor([0.0, 3.0, 0.0, -1.0])
    r = x.to(dev)
    assert torch.equal(r.nonzero().cpu(), x.nonzero())
    assert torch.equal(r[r != 0].cpu(), x[x != 0])


def test_shapes_are_cached_after_first_use(dev: torch.device) -> None:
    a = torch.ones(7, 3, device=dev)
    (a + a).sum()
    misses = rt.cache.misses
    for _ in range(10):
        (a + a).sum()
    assert rt.cache.misses == misses


def test_each_signature_has_its_own_plan_and_template(dev: torch.device) -> None:
    """Plans and templates are found by the inputs' dtypes, shapes, strides and offsets and the
    other arguments' values: calls that differ in any one give their own results."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    r = base.to(dev)
    cases = [
        (r, base),
        (r.double(), base.double()),  # dtype
        (r.reshape(4, 3), base.reshape(4, 3)),  # shape
        (r.t(), base.t()),  # strides
        (r[1:], base[1:]),  # storage offset
        (r[:, 1:], base[:, 1:]),  # offset and strides
    ]
    for _ in range(2):  # the second round reuses each plan and template
        for remote, local in cases:
            got = remote * 2 + 1
            assert got.shape == local.shape and got.stride() == (local * 2 + 1).stride()
            assert torch.equal(got.cpu(), local * 2 + 1)
            assert torch.equal((remote + 0.5).cpu(), local + 0.5)
            assert torch.equal((remote + 2).cpu(), local + 2)  # an int, then a float
    # 0.0 and -0.0 are equal, but a template keeps the value: 1 / (x * -0.0) is -inf.
    ones = torch.ones(2, device=dev)
    assert (1 / (ones * 0.0)).tolist() == [float("inf")] * 2
    assert (1 / (ones * -0.0)).tolist() == [float("-inf")] * 2
    assert (1 / (ones * 0.0)).tolist() == [float("inf")] * 2
    # NaN equals nothing, itself included: still one plan for every NaN.
    assert math.isnan((ones * float("nan")).tolist()[0])
    plans = len(rt.cache)
    for _ in range(5):
        assert math.isnan((ones * float("nan")).tolist()[1])
    assert len(rt.cache) == plans
    # The same through the encoder (a keyword argument): alpha=-0.0 is not alpha=0.0.
    negative_zeros = ones * -0.0
    assert (1 / torch.add(negative_zeros, ones, alpha=0.0)).tolist() == [float("inf")] * 2
    assert (1 / torch.add(negative_zeros, ones, alpha=-0.0)).tolist() == [float("-inf")] * 2


def test_requires_grad_does_not_change_what_runs(dev: torch.device) -> None:
    """requires_grad is autograd's business, above the dispatch that plans see: the same
    signature with and without it gives the same op, and gradients are right."""
    x = torch.tensor([1.0, -2.0, 3.0])
    plain = x.to(dev)
    leaf = x.to(dev).requires_grad_()
    assert torch.equal((plain * plain).cpu(), x * x)
    y = (leaf * leaf).sum()
    y.backward()
    assert torch.equal(leaf.grad.cpu(), 2 * x)
    assert torch.equal((plain * plain).cpu(), x * x)


def test_templates_with_lists_uploads_and_keywords(dev: torch.device) -> None:
    """Templates whose handles sit in lists, uploads and keyword arguments, called again."""
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    ra, rb = a.to(dev), b.to(dev)
    for i in range(3):
        cpu = torch.full((2, 3), float(i))
        assert torch.equal(torch.cat([ra, rb, ra]).cpu(), torch.cat([a, b, a]))
        assert torch.equal((ra + cpu.to(dev)).cpu(), a + cpu)  # a fresh upload each time
        assert torch.equal(torch.where(ra > 0, ra, rb).cpu(), torch.where(a > 0, a, b))
        got = ra.sum(dim=1, dtype=torch.float64)
        assert got.dtype == torch.float64 and torch.equal(got.cpu(), a.sum(1, dtype=torch.float64))
        ra.add_(rb, alpha=2)
        a.add_(b, alpha=2)
        assert torch.equal(ra.cpu(), a)


def test_templates_are_defined_again_in_a_new_session(served: str) -> None:
    """Plans outlive a session; their templates are the session's, so a new one defines them."""
    x = torch.arange(5.0)
    for _ in range(2):
        dev = runtime.connect(served, token=TOKEN)
        try:
            r = x.to(dev)
            for _ in range(3):
                assert torch.equal((r * 3 - 1).cpu(), x * 3 - 1)
        finally:
            runtime.disconnect()


def test_template_calls_of_a_paged_out_session() -> None:
    """A paged-out session's next batch is read by the pager as JSON ops: its template calls
    are filled in for it, and the values come back."""
    with Server("127.0.0.1:0", token=TOKEN) as srv:
        device = runtime.connect(srv.address, token=TOKEN)
        try:
            x = torch.arange(6.0)
            r = x.to(device)
            for _ in range(3):  # defines the templates, then calls them
                r, x = r * 2 + 1, x * 2 + 1
            runtime.synchronize()
            session = srv.sessions[runtime.current().session_id]
            assert srv.page_out(session.id, by="test")
            assert srv.pager.is_paged(session)
            for _ in range(3):
                r, x = r * 2 + 1, x * 2 + 1
            assert torch.equal(r.cpu(), x)
            assert session.usage.restores == 1
        finally:
            runtime.disconnect()


def test_async_error_surfaces_at_next_sync_with_op_and_stack(dev: torch.device) -> None:
    r = torch.ones(3, device=dev)
    index = torch.tensor([7], device=dev)
    bad = r[index]  # fails on the server; the client does not wait here
    line = sys._getframe().f_lineno - 1
    with pytest.raises(runtime.RemoteOpError) as info:
        bad.sum().item()
    err = info.value
    assert err.op == "aten::index.Tensor"
    assert "out of bounds" in err.server_message
    assert any(f == __file__ and n == line for f, n, _ in err.client_stack)
    assert f"line {line}" in str(err)
    assert (r + 1).sum().item() == 6.0  # the session goes on


def test_meta_errors_are_raised_at_once(dev: torch.device) -> None:
    with pytest.raises(runtime.RemoteOpError, match="view"):
        torch.ones(3, device=dev).view(7)


def test_garbage_collected_tensors_are_freed_on_the_server(dev: torch.device) -> None:
    from gpu_trace.runtime.client.device import RemoteModule

    keep = torch.ones(10, device=dev)
    runtime.synchronize()
    before = RemoteModule.memory_stats()["tensors"]
    for _ in range(200):
        t = keep * 2
        del t
    gc.collect()
    runtime.synchronize()
    runtime.synchronize()  # the frees ride on the next batch
    after = RemoteModule.memory_stats()["tensors"]
    assert after <= before + 2


def test_sync_mode_gives_the_same_values(served: str) -> None:
    runtime.connect(served, token=TOKEN, sync=True)
    try:
        x = torch.linspace(0, 1, 10)
        r = x.to(rt.DEVICE)
        assert torch.equal((r.exp() * 3).cpu(), x.exp() * 3)
        assert runtime.current().batches_sent >= 3
    finally:
        runtime.disconnect()


def _same_number(a: object, b: object) -> bool:
    """Equal and of one type, telling -0.0 from 0.0 and taking NaN as equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)  # type: ignore[arg-type]
    return a == b and str(a) == str(b)


@pytest.mark.parametrize("binary", [True, False])
def test_item_values_are_exact_and_older_servers_get_json(
    monkeypatch: pytest.MonkeyPatch, binary: bool
) -> None:
    """``.item()`` of every kind of number comes back exactly (a DONE_VALUE for ints, floats
    and bools; a JSON DONE for complex). A server that does not say ``binary`` in its WELCOME
    (an older one) is sent JSON batches only, and its client still gets every value."""
    from gpu_trace.runtime.protocol import auth
    from gpu_trace.runtime.server import conversation

    calls: list[int] = []
    decode_calls = conversation.decode_calls
    monkeypatch.setattr(conversation, "decode_calls", lambda b: calls.append(1) or decode_calls(b))
    if not binary:
        handshake = auth.client_handshake

        def older_server(*args: object, **kwargs: object) -> tuple:
            reader, welcome = handshake(*args, **kwargs)
            welcome.pop("binary", None)
            return reader, welcome

        monkeypatch.setattr(auth, "client_handshake", older_server)
    local = [
        torch.tensor([float("nan"), float("-inf"), -0.0, 1.5e300, 2.0**-1074]),
        torch.tensor([-(1 << 63), (1 << 63) - 1, 0]),
        torch.tensor([True, False]),
        torch.tensor([1.5 - 2j]),
    ]
    with Server("127.0.0.1:0", token=TOKEN) as srv:
        dev = runtime.connect(srv.address, token=TOKEN)
        try:
            assert runtime.current().binary is binary
            for x in local:
                r = x.to(dev)
                for _ in range(2):  # the second time through the op's template
                    for i in range(len(x)):
                        assert _same_number(r[i].item(), x[i].item()), (x, i)
            assert bool((r.abs() > 1).all())
        finally:
            runtime.disconnect()
    assert bool(calls) is binary


# ---- training: bitwise the same losses as on the CPU ---------------------------------------------


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 8, 3, stride=2)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        return self.fc(torch.relu(self.c2(x)).flatten(1))


class LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 16, batch_first=True, num_layers=2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(x))
        return self.fc(out[:, -1])


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.enc(self.emb(x)).mean(1))


def _train(kind: type, device: torch.device | str, steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    model = kind().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        if kind is CNN:
            x = torch.randn(4, 1, 12, 12, generator=g)
            y = torch.randint(0, 10, (4,), generator=g)
        else:
            x = torch.randint(0, 20, (4, 7), generator=g)
            y = torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", [CNN, LSTM, Transformer])
def test_training_losses_are_bitwise_the_same_as_local(dev: torch.device, kind: type) -> None:
    local = _train(kind, "cpu")
    remote = _train(kind, dev)
    assert remote == local  # exact float equality, step by step


# ---- lifetime ------------------------------------------------------------------------------------


def test_disconnect_frees_the_session() -> None:
    with Server("127.0.0.1:0", token=TOKEN) as server:
        dev = runtime.connect(server.address, token=TOKEN)
        x = torch.ones(1000, device=dev) * 3
        x.sum().item()
        (session,) = server.sessions.values()
        assert len(session.handles) >= 2
        runtime.disconnect()
        deadline = time.monotonic() + 5
        while server.sessions or len(session.handles) or session.account.bytes:
            assert time.monotonic() < deadline, "session not freed"
            time.sleep(0.02)


def test_a_program_with_over_1024_open_files_forwards() -> None:
    # The client waited for its socket with select(), which refuses descriptors >= 1024: a program
    # holding many files got ServerGone on its first forwarded call.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-files limit ({hard}) is too low to hold 1024 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        with Server("127.0.0.1:0", token=TOKEN) as server:
            dev = runtime.connect(server.address, token=TOKEN)
            conn = rt.conn
            assert conn is not None and conn.sock.fileno() >= 1024
            x = torch.arange(6.0, device=dev).reshape(2, 3)
            assert (x * 2).sum().item() == 30.0
            runtime.disconnect()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_server_that_goes_away_is_a_clear_error_not_a_hang() -> None:
    proc, address = start_server()
    try:
        dev = runtime.connect(address, token=TOKEN, timeout_s=5)
        x = torch.ones(4, device=dev)
        assert x.sum().item() == 4.0
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(runtime.ServerGone, match="went away|did not answer"):
            for _ in range(100):
                (x + 1).sum().item()
        assert time.monotonic() - t0 < 10
    finally:
        runtime.disconnect()
        if proc.poll() is None:
            proc.kill()
        assert proc.stderr is not None
        proc.stderr.close()


def test_wrong_token_is_refused(served: str) -> None:
    with pytest.raises(runtime.ProtocolMismatch, match="authentication"):
        runtime.connect(served, token="not-the-right-token-00")
    assert runtime.current() is None


def test_the_runtime_used_before_torch_is_imported_logs_no_failed_hook() -> None:
    # runtime.connect reached before the program imported torch: device.py imports torch itself,
    # and the hook that registers the device on torch's import found device.py half-loaded and
    # logged a traceback; now it leaves the registration to connect().
    code = "from gpu_trace import runtime; runtime.connect; print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "loaded\n" and out.stderr == "", out.stderr
