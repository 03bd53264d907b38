"""A template's compiled call: what the executor runs for each call of a prepared template.

Most of a training step's ops reach the server as template calls (:mod:`gpu_trace.runtime.
protocol.templates`): a template id and handle numbers. Everything about such a call but its
tensors is fixed by the template, so it is worked out once, when the template is first used
(:meth:`Executor._prepare <gpu_trace.runtime.server.executor.Executor._prepare>`): the op's
C++ callable, its bounds rule, its constants decoded, which argument slot each handle fills,
where its output goes. :meth:`Plan.run` is then one Python call per op that does what the general
path does through several (``_top``, ``_run_op``, the handle table's ``put``, the account's
``charge``), in the same order and with the same checks:

1. the call's tensors, by handle, from the session's own table (an unknown handle: the table's
   error);
2. the op's rule (:mod:`gpu_trace.runtime.server.bounds`), the plain bound on size arguments;
3. what the op will allocate (by its tensors' signatures, cached per template) and the memory
   check before it runs (:meth:`Executor.admit`);
4. the op;
5. its output's handle, and the account: a view of a storage the session already holds only
   counts one more reference, as :meth:`MemoryAccount.charge
   <gpu_trace.runtime.sharing.sessions.MemoryAccount.charge>` does; a new storage goes through
   ``charge`` (and so the tenant's sums);
6. the check after the op, when the account grew (:meth:`Executor._admit_output`).

Calls that are not of this common shape (an op that draws random numbers, several or nested
outputs, a result that is not a tensor) take the general path
(:meth:`Executor._top <gpu_trace.runtime.server.executor.Executor._top>`) with the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.sharing.sessions import MAX_HANDLES, HandleTable

if TYPE_CHECKING:
    import torch

    from gpu_trace.runtime.server.sizing import Sizing
    from gpu_trace.runtime.sharing.memory import Memory
    from gpu_trace.runtime.sharing.sessions import Session

#: What the executor knows of an ATen op (``_entry`` in runtime/server/op_runner.py): its callable, its rule, whether
#: it takes sizes, may run again, draws random numbers, and how it is sized.
Entry = tuple[
    Callable[..., object],
    Callable[[list[object], dict[str, object]], None] | None,
    bool,
    bool,
    bool,
    object,
]

#: Most sizes one template keeps (by its tensors' signatures); past it, it starts over.
MAX_TEMPLATE_SIZES = 64

#: Ops that never allocate a storage: views of an input (their result shares its storage) and
#: in-place pointwise ops (their result is their input, which they never resize). What they
#: would allocate is 0 whatever their arguments, so their calls skip the signature and its
#: lookup (about 0.4 µs a tensor); the check after the op (the account grew?) still applies.
#: Ops that may copy (``reshape``, ``contiguous``, ``to``) or resize (``resize_``, ``set_``,
#: ``out=`` forms) are not here. tests/unit/test_executor_plan.py holds each to it.
NO_ALLOC = frozenset(
    {
        "aten::t.default",
        "aten::detach.default",
        "aten::view.default",
        "aten::view.dtype",
        "aten::alias.default",
        "aten::_reshape_alias.default",
        "aten::expand.default",
        "aten::permute.default",
        "aten::transpose.int",
        "aten::unsqueeze.default",
        "aten::squeeze.default",
        "aten::squeeze.dim",
        "aten::squeeze.dims",
        "aten::select.int",
        "aten::slice.Tensor",
        "aten::diagonal.default",
        "aten::as_strided.default",
        "aten::unfold.default",
        "aten::view_as_real.default",
        "aten::view_as_complex.default",
        "aten::add_.Tensor",
        "aten::add_.Scalar",
        "aten::sub_.Tensor",
        "aten::sub_.Scalar",
        "aten::mul_.Tensor",
        "aten::mul_.Scalar",
        "aten::div_.Tensor",
        "aten::div_.Scalar",
        "aten::addcmul_.default",
        "aten::addcdiv_.default",
        "aten::lerp_.Scalar",
        "aten::lerp_.Tensor",
        "aten::zero_.default",
        "aten::fill_.Scalar",
        "aten::copy_.default",
        "aten::sqrt_.default",
        "aten::neg_.default",
        "aten::relu_.default",
        "aten::clamp_.default",
        "aten::clamp_min_.default",
    }
)

#: :attr:`Plan.out` of an op whose one result is not kept (an in-place op's: its input).
DROP = 1 << 62
#: :attr:`Plan.out` of an op whose result is no tensor kept (``outs`` null: ``.item()``, a
#: ``_foreach_`` op's nothing): it goes back as a value, if any.
VALUE = -2

#: Largest tensor a size argument may ask for: a plain byte bound, checked before sizing.
MAX_FACTORY_BYTES = 64 << 30

#: ``torch.Tensor``, set when the first plan is made (torch loads lazily).
_Tensor: type[torch.Tensor]


class Plan:
    """A prepared template: its op's entry unpacked and its constant arguments decoded.

    ``holes``: ``(position, hole)`` of each top-level tensor argument; ``lists``: ``(position,
    holes)`` of each argument that is a list of tensors; ``outs``: the template's outs (hole
    indices); ``sized``: why its size arguments are beyond the plain bound (None: they are
    not); ``size``: how the op is sized (:func:`~gpu_trace.runtime.server.sizing.sizer`; None:
    it allocates nothing, see :data:`NO_ALLOC`); ``sizes``: what it allocates, by its tensors'
    signatures (None: sized per call). ``out``: the hole of its one output when it takes the
    fast path (:meth:`run`), :data:`DROP` for one result not kept, :data:`VALUE` for none kept
    (a value goes back), else -1.
    """

    __slots__ = (
        "entry",
        "call",
        "rule",
        "sized",
        "rerunnable",
        "seeded",
        "size",
        "args",
        "holes",
        "lists",
        "inputs",
        "kwargs",
        "outs",
        "sizes",
        "out",
        "base",
    )

    def __init__(
        self,
        name: str,
        entry: Entry,
        args: list[object],
        holes: list[tuple[int, int]],
        kwargs: dict[str, object],
        outs: list[int | None] | None,
        lists: tuple[tuple[int, tuple[int, ...]], ...] = (),
    ) -> None:
        global _Tensor
        if "_Tensor" not in globals():
            import torch

            _Tensor = torch.Tensor
        self.entry = entry
        self.call, self.rule, sized, self.rerunnable, self.seeded, self.size = entry
        #: Why its size arguments are refused (None: they are not, or it takes none). They are
        #: constants of the template (its holes are tensors), so the bound is checked once.
        self.sized: str | None = None
        if sized:
            try:
                check_sizes(args, kwargs)
            except OpError as exc:
                self.sized = str(exc)
        #: The hole of the argument whose storage its result shares (-1: none known).
        self.base = -1
        if name in NO_ALLOC:
            self.size = None
            if holes and holes[0][0] == 0:
                self.base = holes[0][1]
        self.args = args
        self.holes = tuple(holes)
        self.lists = lists
        #: Every hole that names an argument, top level or in a list (not the outputs).
        self.inputs = (*(hole for _, hole in holes), *(h for _, hs in lists for h in hs))
        self.kwargs = kwargs
        self.outs = outs
        # Its sizes by its tensors' signatures (its constants are its own): no key of them all.
        self.sizes: dict[tuple[object, ...], int] | None = {} if type(self.size) is str else None
        self.out = -1
        if self.seeded:
            pass  # a re-run must draw the same numbers: the general path keeps the generator
        elif outs is None:
            self.out = VALUE
        elif len(outs) == 1:
            out = outs[0]
            self.out = out if type(out) is int else DROP if out is None else -1

    def run(self, c: Calls, vals: list[int]) -> object:
        """One call, with the call's handle numbers ``vals`` (the fast path: ``out != -1``)."""
        tensors = c.tensors
        a = self.args.copy()
        sizes = self.sizes
        if sizes is None:
            for pos, hole in self.holes:
                x = tensors.get(vals[hole])
                a[pos] = x if x is not None else c.handles.get(vals[hole])
            key: tuple[object, ...] = ()
        else:
            sig = []
            for pos, hole in self.holes:
                x = tensors.get(vals[hole])
                if x is None:
                    x = c.handles.get(vals[hole])  # raises: the table's message
                a[pos] = x
                sig.append((x.dtype, x.shape, x.stride(), x.storage_offset()))
            key = tuple(sig)
        if self.lists:  # lists of tensors (``_foreach_`` ops, ``cat``)
            for pos, hs in self.lists:
                xs = []
                for hole in hs:
                    x = tensors.get(vals[hole])
                    xs.append(x if x is not None else c.handles.get(vals[hole]))
                a[pos] = xs
                if sizes is not None:
                    key = (*key, *[(x.dtype, x.shape, x.stride(), x.storage_offset()) for x in xs])
        account = c.account
        before = account.bytes
        kwargs = self.kwargs
        rule = self.rule
        if rule is not None:
            if kwargs:
                kwargs = kwargs.copy()  # a rule may change its arguments in place
            rule(a, kwargs)
        if self.sized is not None:  # its size arguments are constants: checked once
            raise OpError(self.sized)
        checked = 0  # bytes the memory check let it allocate with room to spare
        held = None
        size = self.size
        if size is not None:  # what it will allocate, checked before it does
            known = None if sizes is None else sizes.get(key)
            if known is not None:
                asked = known
            else:
                asked = c.ex.sizing.op_bytes(size, self.call, a, kwargs)
                if sizes is not None:
                    if len(sizes) >= MAX_TEMPLATE_SIZES:
                        sizes.clear()
                    sizes[key] = asked
            if asked:
                tm, memory = c.tm, c.memory
                if (
                    tm is not None
                    and (tm.limit_bytes is None or tm.used_bytes + asked <= tm.limit_bytes)
                    and memory.used_bytes + asked <= memory.capacity_bytes
                ):
                    checked = asked  # Memory.refusal's first answer: it fits, all counted
                else:
                    c.ex.admit(c.session, asked, c.ex._blobs_taken)
                if not self.rerunnable:  # it may grow its inputs' storages in place
                    held = held_storages(c.handles, [vals[hole] for hole in self.inputs])
        result = self.call(*a, **kwargs) if kwargs else self.call(*a)
        if held is not None:
            recount(c.handles, held)
        out = self.out
        if out == VALUE:
            outs: list[int | None] | None = None
            value = c.ex._assign(c.session, result, None)
        elif out == DROP:  # an in-place op's result: its input, kept by its own handle
            value = None
            outs = [None]
            if type(result) is not _Tensor and not isinstance(result, _Tensor):
                value = c.ex._assign(c.session, result, outs)
        else:
            h = vals[out]
            outs = [h]
            if type(result) is not _Tensor and not isinstance(result, _Tensor):
                value = c.ex._assign(c.session, result, outs)
            else:
                value = None
                if h <= 0 or h in tensors or len(tensors) >= MAX_HANDLES:
                    c.handles.put(h, result)  # raises: the table's message
                # Its storage: its first argument's for an op that allocates nothing (its key
                # is known), else the result's own.
                base = c.keys.get(vals[self.base]) if self.base >= 0 else None
                entry = None if base is None else c.storages.get(base)
                if entry is not None and base is not None:
                    skey = base
                else:
                    storage = result.untyped_storage()
                    skey = storage.data_ptr() or id(storage)
                    entry = c.storages.get(skey)
                    if entry is None:  # a new storage: counted as charge() counts it
                        n = storage.nbytes()
                        block = account.block_bytes
                        if block > 1 and n:
                            n = -(-n // block) * block
                        entry = c.storages[skey] = [n, 0]
                        account.bytes += n
                        if account.bytes > account.peak_bytes:
                            account.peak_bytes = account.bytes
                        if account.on_change is not None:  # the tenant's sums
                            account.on_change(account)
                entry[1] += 1
                tensors[h] = result
                c.keys[h] = skey
        # Grown by no more than the check let it: still within both limits, as Memory.over
        # would say. Else (a kernel's own allocation, a size bound not checked here) ask it.
        grown = account.bytes - before
        if grown > checked and c.memory.over(c.session):
            c.ex._admit_output(c.session, before, outs, self.rerunnable, None)
        return value


class PlanRunner(Protocol):
    """What a plan's calls read of the executor that runs them, and the checks they ask of it
    (:class:`~gpu_trace.runtime.server.executor.Executor`)."""

    memory: Memory
    sizing: Sizing
    _blobs_taken: int

    def admit(self, session: Session, nbytes: int, taken: int | None = None) -> None: ...

    def _assign(
        self, session: Session, result: object, outs: list[int | None] | None
    ) -> object: ...

    def _admit_output(
        self,
        session: Session,
        before: int,
        outs: list[int | None] | None,
        rerunnable: bool,
        rng: object,
    ) -> None: ...


class Calls:
    """What :meth:`Plan.run` reads of one session, gathered once per batch."""

    __slots__ = (
        "ex",
        "session",
        "handles",
        "tensors",
        "keys",
        "account",
        "storages",
        "memory",
        "tm",
    )

    def __init__(self, ex: PlanRunner, session: Session) -> None:
        self.ex = ex
        self.session = session
        self.handles = handles = session.handles
        self.tensors = handles._tensors
        self.keys = handles._keys
        self.account = account = session.account
        self.storages = account._storages
        self.memory = memory = ex.memory
        # The tenant's sums (None: not attached; Memory.refusal lets it allocate then too, and
        # every check goes to Executor.admit).
        self.tm = memory.tenants.get(session.tenant.name)


def held_storages(handles: HandleTable, idents: list[int]) -> list[tuple[int, int, int]]:
    """``(handle, data pointer, bytes)`` of the storages of ``idents`` (handles an op takes),
    before an op that may grow them in place: see :func:`recount`."""
    out = []
    for ident in idents:
        tensor = handles._tensors.get(ident)
        if tensor is not None:
            storage = tensor.untyped_storage()
            out.append((ident, storage.data_ptr(), storage.nbytes()))
    return out


def recount(handles: HandleTable, held: list[tuple[int, int, int]]) -> None:
    """After an op that could grow its arguments' storages (its sizing counted the growth, and
    it writes its inputs: ``resize_``, ``out=``): count again those that grew or moved. The
    account keys storages as they were when their handles were made; without this a grown
    storage stayed counted at its old size, and a tenant could grow storages past its quota
    one checked op at a time."""
    for ident, ptr, nbytes in held:
        tensor = handles._tensors.get(ident)
        if tensor is not None:
            storage = tensor.untyped_storage()
            if storage.nbytes() != nbytes or storage.data_ptr() != ptr:
                handles.regrown(ident)


def check_sizes(args: list[object], kwargs: dict[str, object]) -> None:
    """Refuse factory sizes beyond any device's memory before allocating (a cheap bound)."""
    for value in (*args, *kwargs.values()):
        if (
            type(value) is list
            and value
            and len(value) <= 16
            and all(type(v) is int for v in value)
        ):
            numel = 1
            for v in value:
                numel *= max(v, 0)
            if numel * 8 > MAX_FACTORY_BYTES:
                raise OpError(f"a size of {value} elements is beyond the server's limit")
