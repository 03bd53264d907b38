"""The server's bounds checks (runtime/server/bounds.py) and the allow-list they guard, held by a
fuzzer that throws random sizes, strides, offsets, dims and indices at every allow-listed op that
takes integers or returns an alias, and one hostile value at a time into the calls programs make
(tests/op_fuzz.py, tests/op_cases.py; ``python -m tests.op_fuzz`` for a longer run)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.server import allowlist, bounds
from tests import op_fuzz


def _run(name: str, args: list, kwargs: dict | None = None) -> torch.Tensor:
    """``name`` as the executor runs it: resolved, its rule applied, called."""
    op = allowlist.resolve(name)
    assert op is not None, f"{name} is not allowed"
    kwargs = kwargs or {}
    rule = allowlist.rule(op)
    if rule is not None:
        rule(args, kwargs)
    return op(*args, **kwargs)


@pytest.mark.parametrize(
    ("size", "stride", "offset", "why"),
    [
        ([131072], [1], None, "needs 524288 bytes of a 16-byte storage"),
        ([5], [1], None, "needs 20 bytes of a 16-byte storage"),
        ([2], [1], 3, "needs 20 bytes"),
        ([2, 2], [1 << 62, 1], None, "out of bounds"),  # exact: no int64 wrap-around
        ([3], [(1 << 63) - 1], 0, "out of bounds"),
        ([-1], [1], None, "negative"),
        ([2], [-1], None, "negative"),
        ([1], [1], -1, "negative"),
        ([2, 2], [1], None, "differ in length"),
        ([2.0], [1], None, "list of integers"),
        ([True], [1], None, "list of integers"),
        (None, [1], None, "list of integers"),
        ([1], [1], 1.5, "offset must be an integer"),
    ],
)
def test_views_out_of_bounds_or_malformed_are_refused(
    size: list, stride: list, offset: int | None, why: str
) -> None:
    base = torch.ones(4)
    with pytest.raises(OpError, match="as_strided") as info:
        bounds.check_view("as_strided", base, size, stride, offset)
    assert why in str(info.value)


@pytest.mark.parametrize(
    ("size", "stride", "offset"),
    [([4], [1], None), ([2, 2], [2, 1], 0), ([2], [1], 2), ([0], [1 << 62], 0), ([], [], 3)],
)
def test_views_inside_the_storage_pass(size: list, stride: list, offset: int | None) -> None:
    bounds.check_view("as_strided", torch.ones(4), size, stride, offset)


def test_a_view_is_measured_against_its_whole_storage_from_its_offset() -> None:
    base = torch.arange(8.0)[4:]  # storage of 8, offset 4
    bounds.check_view("_reshape_alias", base, [4], [1], None)
    with pytest.raises(OpError, match="needs 36 bytes of a 32-byte storage"):
        bounds.check_view("_reshape_alias", base, [5], [1], None)


@pytest.mark.parametrize(
    "name", ["aten::_reshape_alias.default", "aten::_reshape_alias_copy.default"]
)
def test_reshape_alias_past_its_storage_is_refused_before_it_runs(name: str) -> None:
    """The original finding: a [131072] view of a 4-element tensor (1 MiB of the server's heap
    cloned and fetched); the copy variant reads before any check afterwards could run."""
    x = torch.ones(4)
    with pytest.raises(OpError, match="out of bounds"):
        _run(name, [x, [131072], [1]])
    with pytest.raises(OpError, match="out of bounds"):
        _run(name, [torch.ones(0), [], []])  # one element of an empty storage
    assert torch.equal(_run(name, [x, [2, 2], [2, 1]]), torch.ones(2, 2))


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    [
        ("aten::view.dtype", [torch.ones(4), -1], {}),
        ("aten::view_copy.dtype", [torch.ones(4), -3], {}),
        ("aten::empty.memory_format", [[2, 2]], {"layout": 1}),
        ("aten::empty.memory_format", [[2]], {"dtype": 12}),
        ("aten::empty.memory_format", [[2]], {"memory_format": 7}),
        ("aten::to.dtype", [torch.ones(2), 7], {}),
        ("aten::sum.default", [torch.ones(2)], {"dtype": 4}),
    ],
)
def test_enum_arguments_as_bare_numbers_are_refused(name: str, args: list, kwargs: dict) -> None:
    """ATen takes any number for a dtype, layout or memory format: past its tables' end (view
    as dtype -1 read a divisor of 579019358875533311 from beyond one), sparse layouts and
    quantized dtypes the allow-list otherwise keeps out."""
    with pytest.raises(OpError, match="tagged value"):
        _run(name, args, kwargs)


def test_enum_arguments_as_torch_objects_pass() -> None:
    assert _run("aten::to.dtype", [torch.ones(2), torch.float64]).dtype == torch.float64
    out = _run("aten::empty.memory_format", [[2]], {"dtype": torch.int64, "layout": torch.strided})
    assert out.dtype == torch.int64
    assert _run("aten::sum.default", [torch.ones(2)], {"dtype": None}).item() == 2.0


def test_rules_by_name_and_overload_compose() -> None:
    """``_index_put_impl_``'s ``unsafe`` is still pinned to False (its name's rule)."""
    x = torch.zeros(3)
    with pytest.raises(IndexError, match="out of bounds"):
        _run(
            "aten::_index_put_impl_.default", [x, [torch.tensor([10])], torch.ones(1), False, True]
        )
    assert allowlist.rule(allowlist.resolve("aten::add.Tensor")) is None


def test_the_fuzzer_catches_what_it_is_for() -> None:
    """The fuzzer's own checks see a view past its storage, a canary written and one read."""
    specs = [("float32", [4], [1]), ("int64", [2], [3]), ("uint8", [], [0])]
    arena = op_fuzz.Arena.make(torch, specs)
    assert arena.canary_intact()
    wide = torch.ops.aten._reshape_alias.default(arena.tensors[0], [8], [1])
    assert "reach byte 32 of a 16-byte storage" in op_fuzz.outside_storage(wide)
    leaked = wide.clone()  # reads past the session tensor: the canary's bytes
    assert op_fuzz.outside_storage(leaked) is None and op_fuzz._reads_canary(
        torch, leaked, arena.canary
    )
    wide.fill_(0.0)
    assert not arena.canary_intact()


