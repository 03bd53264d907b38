"""The programs scripts/make_allowlist.py collects the server's allow-list from.

Each is what ordinary training and inference code does with ``torch.nn``: a model, its loss, its
optimizer, forward and backward, a few steps, and the Tensor methods of a training loop around
them. Each takes an :class:`Env`: ``dev`` is where tensors go (the ``remote`` device, ``"cuda"`` in
transparent mode, the CPU), ``amp`` the device type autocast and GradScaler are given. Small sizes:
what is collected is the op names, not the numbers. Add a program here when a real one's forwarding
is refused an op it needs, then rerun the generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Env:
    kind: str  # remote, transparent, cpu
    dev: Any
    amp: str
    #: What failed, and why (a part that fails still sent its ops up to there).
    failures: list[str] = field(default_factory=list)

    def t(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dev)

    def attempt(self, *parts: Callable[[], object]) -> None:
        """Run each part to its end (a sync point), whatever the others do."""
        for part in parts:
            try:
                part()
                torch.ones(1, device=self.dev).sum().item()
            except Exception as exc:  # noted; the next part goes on
                what = getattr(part, "__qualname__", "?").replace(".<locals>", "")
                self.failures.append(f"{what}: {type(exc).__name__}: {exc}"[:300])


#: Ops the programs send once a server has run an op before them that a CPU server cannot:
#: ``nn.LSTMCell``'s forward on the remote device is ``_thnn_fused_lstm_cell`` (as on CUDA),
#: which has no CPU kernel, so here its backward is never reached.
SENT_PAST_A_CPU_SERVER = {"aten::_thnn_fused_lstm_cell_backward_impl.default"}

#: Every program, by name, in the order they run (:func:`program` adds one).
PROGRAMS: dict[str, Callable[[Env], None]] = {}


def program(fn: Callable[[Env], None]) -> Callable[[Env], None]:
    PROGRAMS[fn.__name__] = fn
    return fn


def _steps(env: Env, model: nn.Module, batch: Any, loss_fn: Any, opt: Any, n: int = 2) -> None:
    """``n`` training steps and a no-grad evaluation: the loop every program shares."""
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, *batch)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
    model.eval()
    with torch.no_grad():
        loss_fn(model, *batch).item()
    if env.kind == "cpu":  # inference tensors cannot be remote tensors (their version counter)
        with torch.inference_mode():
            loss_fn(model, *batch).item()
    model.train()


# ---- models ------------------------------------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 4, layers: int = 2, **kw: Any):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, **kw)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, causal: bool = True, pad: Any = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        mask = (
            nn.Transformer.generate_square_subsequent_mask(t, device=idx.device) if causal else None
        )
        x = self.blocks(x, mask=mask, is_causal=causal, src_key_padding_mask=pad)
        return self.head(self.norm(x))


@program
def gpt(env: Env) -> None:
    for kw in ({"norm_first": True, "activation": "gelu"}, {"norm_first": False}):
        model = GPT(**kw).to(env.dev)
        idx = env.t(torch.randint(0, 32, (2, 8)))
        target = env.t(torch.randint(0, 32, (2, 8)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

        def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = m(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)

        _steps(env, model, (idx, target), loss_fn, opt)
        # Generation: the sampling loop of every GPT example.
        model.eval()
        with torch.no_grad():
            seq = idx[:, :2]
            for _ in range(3):
                logits = model(seq)[:, -1, :] / 0.8
                v, _ = torch.topk(logits, 5)
                logits[logits < v[:, [-1]]] = -float("inf")
                probs = F.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, num_samples=1)
                seq = torch.cat((seq, nxt), dim=1)
            seq.argmax(-1).tolist()
            # The fast path (eval, no grad, a padding mask): the fused encoder layer.
            pad = env.t(torch.tensor([[False] * 8, [False] * 6 + [True] * 2]))
            model(idx, causal=False, pad=pad).sum().item()
            model(idx, causal=False).sum().item()


@program
def attention(env: Env) -> None:
    mha = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True).to(env.dev)
    x = env.t(torch.randn(2, 5, 16, requires_grad=True))
    pad = env.t(torch.tensor([[False] * 5, [False] * 3 + [True] * 2]))
    mask = env.t(torch.ones(5, 5).triu(1).bool())

    def train() -> None:
        out, w = mha(x, x, x, key_padding_mask=pad, need_weights=True)
        (out.sum() + w.sum()).backward()
        out, _ = mha(x, x, x, need_weights=False, attn_mask=mask)
        out.mean().backward()

    def fast_path() -> None:  # eval, no grad: _native_multi_head_attention
        mha.eval()
        with torch.no_grad():
            mha(x, x, x, key_padding_mask=pad)[0].sum().item()
            mha(x, x, x, need_weights=False)[0].sum().item()

    env.attempt(train, fast_path)


@program
def sdpa(env: Env) -> None:
    q = env.t(torch.randn(2, 4, 6, 8, requires_grad=True))
    k = env.t(torch.randn(2, 4, 6, 8, requires_grad=True))
    v = env.t(torch.randn(2, 4, 6, 8, requires_grad=True))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y + F.scaled_dot_product_attention(q, k, v, attn_mask=env.t(torch.ones(6, 6).tril().bool()))
    y = y + F.scaled_dot_product_attention(q, k, v, attn_mask=env.t(torch.zeros(6, 6)), scale=0.3)
    y.sum().backward()


@program
def transformer(env: Env) -> None:
    dec = nn.Transformer(16, 4, 1, 1, 32, dropout=0.0, batch_first=True).to(env.dev)
    src, tgt = env.t(torch.randn(2, 5, 16)), env.t(torch.randn(2, 4, 16))
    mask = nn.Transformer.generate_square_subsequent_mask(4, device=src.device)
    dec(src, tgt, tgt_mask=mask, tgt_is_causal=True).sum().backward()


@program
def rnns(env: Env) -> None:
    x = env.t(torch.randn(3, 5, 8))
    for cls in (nn.LSTM, nn.GRU, nn.RNN):
        for kw in ({"bidirectional": True, "num_layers": 2, "dropout": 0.1}, {"proj_size": 4}):
            if "proj_size" in kw and cls is not nn.LSTM:
                kw = {"nonlinearity": "relu"} if cls is nn.RNN else {}
            m = cls(8, 6, batch_first=True, **kw).to(env.dev)
            out, _ = m(x)
            out.sum().backward()


@program
def packed(env: Env) -> None:
    x = env.t(torch.randn(3, 5, 8))
    if env.kind == "cpu":  # a PackedSequence's batch_sizes must be a CPU tensor
        m = nn.LSTM(8, 6, batch_first=True).to(env.dev)
        packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=True)
        out, _ = m(packed)
        nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0].sum().backward()


@program
def cells(env: Env) -> None:
    x = env.t(torch.randn(3, 5, 8))

    def run(cell: nn.Module) -> Callable[[], None]:
        def steps() -> None:
            m = cell.to(env.dev)
            h = None
            total = 0
            for t in range(3):
                h = m(x[:, t], h)
                total = total + (h[0] if isinstance(h, tuple) else h).sum()
            total.backward()

        return steps

    env.attempt(run(nn.LSTMCell(8, 6)), run(nn.GRUCell(8, 6)), run(nn.RNNCell(8, 6, "relu")))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1, groups=2),
            nn.BatchNorm2d(8),
            nn.SiLU(),
            nn.Dropout2d(0.1),
            nn.AvgPool2d(2),
            nn.Conv2d(8, 16, 1),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@program
def cnn(env: Env) -> None:
    model = CNN().to(env.dev).to(memory_format=torch.channels_last)
    x = env.t(torch.randn(4, 3, 16, 16)).contiguous(memory_format=torch.channels_last)
    y = env.t(torch.randint(0, 10, (4,)))
    opt = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = m(x)
        (out.argmax(1) == y).float().mean().item()
        return F.cross_entropy(out, y, label_smoothing=0.1)

    _steps(env, model, (x, y), loss_fn, opt)
    sched.step()
    model = CNN().to(env.dev)
    _steps(env, model, (x.contiguous(), y), loss_fn, torch.optim.Adam(model.parameters()))


@program
def gan(env: Env) -> None:
    """A DCGAN-style pair: in-place LeakyReLU in the discriminator, the generator's graph
    backwarded after the discriminator's step (tests/thirdparty's dcgan)."""
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Linear(32, 16), nn.Tanh())
    disc = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1))
    gen, disc = gen.to(env.dev), disc.to(env.dev)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real, z = env.t(torch.randn(4, 16)), env.t(torch.randn(4, 8))
    ones, zeros = env.t(torch.ones(4, 1)), env.t(torch.zeros(4, 1))

    def step() -> None:
        fake = gen(z)
        opt_d.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(disc(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(disc(fake), ones).backward()
        opt_g.step()

    env.attempt(step)


@program
def policy_gradient(env: Env) -> None:
    """REINFORCE: actions drawn from ``Categorical`` (its argument checks: ``all.dim``), the
    episode's log-probabilities backwarded at its end (tests/thirdparty's reinforce)."""
    policy = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).to(env.dev)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)

    def episode() -> None:
        log_probs = []
        for _ in range(3):
            probs = F.softmax(policy(env.t(torch.randn(1, 4))), dim=1)
            dist = torch.distributions.Categorical(probs)
            action = dist.sample()
            log_probs.append(dist.log_prob(action))
        returns = env.t(torch.tensor([1.0, 0.5, 0.25]))
        returns = (returns - returns.mean()) / (returns.std() + 1e-8)
        loss = torch.cat([-lp * r for lp, r in zip(log_probs, returns)]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    env.attempt(episode)


@program
def convolutions(env: Env) -> None:
    """The other layers of vision and audio models."""
    x1, x2, x3 = (env.t(torch.randn(*s)) for s in ((2, 4, 16), (2, 4, 8, 8), (1, 2, 4, 6, 6)))
    layers = [
        (
            x1,
            nn.Sequential(
                nn.Conv1d(4, 4, 3, padding="same"),
                nn.BatchNorm1d(4),
                nn.MaxPool1d(2),
                nn.AvgPool1d(2),
                nn.AdaptiveAvgPool1d(2),
                nn.AdaptiveMaxPool1d(1),
            ),
        ),
        (x1, nn.Sequential(nn.ConvTranspose1d(4, 2, 3, stride=2), nn.InstanceNorm1d(2))),
        (
            x2,
            nn.Sequential(
                nn.ConvTranspose2d(4, 4, 2, stride=2),
                nn.GroupNorm(2, 4),
                nn.LeakyReLU(0.1),
                nn.MaxPool2d(3, 2, 1),
                nn.AdaptiveMaxPool2d(2),
            ),
        ),
        (
            x2,
            nn.Sequential(
                nn.Upsample(scale_factor=2, mode="nearest"),
                nn.Conv2d(4, 8, 3, 2, 1),
                nn.PixelShuffle(2),
                nn.InstanceNorm2d(2, affine=True),
                nn.ELU(),
            ),
        ),
        (
            x2,
            nn.Sequential(
                nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                nn.Hardswish(),
                nn.Mish(),
                nn.Softplus(),
                nn.PReLU(),
            ),
        ),
        (
            x2,
            nn.Sequential(
                nn.ReflectionPad2d(1),
                nn.Conv2d(4, 4, 3),
                nn.ReplicationPad2d(1),
                nn.ZeroPad2d(1),
                nn.Tanh(),
                nn.Sigmoid(),
                nn.Hardtanh(),
                nn.ReLU6(),
            ),
        ),
        (
            x2,
            nn.Sequential(
                nn.LayerNorm([8, 8]),
                nn.Unfold(2, stride=2),
                nn.Fold((8, 8), 2, stride=2),
                nn.LocalResponseNorm(2),
                nn.Dropout(0.2),
                nn.AlphaDropout(0.1),
            ),
        ),
        (
            x3,
            nn.Sequential(
                nn.Conv3d(2, 4, 3, padding=1),
                nn.BatchNorm3d(4),
                nn.MaxPool3d(2),
                nn.AdaptiveAvgPool3d(1),
                nn.AdaptiveMaxPool3d(1),
            ),
        ),
        (
            x3,
            nn.Sequential(
                nn.ConvTranspose3d(2, 2, 2),
                nn.AvgPool3d(2),
                nn.Upsample(scale_factor=2, mode="trilinear"),
            ),
        ),
    ]
    for x, m in layers:
        m = m.to(env.dev)
        out = m(x.requires_grad_())
        out.pow(2).mean().backward()
        m.eval()
        with torch.no_grad():
            m(x).sum().item()
    y = F.interpolate(x2, size=(5, 7), mode="bicubic", align_corners=True)
    y = y + F.interpolate(x2, size=(5, 7), mode="area") + F.interpolate(x2, size=(5, 7))
    y = F.pad(y, (1, 2, 1, 2), mode="circular") + 1
    y = F.pad(y, (1, 1, 1, 1), mode="reflect") + F.pad(y, (1, 1, 1, 1), mode="replicate")
    y = y + F.pad(x1, (1, 1), mode="reflect").sum() + F.pad(x1, (2, 1), mode="replicate").sum()
    y = y + F.pad(x3, (1,) * 6, mode="reflect").sum() + F.pad(x3, (1,) * 6, mode="replicate").sum()
    y = y + F.pad(y, (1, 1))[..., 1:-1]
    y.sum().backward()
    g = F.affine_grid(env.t(torch.eye(2, 3).expand(2, 2, 3)), [2, 4, 8, 8], align_corners=False)
    F.grid_sample(x2, g, align_corners=False).sum().backward()
    F.normalize(x2, dim=1).sum().backward()


@program
def embeddings(env: Env) -> None:
    emb = nn.Embedding(20, 8, padding_idx=0, max_norm=None).to(env.dev)
    idx = env.t(torch.tensor([[1, 0, 5], [7, 19, 0]]))
    head = nn.Linear(8, 20).to(env.dev)
    logits = head(emb(idx))
    y = env.t(torch.tensor([[1, 2, 3], [4, 5, -100]]))
    loss = F.cross_entropy(logits.transpose(1, 2), y)
    loss = loss + F.nll_loss(F.log_softmax(logits, -1).view(-1, 20), y.view(-1), reduction="sum")
    loss.backward()
    F.embedding(idx, emb.weight, scale_grad_by_freq=True).sum().backward()
    F.one_hot(idx, 20).float().sum().item()


@program
def losses(env: Env) -> None:
    torch.manual_seed(0)
    x = env.t(torch.randn(4, 5, requires_grad=True))
    p = torch.sigmoid(x)
    t = env.t(torch.rand(4, 5))
    y = env.t(torch.tensor([0, 2, 4, 1]))
    pos = env.t(torch.randn(4, 5))
    sign = env.t(torch.tensor([1.0, -1.0, 1.0, -1.0]))
    terms = [
        F.mse_loss(x, t),
        F.l1_loss(x, t, reduction="sum"),
        F.smooth_l1_loss(x, t, beta=0.5),
        F.huber_loss(x, t),
        F.binary_cross_entropy(p, t),
        F.binary_cross_entropy_with_logits(x, t, pos_weight=env.t(torch.ones(5))),
        F.cross_entropy(x, y, weight=env.t(torch.rand(5))),
        F.cross_entropy(x, F.softmax(pos, -1)),
        F.nll_loss(F.log_softmax(x, 1), y, reduction="none").mean(),
        F.kl_div(F.log_softmax(x, 1), F.softmax(pos, 1), reduction="batchmean"),
        F.poisson_nll_loss(x, t),
        F.gaussian_nll_loss(x, t, torch.ones_like(t)),
        F.soft_margin_loss(x, torch.sign(pos)),
        F.multilabel_soft_margin_loss(x, (t > 0.5).float()),
        F.hinge_embedding_loss(x, torch.sign(pos)),
        F.margin_ranking_loss(x[:, 0], x[:, 1], sign),
        F.cosine_embedding_loss(x, pos, sign),
        F.triplet_margin_loss(x, pos, t),
        F.cosine_similarity(x, pos).mean(),
        F.pairwise_distance(x, pos).mean(),
        torch.cdist(x, pos).mean(),
    ]
    sum(terms).backward()
    labels = env.t(torch.tensor([[0, 1, -1, 0, 0], [4, -1, 0, 0, 0]] * 2))
    margins = F.multi_margin_loss(x, y) + F.multilabel_margin_loss(x, labels)
    if env.kind == "cpu":  # their backwards end a forwarding client (terminate), so forward only
        margins.backward()
    else:
        margins.item()


def _model(env: Env) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2)).to(env.dev)


@program
def optimizers(env: Env) -> None:
    x, y = env.t(torch.randn(8, 6)), env.t(torch.randn(8, 2))

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(x), y)

    kinds: list[tuple[Any, dict[str, Any]]] = [
        (torch.optim.SGD, {"lr": 0.1}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-4}),
        (torch.optim.Adam, {"lr": 1e-3}),
        (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True, "weight_decay": 1e-2}),
        (torch.optim.AdamW, {"lr": 1e-3}),
        (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True, "maximize": True}),
        (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9, "centered": True}),
        (torch.optim.RMSprop, {"lr": 1e-3}),
        (torch.optim.Adagrad, {"lr": 1e-2, "lr_decay": 1e-3}),
        (torch.optim.Adadelta, {}),
        (torch.optim.Adamax, {}),
        (torch.optim.NAdam, {}),
        (torch.optim.RAdam, {}),
    ]
    for cls, kw in kinds:
        for how in ({"foreach": True}, {"foreach": False}, {"fused": True}):
            if "fused" in how and cls not in (
                torch.optim.SGD,
                torch.optim.Adam,
                torch.optim.AdamW,
                torch.optim.Adagrad,
            ):
                continue
            model = _model(env)
            _steps(env, model, (x, y), loss_fn, cls(model.parameters(), **kw, **how), n=2)
    model = _model(env)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True)
    _steps(env, model, (x, y), loss_fn, opt)


@program
def lbfgs(env: Env) -> None:
    x, y = env.t(torch.randn(8, 6)), env.t(torch.randn(8, 2))
    model = _model(env)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    model = _model(env)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    opt.step(closure)
    nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=float("inf"))
    nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=False)
    nn.utils.clip_grad_value_(model.parameters(), 0.1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(sd)

    def ema() -> None:  # a deep copy of the model
        averaged = torch.optim.swa_utils.AveragedModel(model)
        averaged.update_parameters(model)

    env.attempt(ema)


@program
def amp(env: Env) -> None:
    x, y = env.t(torch.randn(8, 6)), env.t(torch.randint(0, 2, (8,)))
    for dtype in (torch.bfloat16, torch.float16):
        for fused in (False, True):
            model = _model(env)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
            scaler = torch.amp.GradScaler(env.amp, init_scale=2.0**8, growth_interval=1)
            for step in range(3):
                opt.zero_grad()
                with torch.autocast(env.amp, dtype=dtype):
                    loss = F.cross_entropy(model(x), y)
                    if step == 1:
                        loss = loss * float("inf")
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                scaler.get_scale()


@program
def autocast(env: Env) -> None:
    x = env.t(torch.randn(8, 6))
    model = GPT().to(env.dev)
    idx = env.t(torch.randint(0, 32, (2, 8)))

    def gpt() -> None:
        with torch.autocast(env.amp, dtype=torch.bfloat16):
            logits = model(idx)
            loss = F.cross_entropy(logits.float().view(-1, 32), idx.view(-1))
        loss.backward()

    def cnn() -> None:
        conv = CNN().to(env.dev)
        with torch.autocast(env.amp, dtype=torch.bfloat16):
            conv(env.t(torch.randn(2, 3, 8, 8))).float().sum().backward()

    def ops() -> None:  # autocast's float32 and promote ops
        with torch.autocast(env.amp, dtype=torch.bfloat16):
            y = x.bfloat16()
            (torch.norm(y) + torch.atan2(y, y).sum() + y.exp().sum()).item()

    def low() -> None:
        m = _model(env).to(torch.bfloat16)
        m(x.bfloat16()).float().sum().backward()
        m.half()(x.half()).float().sum().item()

    env.attempt(gpt, cnn, ops, low)


@program
def fft(env: Env) -> None:
    x = env.t(torch.randn(4, 8, requires_grad=True))
    c = torch.fft.fft(x)
    y = torch.fft.ifft(c).real.sum() + torch.fft.rfft(x).abs().sum()
    y = y + torch.fft.irfft(torch.fft.rfft(x, norm="ortho"), n=8).sum()
    y = y + torch.fft.fft2(x).abs().sum() + torch.fft.ifft2(x).abs().sum()
    y = y + torch.fft.rfftn(x).abs().sum() + torch.fft.irfftn(torch.fft.rfftn(x), s=x.shape).sum()
    y = y + torch.fft.fftshift(torch.fft.fft(x, dim=0), dim=0).real.sum()
    y = y + torch.fft.ifftshift(x).sum() + torch.fft.hfft(c[:, :5]).sum()
    y = y + torch.view_as_real(c).sum()
    y.backward()
    window = torch.hann_window(8, device=x.device)
    s = torch.stft(x.detach().reshape(-1), 8, hop_length=2, window=window, return_complex=True)
    torch.istft(s, 8, hop_length=2, window=window).sum().item()
    env.attempt(lambda: torch.fft.fftfreq(8, device=x.device).sum().item())


@program
def indexing(env: Env) -> None:
    x = env.t(torch.randn(6, 5, requires_grad=True))
    idx = env.t(torch.tensor([0, 2, 5]))
    mask = x.detach() > 0
    parts = [
        x[idx].sum(),
        x[:, 1:4:2].sum(),
        x[mask].sum(),
        x[idx, idx[:2].repeat(2)[:3]].sum(),
        x[..., None, -1].sum(),
        x.index_select(0, idx).sum(),
        x.gather(1, env.t(torch.tensor([[0, 1]] * 6))).sum(),
        torch.take_along_dim(x, x.detach().argsort(1), 1).sum(),
        torch.where(mask, x, torch.zeros_like(x)).sum(),
        x.masked_fill(mask, 0.0).sum(),
        x.topk(2, dim=1).values.sum(),
        x.sort(dim=0, descending=True).values.sum(),
        x.cumsum(0).sum(),
        x.cumprod(1).sum(),
        x.cummax(0).values.sum(),
        x.cummin(1).values.sum(),
        x.max(dim=1).values.sum(),
        x.min().abs(),
        x.amax(0).sum(),
        x.logsumexp(1).sum(),
        x.kthvalue(2, 1).values.sum(),
        x.median(1).values.sum(),
        x.median(),
        x.std(0).sum() + x.var(1, unbiased=False).sum() + x.norm() + x.prod(1).sum(),
        torch.stack([x, x]).sum() + torch.cat([x, x], 1).sum(),
        x.roll(1, 0).sum(),
        x.flip(0).sum() + x.tril().sum() + x.triu(1).sum() + x.t().matmul(x).trace(),
        torch.einsum("ij,kj->ik", x, x).sum() + torch.outer(x[0], x[1]).sum(),
        x.unsqueeze(0).expand(2, 6, 5).sum() + x.repeat(2, 1).sum() + x.chunk(2)[1].sum(),
        sum(s.sum() for s in x.split([2, 4])) + x.unbind(1)[0].sum() + x.narrow(0, 1, 2).sum(),
        x.repeat_interleave(2, dim=0).sum() + x.diag().sum() + x.diagonal().sum(),
        x.scatter(0, idx.view(3, 1).expand(3, 5), x[:3]).sum(),
        x.scatter_add(0, idx.view(3, 1).expand(3, 5), x[:3]).sum(),
        x.scatter_reduce(0, idx.view(3, 1).expand(3, 5), x[:3], "amax").sum(),
        x.index_add(0, idx, x[:3]).sum() + x.index_fill(1, idx[:2], 1.0).sum(),
        x.index_copy(0, idx, x[:3]).sum() + x.index_put((idx,), x[:3], accumulate=True).sum(),
        x.masked_scatter(mask, x).sum() + x.masked_select(mask).sum(),
        x.clamp(-1, 1).sum() + x.clamp_min(0).sum() + x.abs().sqrt().sum() + x.exp().log1p().sum(),
    ]
    sum(parts).backward()
    y = x.detach().clone()
    y[idx] = 0.0
    y[mask] = 1.0
    y[:, 0] += 2.0
    y[idx, 1] = env.t(torch.tensor([1.0, 2.0, 3.0]))
    y.index_add_(0, idx, y[:3].clone())
    y.scatter_(1, env.t(torch.zeros(6, 1, dtype=torch.long)), 5.0)
    y.masked_fill_(mask, -1.0)
    y.clamp_(max=3.0)
    y.nonzero().tolist()
    torch.unique(idx, return_inverse=True, return_counts=True)[0].tolist()
    torch.unique_consecutive(idx).tolist()
    torch.bincount(idx, minlength=6).tolist()
    torch.searchsorted(env.t(torch.tensor([0.0, 1.0, 2.0])), y[:, 0].contiguous()).tolist()
    torch.bucketize(y[:, 0], env.t(torch.tensor([0.0, 1.0]))).tolist()
    torch.histc(y, bins=4).tolist()
    y.argmax().item(), y.argmin(1).tolist(), y.any().item(), y.all().item()
    torch.isin(idx, env.t(torch.tensor([2]))).tolist()
    torch.count_nonzero(y).item()
    torch.randperm(6, device=y.device)[:3].tolist()


@program
def tensors(env: Env) -> None:
    """The Tensor methods and factories of a training loop."""
    d = env.dev
    x = torch.randn(3, 4, device=d)
    a = torch.zeros(3, 4, device=d) + torch.ones(3, 4, device=d) + torch.full((3, 4), 2.0, device=d)
    a = a + torch.empty(3, 4, device=d).fill_(1.0) + torch.rand(3, 4, device=d)
    a = a + torch.arange(12, device=d).view(3, 4) + torch.linspace(0, 1, 4, device=d)
    a = a + torch.eye(3, 4, device=d) + torch.randint(0, 3, (3, 4), device=d) + torch.zeros_like(x)
    a = a + torch.ones_like(x) + torch.randn_like(x) + torch.rand_like(x) + torch.full_like(x, 3)
    a = a + torch.tensor([1.0, 2.0, 3.0, 4.0], device=d) + torch.as_tensor([1, 2, 3, 4], device=d)
    a = (
        a
        + torch.from_numpy(x.cpu().numpy()).to(d)
        + x.new_zeros(3, 4)
        + x.new_ones(4)
        + x.new_full((4,), 1.0)
    )
    a = a + torch.empty_like(x).normal_() + x.new_empty(3, 4).uniform_(-1, 1) + x.new_tensor([1.0])
    a = a + torch.bernoulli(torch.full((3, 4), 0.5, device=d)) + torch.normal(x, 1.0)
    a = a + torch.logspace(0, 1, 4, device=d) + torch.arange(0, 1, 0.25, device=d)
    b = a.to(torch.float64).to(torch.float16).to(torch.bfloat16).float().double().half().float()
    b = b + a.to(x) + a.type(torch.float32) + a.int().float() + a.long().float() + a.bool().float()
    b = (
        b
        + a.clone()
        + a.detach()
        + a.contiguous()
        + a.t().contiguous().t()
        + a.view(4, 3).view(3, 4)
    )
    b = (
        b
        + a.reshape(-1).reshape(3, 4)
        + a.permute(1, 0).transpose(0, 1)
        + a.flatten().unflatten(0, (3, 4))
    )
    b = b + a.squeeze().unsqueeze(0).squeeze(0) + a.view_as(x) + a.expand_as(x) + a.reshape_as(x)
    b = b + a.abs() + a.neg() + a.exp() + a.abs().log() + a.sigmoid() + a.tanh() + a.sin() + a.cos()
    b = b + a.pow(2) + a**0.5 + 2 ** a.clamp(max=3) + a.rsqrt().nan_to_num() + a.reciprocal()
    b = b + a.floor() + a.ceil() + a.round() + a.trunc() + a.frac() + a.sign() + a.erf() + a.sqrt()
    b = (
        b
        + a.fmod(2)
        + a.remainder(2)
        + a // 2
        + a / 3
        + a * a
        - a
        + torch.maximum(a, x)
        + torch.minimum(a, x)
    )
    b = b + torch.lerp(a, x, 0.5) + torch.addcmul(a, x, x, value=0.1) + torch.addcdiv(a, x, a + 1)
    b = b + a.softmax(-1) + a.log_softmax(0) + F.relu(a) + F.gelu(a, approximate="tanh") + F.silu(a)
    b = b + a.mean() + a.sum(0) + a.mean(1, keepdim=True) + a.std() + a.var() + a.max() + a.min()
    b = b + torch.isnan(a).float() + torch.isinf(a).float() + torch.isfinite(a).float()
    b = (
        b
        + (a > 1).float()
        + (a >= 1).float()
        + (a == 1).float()
        + (a != 1).float()
        + (a < x).float()
    )
    b = (
        b
        + ((a > 0) & (x > 0) | ~(a > 1) ^ (x < 0)).float()
        + torch.logical_and(a > 0, x > 0).float()
    )
    b = b + x @ a.t() @ a + torch.mm(x, a.t()) @ a + torch.bmm(x[None], a.t()[None])[0] @ a
    b = (
        b
        + torch.addmm(x, x, torch.eye(4, device=d))
        + torch.baddbmm(x[None], x[None], torch.eye(4, device=d)[None])[0]
    )
    b = (
        b
        + torch.linalg.vector_norm(a, dim=1, keepdim=True)
        + torch.linalg.matrix_norm(a)
        + a.norm(p=1)
    )
    b = (
        b
        + torch.dist(a, x)
        + torch.diff(a, dim=1).sum()
        + torch.cumsum(a, 0)
        + a.sum(dtype=torch.float64).float()
    )
    b.sum().item()
    b.tolist()
    b[0, 0].item()
    float(b.sum()), int(b.argmax()), bool((b > 0).any()), b.numpy(), b.cpu(), b.equal(b)
    torch.allclose(b, b), torch.isclose(b, b).all().item(), (b == b).all().item()
    b.copy_(x)
    b.zero_()
    b.add_(1).mul_(2).sub_(x).div_(2).addcmul_(x, x).lerp_(x, 0.5).sqrt_().neg_().abs_()
    b.requires_grad_()
    b.to(torch.device("cpu"))
    x.cpu().to(d, non_blocking=True)
    torch.manual_seed(1)
    q, r = torch.linalg.qr(torch.randn(4, 4, device=d))
    (q @ r).sum().item()
    m = torch.randn(4, 4, device=d) + 4 * torch.eye(4, device=d)
    torch.linalg.inv(m).sum().item()
    torch.linalg.solve(m, torch.ones(4, device=d)).sum().item()
    torch.linalg.cholesky(m @ m.t()).sum().item()
    torch.det(m).item()


@program
def init(env: Env) -> None:
    w = torch.empty(8, 6, device=env.dev)
    for fn in (
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        nn.init.orthogonal_,
        nn.init.zeros_,
        nn.init.ones_,
        nn.init.trunc_normal_,
        nn.init.normal_,
        nn.init.uniform_,
        nn.init.eye_,
    ):
        fn(w)
    nn.init.constant_(w, 0.5)
    nn.init.sparse_(w, 0.5)
    w.sum().item()
    for m in (nn.Linear(4, 4), nn.Conv2d(2, 2, 3), nn.Embedding(5, 4), nn.LayerNorm(4)):
        m.to(env.dev).reset_parameters()
    nn.utils.parametrizations.weight_norm(nn.Linear(4, 4).to(env.dev))(
        torch.ones(2, 4, device=env.dev)
    ).sum().backward()
    nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4).to(env.dev))(
        torch.ones(2, 4, device=env.dev)
    ).sum().backward()
    nn.RMSNorm(4).to(env.dev)(torch.ones(2, 4, device=env.dev)).sum().backward()
