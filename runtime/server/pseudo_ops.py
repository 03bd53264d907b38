"""The runtime's own ops (``rt::...``), run by the executor next to ATen ops.

``rt::fetch`` sends a tensor's bytes back, ``rt::meta`` the shape of a data-dependent output,
``rt::seed`` seeds the session's generator, ``rt::fn`` runs a whole function with server-side
autograd (:mod:`gpu_trace.runtime.client.composites`) and ``rt::backward`` its gradients,
``rt::sync`` and ``rt::memory`` answer the client's CUDA emulation, with the ops of
:mod:`~gpu_trace.runtime.server.device_ops` (events, device queries, backend settings). Also
the random-state helpers that keep each session on its own random stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.protocol.values import ArgDecoder, tensor_bytes
from gpu_trace.runtime.protocol.wire import (
    CHUNK_BYTES,
    MsgType,
    ProtocolError,
    chunk_frames,
    split_frame,
)
from gpu_trace.runtime.server import device_ops
from gpu_trace.runtime.server.sizing import Sizing
from gpu_trace.runtime.sharing.memory import allocator_bytes
from gpu_trace.runtime.sharing.sessions import Session


class PseudoRunner(device_ops.Runner, Protocol):
    """What these ops read (and the random stream's owner they set) of the executor that runs
    them (:class:`~gpu_trace.runtime.server.executor.Executor`)."""

    sizing: Sizing
    extra_ops: dict[str, Callable[[Session, list[object]], object]]
    _rng_owner: Session | None

    def admit(
        self,
        session: Session,
        nbytes: int,
        taken: int | None = None,
        undo: Callable[[], object] | None = None,
    ) -> None: ...


def run_pseudo(
    ex: PseudoRunner, session: Session, decoder: ArgDecoder, name: str, args: Any, outs: Any
) -> Any:
    torch = ex.torch
    if type(args) is not list:
        raise ProtocolError("op args must be a list")
    if name == "rt::fetch":  # send a tensor's bytes back: DATA, then CHUNKs if large
        if len(args) != 2 or type(args[1]) is not int:
            raise ProtocolError("rt::fetch takes [handle, fetch id]")
        tensor = decoder.decode(args[0])
        if not isinstance(tensor, torch.Tensor):
            raise OpError("rt::fetch needs a tensor")
        data = tensor_bytes(tensor.detach().to("cpu"))
        session.usage.bytes_out += len(data)
        head = {
            "fetch": args[1],
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "nbytes": len(data),
        }
        if len(data) <= CHUNK_BYTES:
            session.send(*split_frame(MsgType.DATA, head, [data]))
        else:
            session.send(*split_frame(MsgType.DATA, head, []), *chunk_frames(args[1], data))
        return None
    if name == "rt::meta":  # the shape of outputs whose shape depends on data
        tensor = decoder.decode(args[0]) if args else None
        if not isinstance(tensor, torch.Tensor):
            raise OpError("rt::meta needs a tensor")
        return [
            list(tensor.shape),
            list(tensor.stride()),
            tensor.storage_offset(),
            str(tensor.dtype).removeprefix("torch."),
        ]
    if name == "rt::seed":
        if len(args) != 1 or type(args[0]) is not int:
            raise ProtocolError("rt::seed takes [seed]")
        seed_device(torch, ex.device, args[0] & 0xFFFFFFFFFFFFFFFF)
        session.seed = None
        ex._rng_owner = session
        return None
    if name == "rt::fn":
        return _function(ex, session, decoder, args, outs)
    if name == "rt::backward":
        return _backward(ex, session, decoder, args, outs)
    if name == "rt::sync":
        if ex.device.type == "cuda":  # the session's own stream: others' work is not waited for
            torch.cuda.current_stream(ex.device).synchronize()
        return None
    if name == "rt::memory":
        return [session.account.bytes, session.account.peak_bytes, len(session.handles)]
    if name in device_ops.NAMES:  # events, device queries, backend settings
        return device_ops.run(ex, session, name, args)
    extra = ex.extra_ops.get(name)
    if extra is not None:
        return extra(session, args)
    raise OpError(f"unknown runtime op {name[:100]!r}")


def _function(ex: PseudoRunner, session: Session, decoder: ArgDecoder, args: Any, outs: Any) -> Any:
    """``rt::fn``: a whole function (:mod:`gpu_trace.runtime.protocol.functions`), its graph kept
    for backward."""
    from gpu_trace.runtime.protocol import functions

    torch = ex.torch
    if len(args) != 5 or type(args[3]) is not list or type(args[4]) is not int:
        raise ProtocolError("rt::fn takes [name, args, kwargs, grad mask, graph id]")
    name, fargs, fkwargs, mask, graph_id = args
    fn = functions.server_function(name)
    if fn is None:
        raise OpError(f"function {str(name)[:100]!r} is not one the server runs whole")
    if type(fargs) is not list or type(outs) is not list:
        raise ProtocolError("rt::fn arguments and outs must be lists")
    if any(m is True for m in mask):
        refusal = whole_op_refusal(ex.device.type)
        if refusal is not None:
            raise OpError(f"{str(name)[:100]} with autograd: {refusal}")
    a = decoder.decode_args(fargs)
    k = decoder.decode_kwargs(fkwargs) if fkwargs else {}
    leaves: list[Any] = []
    position = [0]

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            i = position[0]
            position[0] += 1
            if i < len(mask) and mask[i] is True:
                x = x.detach().requires_grad_()
                leaves.append(x)
            return x
        if type(x) in (list, tuple):
            return type(x)(leaf(v) for v in x)
        return x

    # Its outputs' bytes, from the function on meta (cached by signature, as an op's); what its
    # graph saves for the backward is not counted (docs/sharing.md).
    asked = ex.sizing.op_bytes(f"rt::fn:{name}", fn, a, k)
    if asked:
        ex.admit(session, asked)
    a = [leaf(x) for x in a]
    k = {key: leaf(v) for key, v in k.items()}
    # On CUDA this runs inside the executor's ``torch.cuda.stream(<the session's stream>)``: the
    # graph's nodes record that stream, which rt::backward's kernels then run on.
    with torch.set_grad_enabled(bool(leaves)):
        out = fn(*a, **k)
    flat = list(out) if isinstance(out, tuple) else [out]
    if len(flat) != len(outs) or not all(isinstance(o, torch.Tensor) for o in flat):
        raise ProtocolError("rt::fn outs do not match the function's results")
    for o, h in zip(flat, outs):
        session.handles.put(h, o.detach())
    if leaves and graph_id:
        session.add_graph(graph_id, (leaves, flat))
    return None


def _backward(ex: PseudoRunner, session: Session, decoder: ArgDecoder, args: Any, outs: Any) -> Any:
    """``rt::backward``: gradients of a kept graph's leaves, given its outputs' gradients."""
    torch = ex.torch
    if len(args) != 2 or type(args[0]) is not int or type(args[1]) is not list:
        raise ProtocolError("rt::backward takes [graph id, output grads]")
    if type(outs) is not list:
        raise ProtocolError("rt::backward outs must be a list")
    ident = args[0]
    refusal = whole_op_refusal(ex.device.type)
    if refusal is not None:
        raise OpError(f"rt::backward: {refusal}")
    graph = session.take_graph(ident)
    leaves, outputs = graph
    # One gradient per leaf, of its size: checked before any is made. If refused, the graph is
    # used up when the op fails, put back when it waits to run again.
    block = ex.memory.block_bytes
    asked = sum(allocator_bytes(x.numel() * x.element_size(), block) for x in leaves)
    if asked:
        ex.admit(session, asked, undo=lambda: session.graphs.setdefault(ident, graph))
    grads = decoder.decode_args(args[1])
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    # Streams (CUDA): a session runs every batch on its one stream, made current around the batch
    # (Executor._batch), so the forward's nodes (rt::fn), the output gradients given here and this
    # call all share it. The engine runs each backward node on its forward's stream, syncs the
    # given gradients onto it, and before returning makes the caller's current stream wait for
    # the streams the captured gradients were made on (GraphTask::exec_post_processing; the
    # zeros of materialize_grads are made here, on it): the results are ready on the session's
    # stream, where its next ops read them, with no synchronization of the device. This needs
    # CUDA to be the process's accelerator (whole_op_refusal).
    result = torch.autograd.grad(
        [o for o, _ in pairs],
        leaves,
        [g for _, g in pairs],
        allow_unused=True,
        materialize_grads=True,
    )
    wanted = [h for h in outs if h is not None]
    if len(wanted) != len(result):
        raise ProtocolError("rt::backward outs do not match the graph's inputs")
    for h, g in zip(wanted, result):
        session.handles.put(h, g.contiguous())
    return None


def whole_op_refusal(device_type: str) -> str | None:
    """Why autograd on a device of ``device_type`` cannot run in this process, or None.

    PyTorch's autograd engine takes the streams of CUDA nodes only when CUDA is the process's
    accelerator; a registered PrivateUse1 backend (the ``remote`` device of a forwarding client
    in the same process) takes that place, and every CUDA backward then fails with an internal
    assert (pytorch/pytorch#161129). `gpu-trace serve` keeps it free
    (:func:`gpu_trace.runtime.serving_process`); a server sharing its process with a client
    does not.
    """
    if device_type != "cuda":
        return None
    import torch

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type == "cuda":
        return None
    return (
        f"PyTorch cannot run CUDA autograd in a process where the {accelerator.type!r} backend"
        " is registered (it is the process's accelerator, and CUDA autograd nodes get no stream):"
        " run the server in its own process (gpu-trace serve), not beside a forwarding client"
    )


def seed_device(torch: Any, device: Any, seed: int) -> None:
    # Not torch.manual_seed: in a process that is also a forwarding client, that would seed the
    # remote device too, from inside the server.
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def rng_state(torch: Any, device: Any) -> Any:
    if device.type == "cuda":
        return (torch.get_rng_state(), torch.cuda.get_rng_state(device))
    return (torch.get_rng_state(), None)


def set_rng_state(torch: Any, device: Any, state: Any) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