def test_no_allowed_op_reaches_outside_its_storages() -> None:
    """Every allow-listed op, six random examples each (three when every wire-carriable op was
    allowed: 2,551 then, about 490 now), in worker processes (a crash names the op and the
    example)."""
    ops = op_fuzz.fuzz_targets(every=True)
    assert len(ops) == len(allowlist.allowed()) and len(op_fuzz.fuzz_targets()) > 200
    report = op_fuzz.fuzz(ops, examples=6)
    problems = {**report.failures, **report.crashes}
    assert not problems, "\n".join(f"{op}: {why}" for op, why in sorted(problems.items()))
    assert report.done >= len(ops) - len(report.stuck)


def test_recorded_calls_with_one_hostile_value_stay_inside_their_storages() -> None:
    """Each allowed op the programs send, from its recorded call (tests/data/op_samples.json),
    with ONE index tensor, integer, list element or tensor made hostile (2**40, -1, int64's
    least, an exact bound, one row short, empty), in a worker process: nothing crashes, reads
    or writes outside its storages; and the op's rule lets the recorded call itself through.
    Random shapes rarely reach these kernels (convolution_backward with an empty gradient,
    native_batch_norm_backward with an empty save_mean, col2im with a padding of 2**40...)."""
    targets = [t for t in op_fuzz.structured_targets() if t.startswith("sample:")]
    assert len(targets) > 300
    report = op_fuzz.fuzz(targets, examples=0, structured=True)
    problems = {**report.failures, **report.crashes}
    assert not problems, "\n".join(f"{op}: {why}" for op, why in sorted(problems.items()))
    assert not report.stuck and report.done == len(targets)


def test_the_issues_crashing_and_cross_tenant_calls_are_refused() -> None:
    """Issue 25's calls, through the server's path in a worker process (a crash is a failure
    here, not a dead pytest): segment_reduce reading past its data, a max pool backward's
    grad_input written at any index, the max-pool and adaptive max-pool backwards with an index
    of 2**40, the three _embedding_bag backwards, segment_reduce and its backward,
    _ctc_loss with a target of 2**40, _pdist_backward with a short gradient, _cummax_helper,
    _native_multi_head_attention with no heads: each refused by the allow-list or a rule."""
    targets = [t for t in op_fuzz.structured_targets() if t.startswith("hostile:")]
    assert len(targets) >= 15
    report = op_fuzz.fuzz(targets, examples=0, structured=True)
    problems = {**report.failures, **report.crashes}
    assert not problems, "\n".join(f"{op}: {why}" for op, why in sorted(problems.items()))
    assert report.done == len(targets)


