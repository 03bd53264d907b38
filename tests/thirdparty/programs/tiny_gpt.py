"""A tiny GPT as nanoGPT and minGPT write one: token embedding tied to the output head, causal
self-attention, AdamW with decayed and undecayed groups, each block's activations checkpointed
(the even blocks with use_reentrant=True, Hugging Face's default, the odd ones False), then
sampling with torch.multinomial."""

import hashlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, CTX, D, HEADS, LAYERS = 40, 16, 32, 4, 4


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)
        self.resid_dropout = nn.Dropout(0.1)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(CTX, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.gradient_checkpointing = True

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i, block in enumerate(self.h):
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=i % 2 == 0)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    @torch.no_grad()
    def generate(self, idx, n):
        for _ in range(n):
            logits, _ = self(idx[:, -CTX:])
            probs = F.softmax(logits[:, -1, :], dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1337)
text = torch.tensor([(i * 3 + i // 5) % VOCAB for i in range(2000)])
starts = torch.randint(0, len(text) - CTX - 1, (8, 8))  # every step's batch, drawn up front
model = GPT().to(device)
print("tied", model.wte.weight is model.lm_head.weight, len(list(model.parameters())))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
    lr=3e-3,
    betas=(0.9, 0.95),
)
torch.manual_seed(42)  # dropout's and sampling's stream, on the device
for step, ix in enumerate(starts):
    x = torch.stack([text[i : i + CTX] for i in ix]).to(device)
    y = torch.stack([text[i + 1 : i + 1 + CTX] for i in ix]).to(device)
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    print("step", step, "loss", loss.item().hex())
model.eval()
out = model.generate(torch.zeros((1, 1), dtype=torch.long, device=device), 12)
print("sample", out[0].tolist())
digest = hashlib.sha256()
for name, t in model.state_dict().items():
    digest.update(name.encode() + t.detach().cpu().numpy().tobytes())
print("weights", digest.hexdigest())
