"""How the forwarding client issues ops, against a real server on loopback: when batches go,
which ops travel as templates, what a training step issues."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
from torch.optim.optimizer import _default_to_fused_or_foreach

from gpu_trace import runtime
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.connection import Connection
from gpu_trace.runtime.server.server import Server

TOKEN = "issuing-test-token-0123"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("127.0.0.1:0", token=TOKEN) as srv:
        yield srv


@pytest.fixture
def dev(server: Server) -> Iterator[torch.device]:
    device = runtime.connect(server.address, token=TOKEN)
    yield device
    runtime.disconnect()


def _conn() -> Connection:
    c = runtime.current()
    assert c is not None
    return c


def test_with_hold_us_a_batch_in_flight_holds_no_op_back_longer(server: Server) -> None:
    """While a batch is in flight the next one fills; with ``hold_us``, an op that has waited that
    long goes without waiting for the DONE (handled by a thread that may get no CPU for a while
    on a loaded machine)."""
    dev = runtime.connect(server.address, token=TOKEN, hold_us=1000)
    try:
        c = _conn()
        x = torch.arange(4.0).to(dev)
        x.sum().item()
        with server.executor.lock:  # the server takes the batch but cannot answer it
            y = x + 1
            c.flush()
            sent = c.batches_sent
            y = y * 2  # fills the next batch: one op, the other still in flight
            assert c.batches_sent == sent
            time.sleep(0.002)  # longer than hold_us
            y = y - 3
            assert c.batches_sent == sent + 1
        assert y.tolist() == [-1.0, 1.0, 3.0, 5.0]
    finally:
        runtime.disconnect()


def test_with_nothing_in_flight_an_op_goes_at_once(dev: torch.device) -> None:
    """A step's first op is not held for company: the server starts on it while the program
    issues the rest (and no thread is woken to send it later)."""
    c = _conn()
    x = torch.arange(3.0).to(dev)
    x.sum().item()  # nothing in flight now
    sent = c.batches_sent
    y = x * 2
    assert c.batches_sent == sent + 1
    assert y.tolist() == [0.0, 2.0, 4.0]


def test_optimizers_take_their_foreach_path_on_remote_tensors(dev: torch.device) -> None:
    """As on CUDA, where PyTorch defaults to foreach: a step issues an op per parameter group,
    not per parameter, and computes what the same step computes locally."""
    params = list(nn.Linear(3, 2).to(dev).parameters())
    assert _default_to_fused_or_foreach(params, False, False) == (False, True)

    # Everything random is drawn before any op is forwarded: this server shares the process,
    # and its generator swaps (each session has its own) would move the program's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    x, y = torch.randn(5, 6), torch.randint(0, 2, (5,))
    remote = copy.deepcopy(model).to(dev)

    def train(m: nn.Module, device: torch.device | str) -> list[float]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    assert train(remote, dev) == train(model, "cpu")


def test_in_place_list_ops_are_template_calls(dev: torch.device) -> None:
    """Ops returning nothing (``_foreach_add_``) define a template once and call it after."""
    c = _conn()
    a, b = torch.zeros(3), torch.ones(2)
    ra, rb = a.to(dev), b.to(dev)
    defined = c._defined
    for _ in range(3):
        torch._foreach_add_([ra, rb], 2)
        torch._foreach_add_([a, b], 2)
    assert c._defined == defined + 1
    assert torch.equal(ra.cpu(), a) and torch.equal(rb.cpu(), b)


@pytest.mark.parametrize("op", ["add_", "_foreach_mul_"])
def test_a_float_that_changes_every_call_stops_making_plans_and_templates(
    dev: torch.device, op: str
) -> None:
    """A learning rate that changes every step (a schedule) makes a new signature per call: after
    ``VOLATILE_AFTER`` of them, new values reuse the first plan and go as JSON ops, so the shape
    cache and the session's templates stop growing; the values stay exact."""
    c = _conn()
    p, g = torch.randn(4), torch.randn(4)
    rp, rg = p.to(dev), g.to(dev)
    plans, defined = len(rt.cache), c._defined
    for i in range(20):
        lr = 0.1 / (i + 1)
        if op == "add_":
            rp.add_(rg, alpha=-lr)
            p.add_(g, alpha=-lr)
        else:
            torch._foreach_mul_([rp], 1 - lr)
            torch._foreach_mul_([p], 1 - lr)
    assert torch.equal(rp.cpu(), p)
    assert len(rt.cache) - plans <= 4  # VOLATILE_AFTER of the 20 values made one each
    assert c._defined - defined <= 4