@pytest.mark.parametrize(
    "name",
    [
        "aten::__round_to_zero_floordiv.int",  # 0 // 0: SIGFPE, the whole server gone
        "aten::floordiv.int",
        "aten::manual_seed.default",  # process-wide switches
        "aten::set_grad_enabled.default",
        "aten::center.default",
    ],
)
def test_builtins_without_tensors_are_not_allowed(name: str) -> None:
    assert allowlist.resolve(name) is None


@pytest.mark.parametrize(
    "name",
    [
        "aten::_add_batch_dim.default",  # functorch's BatchedTensorImpl: storage-less
        "aten::_remove_batch_dim.default",  # corrupted the heap (munmap_chunk)
        "aten::_nnpack_spatial_convolution.default",  # 0-d inputs: SIGSEGV
        "aten::_slow_conv2d_backward.output_mask",  # 0-d inputs: SIGSEGV
        "aten::_stack.default",  # an empty list: SIGSEGV
        "aten::_transform_bias_rescale_qkv.default",  # 0 heads: SIGFPE
        "aten::fractional_max_pool2d_backward.default",  # 0-d inputs: SIGSEGV
        "aten::fractional_max_pool3d_backward.grad_input",
        "aten::to.prim_Device",  # to.prim_Device(t, None, None, False, True): SIGSEGV
        "aten::to.prim_dtype",
        "aten::_cholesky_solve_helper.out",  # SIGSEGV on mismatched shapes
        "aten::_convert_indices_from_coo_to_csr.default",  # indices used unchecked
        "aten::_new_zeros_with_same_feature_meta.default",  # negative batch dims
        "aten::_sobol_engine_initialize_state_.default",  # dimension past the state
        "aten::_chunk_cat.out",
        "aten::_dyn_quant_matmul_4bit.default",  # SIGFPE
        "aten::_batch_norm_no_update.out",  # out= forms of internals: SIGSEGV
        "aten::_pdist_backward.out",
        "aten::_fft_r2c.out",
        "aten::fbgemm_pack_gemm_matrix_fp16.default",  # SIGSEGV on an empty weight
        "aten::_saturate_weight_to_fp16.default",
        "aten::_thnn_differentiable_lstm_cell_backward.default",  # SIGSEGV on odd shapes
        "aten::_masked_softmax.default",  # mask_type unchecked: SIGSEGV
    ],
)
def test_internals_that_trust_their_arguments_are_denied(name: str) -> None:
    assert allowlist.resolve(name) is None


@pytest.mark.parametrize(
    ("name", "args", "why"),
    [
        ("aten::_fft_r2c.default", [torch.ones(3), [-(1 << 31) - 1], 0, False], "out of range"),
        ("aten::_fft_r2c.default", [torch.ones(3), [], 0, False], "out of range"),
        ("aten::_fft_r2c.default", [torch.ones(3), [-1], 0, True], "out of range"),
        ("aten::_fft_r2c.default", [torch.ones(3, 2), [1, 1], 0, False], "repeat"),
        ("aten::_fft_c2c.default", [torch.ones(3, dtype=torch.cfloat), [3], 0, True], "range"),
        ("aten::_fft_c2r.default", [torch.ones(3, dtype=torch.cfloat), [0], 0, 0], "positive"),
    ],
)
def test_fft_dims_are_checked(name: str, args: list, why: str) -> None:
    """What ``torch.fft`` calls: the dims index the input's sizes unchecked (SIGSEGV, or a
    size read from past the end)."""
    with pytest.raises(OpError, match=why):
        _run(name, args)


