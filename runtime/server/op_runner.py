"""Running one op of a session's batch, on the executor's thread: an ATen op resolved against
the allow-list (its facts worked out once per name: :func:`_entry`), a JSON op's arguments decoded,
a template's call run compiled (:mod:`gpu_trace.runtime.server.plan`, which calls back into
:meth:`OpRunner.admit`, :meth:`OpRunner._assign` and :meth:`OpRunner._admit_output`), the
runtime's own ``rt::`` ops (:mod:`gpu_trace.runtime.server.pseudo_ops`), and the op's outputs
kept under the handles the client named. :class:`~gpu_trace.runtime.server.executor.Executor`
is an :class:`OpRunner`, and runs the batches around the ops.

Memory (:mod:`gpu_trace.runtime.sharing.memory`): every op is checked against its tenant's quota and
the device's capacity before it runs, by the bytes it will allocate as the server works them out
(:mod:`gpu_trace.runtime.server.sizing`: the op on meta tensors, cached by signature, with its
parts' temporaries for an op that decomposes into others; or a bound for ops whose size depends on
data), never by what the client claims; uploads by their size, the runtime's ``rt::`` ops by
their own bounds. After the op its session's account is the exact book-keeping; an op that still
grew it past a limit (by what a kernel allocates inside itself, the one thing not bounded) has
its outputs freed and is refused. A refused op fails with a
:class:`~gpu_trace.runtime.sharing.memory.QuotaError`, or, for a tenant whose ``on_quota`` is
``wait``, its batch is parked at that op (its progress kept in ``Work.resume``, a
:class:`~gpu_trace.runtime.sharing.scheduler.Parked`) while other sessions run, and the op runs
when memory is freed. The executor never blocks on memory. On CUDA each session
runs on its own stream, and its device time is read from CUDA events recorded around its
batches, later, without synchronizing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.protocol.templates import Template, has_hole
from gpu_trace.runtime.protocol.values import ArgDecoder, encode_result
from gpu_trace.runtime.protocol.wire import ProtocolError
from gpu_trace.runtime.server import allowlist
from gpu_trace.runtime.server.plan import (
    MAX_TEMPLATE_SIZES,
    Plan,
    check_sizes,
    held_storages,
    recount,
)
from gpu_trace.runtime.server.pseudo_ops import rng_state, run_pseudo, seed_device, set_rng_state
from gpu_trace.runtime.server.sizing import Sizing, sizer
from gpu_trace.runtime.sharing.memory import Memory, QuotaError, Refusal
from gpu_trace.runtime.sharing.sessions import Session

if TYPE_CHECKING:
    import torch

__all__ = ["Refused", "OpRunner"]


class Refused(Exception):
    """An op may not allocate now; the batch fails it or waits (the tenant's ``on_quota``).

    ``rerun``: the op did not run, or ran without changing anything but its freed outputs, so
    it may run again. ``blobs``: the ``(id, tensor)`` of uploads its arguments took; if it is to
    run again they are put back (:meth:`OpRunner._put_back`), else they are used up. ``undo``:
    called too when it is to run again (an ``rt::backward`` puts its graph back).
    """

    def __init__(
        self, refusal: Refusal, rerun: bool = True, blobs: Any = (), undo: Any = None
    ) -> None:
        self.refusal = refusal
        self.rerun = rerun
        self.blobs = blobs
        self.undo = undo


class OpRunner:
    """Runs the ops of sessions' batches on ``device``, each checked against ``memory`` (see
    the module's docstring)."""

    def __init__(self, device: str, memory: Memory) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        #: Device memory by tenant; a server passes its own (``Server.memory``).
        self.memory = memory
        #: What ops will allocate, worked out before they run
        #: (:mod:`gpu_trace.runtime.server.sizing`).
        self.sizing = Sizing(memory.block_bytes)
        self._cuda = self.device.type == "cuda"
        self._ops: dict[str, tuple[Any, Any, bool, bool, bool, Any]] = {}
        #: The session whose random stream the device's generator holds now.
        self._rng_owner: Session | None = None
        #: More ``rt::`` ops by name, each called with the session and the op's arguments (a
        #: worker's test probes; empty in a server).
        self.extra_ops: dict[str, Callable[[Session, list[object]], object]] = {}
        self._refused: dict[int, dict[int, QuotaError]] = {}  # session id -> refused uploads
        self._blobs_taken = 0
        # uploads the current JSON op's arguments took
        self._taken: list[tuple[int, torch.Tensor]] = []

    def _decoder(self, session: Session) -> ArgDecoder:
        """The decoder of ``session``'s JSON ops (its handles and uploads)."""
        return ArgDecoder(session.handles.get, self._blob_taker(session), self.device)

    def _op(self, session: Session, decoder: ArgDecoder, op: Any) -> Any:
        if type(op) is not list or len(op) != 4:
            raise ProtocolError("an op is [name, args, kwargs, outs]")
        name, args, kwargs, outs = op
        account = session.account
        before = account.bytes
        if self._taken:
            self._taken.clear()
        entry = self._ops.get(name)
        if entry is None:
            if type(name) is not str:
                raise ProtocolError("op name must be a string")
            if name.startswith("rt::"):
                value = run_pseudo(self, session, decoder, name, args, outs)
                if account.bytes > before and self.memory.over(session):
                    self._admit_output(session, before, outs, False, None)
                return value
            entry = self._resolve(name)
        if type(args) is not list:
            raise ProtocolError("op args must be a list")
        taken = self._blobs_taken
        a = decoder.decode_args(args)
        k = decoder.decode_kwargs(kwargs) if kwargs else {}
        idents = _idents(args, kwargs if k else {})  # kwargs: an object, as decoded
        return self._run_op(session, entry, a, k, outs, before, taken, idents=idents)

    def _resolve(self, name: str) -> tuple[Any, Any, bool, bool, bool, Any]:
        """An allow-listed ATen op's entry (see :func:`_entry`), made once per name."""
        entry = self._ops.get(name)
        if entry is None:
            target = allowlist.resolve(name)
            if target is None:
                raise OpError(allowlist.refusal(name))
            entry = self._ops[name] = _entry(target)
        return entry

    def _top(self, session: Session, plan: Plan, vals: list[int]) -> Any:
        """A template call (``plan``: the template's decoded form, see :meth:`_prepare`) that
        is not of :meth:`Plan.run`'s shape: its tensors looked up by the call's handle numbers
        ``vals``, put in the decoded constants."""
        before = session.account.bytes
        taken = self._blobs_taken
        a = list(plan.args)
        get = session.handles.get
        key = []
        for pos, hole in plan.holes:
            x = a[pos] = get(vals[hole])
            key.append((x.dtype, x.shape, x.stride(), x.storage_offset()))
        for pos, hs in plan.lists:
            xs = a[pos] = [get(vals[hole]) for hole in hs]
            key += [(x.dtype, x.shape, x.stride(), x.storage_offset()) for x in xs]
        outs = plan.outs
        filled = None if outs is None else [_filled(h, vals) for h in outs]
        return self._run_op(
            session,
            plan.entry,
            a,
            dict(plan.kwargs) if plan.kwargs else {},
            filled,
            before,
            taken,
            plan.sizes,
            tuple(key),
            [vals[hole] for hole in plan.inputs],
        )

    def _prepare(self, t: Template) -> Plan | bool:
        """A template's decoded form (:class:`~gpu_trace.runtime.server.plan.Plan`): its op's
        entry, its constants decoded, the ``(position, hole)`` of each top-level tensor; False
        where tensors are nested in arguments, or it names a runtime op (such templates are
        filled in per call)."""
        if t.name.startswith("rt::") or type(t.outs) not in (list, type(None)):
            return False
        if t.outs is not None and not all(_out_hole(o) for o in t.outs):
            return False
        entry = self._resolve(t.name)

        def constant(ident: int) -> Any:
            raise ProtocolError("a template's constants cannot name tensors")

        decoder = ArgDecoder(constant, constant, self.device)
        args: list[Any] = []
        holes: list[tuple[int, int]] = []
        lists: list[tuple[int, tuple[int, ...]]] = []
        for pos, v in enumerate(t.args):
            if type(v) is dict and len(v) == 1 and "xh" in v:
                holes.append((pos, v["xh"]))
                args.append(None)
            elif type(v) is list and v and all(_is_hole(x) for x in v):  # a list of tensors
                lists.append((pos, tuple(x["xh"] for x in v)))
                args.append(None)
            elif has_hole(v):
                return False
            else:
                args.append(decoder.decode(v, 1))
        if has_hole(t.kwargs):
            return False
        kwargs = decoder.decode_kwargs(t.kwargs) if t.kwargs else {}
        return Plan(t.name, entry, args, holes, kwargs, t.outs, tuple(lists))

    def _run_op(
        self,
        session: Session,
        entry: tuple[Any, Any, bool, bool, bool, Any],
        a: list[Any],
        k: dict[str, Any],
        outs: Any,
        before: int,
        taken: int,
        sizes: dict[Any, int] | None = None,
        key: Any = None,
        idents: list[int] | None = None,
    ) -> Any:
        """Run a decoded op: its rules and memory checks, the op, its outputs' handles.

        ``sizes``: a template's own sizes by ``key``, its tensors' signatures (see :meth:`_top`).
        ``idents``: the handles it takes (their storages are counted again after an op that may
        grow them in place: :func:`~gpu_trace.runtime.server.plan.recount`).
        """
        target, rule, sized, rerunnable, seeded, size = entry
        account = session.account
        held = None
        if rule is not None:
            rule(a, k)
        if sized:
            check_sizes(a, k)
        if size is not None:  # what it will allocate, checked before it does
            asked: int | None
            if sizes is None:
                asked = self.sizing.op_bytes(size, target, a, k)
            else:
                asked = sizes.get(key)
                if asked is None:
                    asked = self.sizing.op_bytes(size, target, a, k)
                    if len(sizes) >= MAX_TEMPLATE_SIZES:
                        sizes.clear()
                    sizes[key] = asked
            if asked:
                self.admit(session, asked, taken)
                if not rerunnable and idents:  # it may grow its inputs' storages in place
                    held = held_storages(session.handles, idents)
        rng = None
        if seeded and session.tenant.on_quota == "wait":
            rng = rng_state(self.torch, self.device)  # a re-run must draw the same numbers
        result = target(*a, **k)
        if held is not None:
            recount(session.handles, held)
        if type(outs) is list and len(outs) == 1 and isinstance(result, self.torch.Tensor):
            h = outs[0]  # one tensor result: most ops
            if h is not None:
                session.handles.put(h, result)
            value = None
        else:
            value = self._assign(session, result, outs)
        if account.bytes > before and self.memory.over(session):
            self._admit_output(
                session, before, outs, rerunnable and self._blobs_taken == taken, rng
            )
        return value

    def _assign(self, session: Session, result: Any, outs: Any) -> Any:
        torch = self.torch
        if outs is None:
            return encode_result(_scalar(result))
        if type(outs) is not list:
            raise ProtocolError("op outs must be a list or null")
        values = result if isinstance(result, tuple) else (result,)
        if len(outs) != len(values):
            raise ProtocolError("op outs do not match the op's results")
        meta: list[Any] = []
        for value, spec in zip(values, outs):
            if isinstance(value, torch.Tensor):
                if spec is not None:
                    session.handles.put(spec, value)
                meta.append(None)
            elif isinstance(value, (list, tuple)) and all(
                isinstance(v, torch.Tensor) for v in value
            ):
                if type(spec) is not list or len(spec) != len(value):
                    raise ProtocolError("op outs do not match a list of results")
                for v, h in zip(value, spec):
                    if h is not None:
                        session.handles.put(h, v)
                meta.append(None)
            elif spec is not None:  # a handle for what is not a tensor
                raise ProtocolError("op outs do not match the op's results")
            else:
                meta.append(encode_result(_scalar(value)))
        return None if all(m is None for m in meta) else meta

    def _admit_output(
        self, session: Session, before: int, outs: Any, rerunnable: bool, rng: Any
    ) -> None:
        """An op's outputs took ``session`` from ``before`` bytes to more: keep them, or free
        them and refuse the op (it fails, or waits and runs again)."""
        grown = session.account.bytes - before
        refusal = self.memory.refusal(session, grown, held=grown)
        if refusal is None:
            return
        if session.tenant.on_quota == "wait" and not rerunnable and not refusal.hopeless:
            # It changed its inputs or used an upload, so it cannot run twice: its outputs stay,
            # and the tenant's next allocations wait until it is back under its quota.
            return
        for handle in _handles(outs):
            session.handles.free(handle)
        if rng is not None:
            set_rng_state(self.torch, self.device, rng)
        raise Refused(refusal, rerun=rerunnable)

    # ---- memory ----------------------------------------------------------------------------------

    def admit(
        self, session: Session, nbytes: int, taken: int | None = None, undo: Any = None
    ) -> None:
        """May an op of ``session`` allocate ``nbytes`` now? If not it does not run: it is
        refused (it fails, or its batch waits and it runs later; see :meth:`_batch`).

        ``taken``: the count of uploads taken when the op's arguments began to be decoded (None:
        when its JSON op began); those taken since go back if it is to run later, and ``undo()``
        is called then.
        """
        refusal = self.memory.refusal(session, nbytes)
        if refusal is not None:
            blobs = self._taken
            n = len(blobs) if taken is None else min(self._blobs_taken - taken, len(blobs))
            raise Refused(refusal, blobs=blobs[len(blobs) - n :] if n > 0 else (), undo=undo)

    def _put_back(self, session: Session, refused: Refused) -> None:
        """What a refused op took (uploads: counted again), back for when it runs again."""
        for ident, tensor in refused.blobs:
            session.blobs.add(ident, tensor, tensor.untyped_storage().nbytes())
        if refused.undo is not None:
            refused.undo()

    def _blob_taker(self, session: Session) -> Callable[[int], torch.Tensor]:
        take = session.blobs.take
        refused = self._refused.get(session.id)

        def taker(ident: int) -> torch.Tensor:
            self._blobs_taken += 1
            if refused is not None and ident in refused:
                raise refused.pop(ident)
            tensor = take(ident)
            self._taken.append((ident, tensor))
            return tensor

        return taker

    # ---- the random stream -----------------------------------------------------------------------

    def _switch_rng(self, session: Session) -> None:
        if self._rng_owner is session:
            return
        torch = self.torch
        previous = self._rng_owner
        if previous is not None and not previous.closed:
            previous.rng_state = rng_state(torch, self.device)
        if session.rng_state is not None:
            set_rng_state(torch, self.device, session.rng_state)
        elif session.seed is not None:
            seed_device(torch, self.device, session.seed)
        self._rng_owner = session


def _scalar(value: Any) -> Any:
    torch = __import__("torch")
    if isinstance(value, torch.Tensor):
        raise OpError("a tensor result needs an output handle")
    return value


def _entry(target: Any) -> tuple[Any, Any, bool, bool, bool, Any]:
    """What the executor needs to know of an ATen op, worked out once per op name.

    ``sized``: it takes a size argument (checked against a plain bound first). ``rerunnable``:
    it changes none of its inputs, so it may run again after its outputs were refused.
    ``seeded``: it draws random numbers (a re-run restores the generator first). ``size``: how
    :class:`~gpu_trace.runtime.server.sizing.Sizing` works out what it allocates (None: it returns
    no tensor).
    """
    import torch

    schema = target._schema
    arguments = schema.arguments
    sized = any(a.name in ("size", "sizes") for a in arguments)
    rerunnable = "batch_norm" not in schema.name and not any(  # batch norm's running stats
        a.alias_info is not None and a.alias_info.is_write for a in arguments
    )
    seeded = torch.Tag.nondeterministic_seeded in target.tags
    # The overload's own C++ callable: calling the OpOverload adds a Python frame per op.
    call = getattr(target, "_op", target)
    return call, allowlist.rule(target), sized, rerunnable, seeded, sizer(target)


def _out_hole(o: object) -> bool:
    """An output of a template a plan takes: a hole, none, or a list of them (a list result:
    ``_foreach_sqrt``, ``split``)."""
    return o is None or type(o) is int or type(o) is list and all(_out_hole(x) for x in o)


def _filled(out: object, vals: list[int]) -> object:
    """A template's output hole filled with its call's handle number (lists: each)."""
    if type(out) is int:
        return vals[out]
    if type(out) is list:
        return [_filled(o, vals) for o in out]
    return None


def _is_hole(v: object) -> bool:
    """A template's tensor hole, ``{"xh": k}``."""
    return type(v) is dict and len(v) == 1 and "xh" in v


def _idents(args: list[object], kwargs: dict[str, object]) -> list[int]:
    """The handles a JSON op names as arguments, top level and keyword (``out=``)."""
    out = []
    for v in (*args, *kwargs.values()):
        if type(v) is dict and len(v) == 1 and type(v.get("h")) is int:
            out.append(v["h"])
    return out


def _handles(outs: Any) -> list[int]:
    """The handle numbers in an op's ``outs`` (nested lists, None for results not kept)."""
    if type(outs) is int:
        return [outs]
    if type(outs) is list:
        return [h for o in outs for h in _handles(o)]
    return []