def test_fft_within_range_runs() -> None:
    x = torch.arange(4.0)
    assert torch.allclose(_run("aten::_fft_r2c.default", [x, [0], 0, True]), torch.fft.rfft(x))
    c = torch.fft.fft(x)
    assert torch.allclose(_run("aten::_fft_c2c.default", [c, [0], 2, False]), torch.fft.ifft(c))


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("aten::reflection_pad1d_backward.default", [torch.ones(()), torch.ones(()), []]),
        ("aten::reflection_pad2d_backward.default", [torch.ones(()), torch.ones(()), []]),
        ("aten::reflection_pad2d_backward.default", [torch.ones(2, 2), torch.ones(2, 2), [1]]),
        ("aten::replication_pad3d_backward.default", [torch.ones(3), torch.ones(3), [0] * 6]),
    ],
)
def test_pad_backwards_check_their_padding_and_dims(name: str, args: list) -> None:
    """What autograd of the pads sends; ATen reads the paddings and sizes unchecked (a 0-d
    input with no padding was a SIGSEGV)."""
    with pytest.raises(OpError, match="padding needs|dimensions"):
        _run(name, args)


def test_pad_backward_within_range_runs() -> None:
    x = torch.arange(6.0).view(1, 6).requires_grad_()
    y = torch.nn.functional.pad(x, (2, 1), mode="reflect")
    (expected,) = torch.autograd.grad(y.sum(), x)
    got = _run("aten::reflection_pad1d_backward.default", [torch.ones(1, 9), x.detach(), [2, 1]])
    assert torch.equal(got, expected)


def test_sparse_results_are_refused() -> None:
    """``sparse=True`` made sparse tensors, which the server keeps out."""
    idx = torch.tensor([0, 1])
    args = [torch.ones(2, 3), idx, 4, -1, False, True]
    with pytest.raises(OpError, match="sparse=True"):
        _run("aten::embedding_backward.default", args)
    args = [torch.ones(2), torch.ones(2), 0, idx, True]
    with pytest.raises(OpError, match="sparse_grad=True"):
        _run("aten::gather_backward.default", args)
    with pytest.raises(OpError, match="sparse_grad=True"):
        _run("aten::gather.default", [torch.ones(2), 0, idx], {"sparse_grad": True})
    args[-1] = False
    assert _run("aten::gather_backward.default", args).layout == torch.strided
    assert _run("aten::gather.default", [torch.ones(2), 0, idx], {"sparse_grad": False}).sum() == 2


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("aten::_weight_norm_interface.default", [torch.ones(0), torch.ones(0), 0]),
        ("aten::_weight_norm.default", [torch.ones(0), torch.ones(0), 0]),
        (
            "aten::_weight_norm_interface_backward.default",
            [torch.ones(0), torch.ones(0), torch.ones(0), torch.ones(0), 0],
        ),
    ],
)
def test_weight_norm_of_an_empty_weight_is_refused(name: str, args: list) -> None:
    """An empty weight divided by zero in the CPU kernel: SIGFPE, the server gone."""
    with pytest.raises(OpError, match="at least one dimension and one element"):
        _run(name, args)


def test_weight_norm_runs() -> None:
    v, g = torch.ones(2, 3), torch.full((2, 1), 2.0)
    w, _ = _run("aten::_weight_norm_interface.default", [v, g, 0])
    assert torch.allclose(w, torch._weight_norm(v, g, 0))


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize(
    "name", ["aten::embedding_dense_backward.default", "aten::embedding_backward.default"]
)
@pytest.mark.parametrize("bad", [1 << 40, -5, 8])
def test_embedding_backward_indices_are_checked(name: str, scale: bool, bad: int) -> None:
    """The CPU kernel writes rows at the indices unchecked: 2**40 was a SIGSEGV, -5 wrote
    before the result's storage without a word."""
    args = [torch.ones(3, 4), torch.tensor([0, bad, 1]), 8, -1, scale]
    if "dense" not in name:
        args.append(False)  # sparse
    with pytest.raises(OpError, match="out of range for 8 rows"):
        _run(name, args)
    args[1] = torch.tensor([0, 7, 1])
    grad = _run(name, args)
    assert grad.shape == (8, 4) and grad[7].sum() == 4.0 and grad[2].sum() == 0.0


def _adam(params: list, grads: list, state: list, steps: list, maxes: list | None = None) -> None:
    args = [params, grads, state, [torch.zeros_like(p) for p in params], maxes or [], steps]
    kwargs = {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "eps": 1e-8}
    _run("aten::_fused_adam_.default", args, {**kwargs, "amsgrad": False, "maximize": False})


@pytest.mark.parametrize(
    ("grads", "why"),
    [
        ([torch.ones(2)], "grads\\[0\\] must be contiguous with 1000 elements"),  # SIGSEGV
        ([torch.ones(1).expand(1000)], "must be contiguous"),  # 1000 elements, 1 stored
        ([torch.ones(1000), torch.ones(1000)], "2 tensors for 1 params"),
    ],
)
def test_fused_optimizers_check_their_tensors_against_the_params(grads: list, why: str) -> None:
    """``fused=True`` optimizers: the CPU kernel walks every tensor as its param's number of
    contiguous elements (a 2-element grad of a 1000-element param was a SIGSEGV)."""
    params = [torch.ones(1000)]
    with pytest.raises(OpError, match=why):
        _adam(params, grads, [torch.zeros(1000)], [torch.zeros(())])
    assert torch.equal(params[0], torch.ones(1000))


def test_fused_optimizers_run_when_consistent() -> None:
    params, grads = [torch.ones(10), torch.ones(3)], [torch.ones(10), torch.ones(3)]
    with pytest.raises(OpError, match="state_steps\\[1\\] must have one element"):
        _adam(params, grads, [torch.zeros(10), torch.zeros(3)], [torch.zeros(()), torch.zeros(2)])
    _adam(params, grads, [torch.zeros(10), torch.zeros(3)], [torch.ones(()), torch.ones(())])
    assert (params[0] < 1).all() and (params[1] < 1).all()


def test_foreach_lists_must_match_in_length() -> None:
    """``_foreach_copy`` of an empty list from a one-tensor list was a SIGSEGV."""
    with pytest.raises(OpError, match="differ in length"):
        _run("aten::_foreach_copy.default", [[], [torch.ones(2)], True])
    out = _run("aten::_foreach_copy.default", [[torch.zeros(2)], [torch.ones(2)], False])
    assert torch.equal(out[0], torch.ones(2))


def test_batch_norm_checks_its_per_channel_tensors_and_running_stats() -> None:
    """Eval-mode ``native_batch_norm`` without running statistics was a SIGSEGV, a backward of
    an empty input a SIGFPE; per-channel tensors are read as ``input.size(1)`` elements."""
    x = torch.randn(4, 3)
    with pytest.raises(OpError, match="running_mean and running_var are needed"):
        _run(
            "aten::native_batch_norm.default",
            [torch.ones(1, 1), None, None, None, None, False, 0.0, 0.0],
        )
    with pytest.raises(OpError, match="weight must have 3 elements"):
        _run(
            "aten::native_batch_norm.default", [x, torch.ones(2), None, None, None, True, 0.1, 1e-5]
        )
    with pytest.raises(OpError, match="running_var must have 3 elements"):
        _run(
            "aten::_native_batch_norm_legit_no_training.default",
            [x, None, None, torch.zeros(3), torch.ones(1), 0.1, 1e-5],
        )
    no_stats = [x, None, None, None, None, 0.1, 1e-5]
    with pytest.raises(OpError, match="running_mean and running_var are needed"):
        _run("aten::_batch_norm_no_update.default", no_stats)  # SIGSEGV
    with pytest.raises(OpError, match="running_mean and running_var are needed"):
        _run("aten::_native_batch_norm_legit.no_stats", [x, None, None, False, 0.1, 1e-5])
    empty = torch.ones(3, 0, 4)
    args = [empty, empty, None, None, None, torch.ones(0), torch.ones(0), False, 0.5, [True] * 3]
    with pytest.raises(OpError, match="no elements"):
        _run("aten::native_batch_norm_backward.default", args)
    mean, var = torch.zeros(3), torch.ones(3)
    out, save_mean, save_invstd = _run(
        "aten::native_batch_norm.default", [x, None, None, mean, var, False, 0.1, 1e-5]
    )
    assert torch.allclose(out, x, atol=1e-4) and save_mean.numel() == 0
    grad = _run(
        "aten::native_batch_norm_backward.default",
        [torch.ones(4, 3), x, None, mean, var, save_mean, save_invstd, False, 1e-5, [True] * 3],
    )
    assert grad[0].shape == (4, 3)


def test_grouped_query_attention_heads_are_checked() -> None:
    """``enable_gqa`` with a key of no heads divided by zero (SIGFPE)."""
    q, k = torch.ones(2, 3, 5, 4), torch.ones(2, 0, 3, 4)
    name = "aten::_scaled_dot_product_attention_math.default"
    with pytest.raises(OpError, match="key heads \\(0\\) must divide query heads"):
        _run(name, [q, k, k, None, 0.0, False, None], {"enable_gqa": True})
    k = torch.ones(2, 1, 3, 4)
    out, _ = _run(name, [q, k, k, None, 0.0, False, None], {"enable_gqa": True})
    assert out.shape == (2, 3, 5, 4)


@pytest.mark.parametrize(
    "name, args",
    [
        ("aten::special_laguerre_polynomial_l.default", [torch.ones(2), torch.tensor([3, 2**40])]),
        ("aten::special_legendre_polynomial_p.n_scalar", [torch.ones(2), 2**40]),
        ("aten::special_hermite_polynomial_h.x_scalar", [2.0, torch.tensor([float("nan")])]),
        ("aten::special_chebyshev_polynomial_t.n_scalar", [torch.ones(2), -(2**62)]),
    ],
)
def test_polynomial_degrees_past_the_limit_are_refused(name: str, args: list) -> None:
    """Their kernels loop n times per element: one op with n = 2**40 held the executor, and so
    every tenant, for minutes."""
    with pytest.raises(OpError, match="degree n"):
        _run(name, args)


def test_polynomials_of_usual_degrees_run() -> None:
    x = torch.linspace(-0.9, 0.9, 5)
    n = torch.tensor([0, 3, bounds.MAX_POLYNOMIAL_DEGREE])
    got = _run("aten::special_legendre_polynomial_p.default", [x[:3], n])
    assert torch.equal(got, torch.special.legendre_polynomial_p(x[:3], n))
    got = _run("aten::special_hermite_polynomial_he.n_scalar", [x, 4])
    assert torch.equal(got, torch.special.hermite_polynomial_he(x, 4))


def _pool(dims: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.rand((1, 2) + (4,) * dims)
    forward = torch.ops.aten.max_pool2d_with_indices if dims == 2 else None
    forward = forward or torch.ops.aten.max_pool3d_with_indices
    y, idx = forward.default(x, [2] * dims, [2] * dims, [0] * dims, [1] * dims, False)
    return x, y, idx


@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("bad", [1 << 40, -1, 16, -(1 << 63)])
def test_max_pool_backward_indices_stay_in_the_inputs_plane(dims: int, bad: int) -> None:
    """The CPU kernel adds each gradient at its index unchecked: 2**40 was a SIGSEGV, a smaller
    one wrote into whatever followed the result (another tenant's tensor)."""
    x, y, idx = _pool(dims)
    name = f"aten::max_pool{dims}d_with_indices_backward.default"
    args = [torch.ones_like(y), x, [2] * dims, [2] * dims, [0] * dims, [1] * dims, False, idx]
    want = _run(name, list(args))
    plane = 4**dims
    hostile = idx.clone()
    hostile.view(-1)[0] = bad if bad != 16 else plane
    args[-1] = hostile
    with pytest.raises(OpError, match=f"out of range for an input plane of {plane} elements"):
        _run(name, args)
    args[-1] = idx[:, :1].clone()
    with pytest.raises(OpError, match="indices must have grad_output's shape"):
        _run(name, args)
    x.requires_grad_()
    pool = torch.nn.functional.max_pool2d if dims == 2 else torch.nn.functional.max_pool3d
    pool(x, 2).sum().backward()
    assert torch.equal(want, x.grad)


@pytest.mark.parametrize(
    ("name", "make", "why"),
    [
        (
            "aten::convolution_backward.default",
            lambda: [
                torch.ones(0),
                torch.rand(1, 2, 5, 5),
                torch.rand(3, 2, 3, 3),
                [3],
                [1, 1],
                [0, 0],
                [1, 1],
                False,
                [0, 0],
                1,
                [True, True, True],
            ],
            "grad_output must be of shape \\[1, 3, 3, 3\\]",
        ),  # fmt: skip
        (
            "aten::native_layer_norm_backward.default",
            lambda: [
                torch.ones(0),
                torch.rand(2, 4),
                [4],
                torch.rand(2, 1),
                torch.rand(2, 1),
                None,
                None,
                [True, False, False],
            ],
            "grad_out must have the input's shape",
        ),  # fmt: skip
        (
            "aten::native_batch_norm_backward.default",
            lambda: [
                torch.ones(4, 3),
                torch.rand(4, 3),
                None,
                None,
                None,
                torch.ones(0),
                torch.ones(3),
                True,
                1e-5,
                [True, False, False],
            ],
            "save_mean must have 3 elements when training",
        ),  # fmt: skip
        (
            "aten::avg_pool3d_backward.default",
            lambda: [
                torch.ones(0),
                torch.rand(1, 1, 4, 4, 4),
                [2] * 3,
                [2] * 3,
                [0] * 3,
                False,
                True,
                None,
            ],
            "grad_output must be of shape \\[1, 1, 2, 2, 2\\]",
        ),  # fmt: skip
        (
            "aten::_adaptive_avg_pool2d_backward.default",
            lambda: [torch.ones(2, 3, 2, 2), torch.rand(1, 3, 4, 4)],
            "batch and channels must be self's",
        ),
        (
            "aten::_cdist_backward.default",
            lambda: [torch.ones(0), torch.rand(4, 5), torch.rand(3, 5), 2.0, torch.rand(4, 3)],
            "grad must be of shape \\[4, 3\\]",
        ),
        (
            "aten::_log_softmax_backward_data.default",
            lambda: [torch.ones(4, 5), torch.ones(0), 1, torch.float32],
            "output must have grad_output's shape",
        ),
        (
            "aten::_weight_norm_interface.default",
            lambda: [torch.rand(4, 4), torch.ones(0), 0],
            "g must be of shape \\[4, 1\\]",
        ),
        (
            "aten::reflection_pad2d_backward.default",
            lambda: [torch.ones(1, 5, 6), torch.rand(1, 4, 4), [1, 1, 1, 1]],
            "grad_output must be of shape \\[1, 6, 6\\]",
        ),
        (
            "aten::col2im.default",
            lambda: [torch.rand(2, 16, 16), [8, 8], [2, 2], [1, 1], [1 << 40, 0], [2, 2]],
            "padding .* out of",
        ),
        (
            "aten::col2im.default",
            lambda: [torch.rand(2, 16, 15), [8, 8], [2, 2], [1, 1], [0, 0], [2, 2]],
            "must hold 16 blocks",
        ),
        (
            "aten::_native_multi_head_attention.default",
            lambda: [
                torch.rand(1, 2, 4),
                torch.rand(1, 2, 4),
                torch.rand(1, 2, 4),
                4,
                0,
                torch.rand(12, 4),
                torch.rand(12),
                torch.rand(4, 4),
                torch.rand(4),
            ],
            "num_heads \\(0\\) must be positive and divide embed_dim",
        ),  # fmt: skip
        (
            "aten::_native_multi_head_attention.default",
            lambda: [
                torch.rand(1, 2, 4),
                torch.rand(1, 2, 4),
                torch.rand(1, 2, 4),
                4,
                2,
                torch.rand(12, 4),
                torch.rand(12),
                torch.rand(4, 4),
                torch.rand(4),
                torch.zeros(1, 2, dtype=torch.bool),
                False,
                False,
                7,
            ],
            "mask_type must be 0, 1, 2 or None",
        ),  # fmt: skip
    ],
)
def test_backwards_and_kernels_that_trust_their_shapes_are_checked(
    name: str, make: Any, why: str
) -> None:
    """Each was a SIGSEGV, a heap corruption, a read past a storage or a loop without end on
    these arguments (tests/op_cases.py's structured fuzzing found them); the calls the programs
    make pass (test_recorded_calls_with_one_hostile_value_stay_inside_their_storages)."""
    with pytest.raises(OpError, match=why):
        _run(name, make())


def test_smooth_l1_loss_backward_takes_floating_tensors() -> None:
    """Its CPU kernel for an integer ``self`` divides by beta cast to an integer: with beta
    0.5, a SIGFPE (found by the random fuzzer once its examples changed)."""
    t = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(OpError, match="self must be a floating-point tensor"):
        _run("aten::smooth_l1_loss_backward.default", [t.float(), t, t, 1, 0.5])
    f = t.float()
    got = _run("aten::smooth_l1_loss_backward.default", [torch.ones(()), f, f + 0.25, 1, 0.5])
    assert torch.allclose(got, torch.full((2, 2), -0.125))
