"""A word-level LSTM language model as pytorch/examples trains one: tied encoder and decoder
weights, truncated backpropagation through time, gradient clipping, plain SGD by hand."""

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

NTOKENS, BPTT, CLIP, LR = 60, 12, 0.25, 2.0


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight  # "Using the Output Embedding" (tied)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.ntoken, self.nhid, self.nlayers = ntoken, nhid, nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.nlayers, bsz, self.nhid),
            weight.new_zeros(self.nlayers, bsz, self.nhid),
        )


def batchify(data, bsz, device):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous().to(device)


def get_batch(source, i):
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def repackage_hidden(h):
    return tuple(v.detach() for v in h)


def evaluate(model, source):
    model.eval()
    total = 0.0
    hidden = model.init_hidden(source.size(1))
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, BPTT):
            data, targets = get_batch(source, i)
            output, hidden = model(data, hidden)
            total += len(data) * F.nll_loss(output, targets).item()
    return total / (len(source) - 1)


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1111)
# a corpus with structure to learn: each token mostly follows from the one before
corpus = [0]
steps = torch.randint(1, 4, (3000,)).tolist()
for s in steps:
    corpus.append((corpus[-1] * 7 + s) % NTOKENS)
corpus = torch.tensor(corpus)
train_data = batchify(corpus[:1200], 8, device)
val_data = batchify(corpus[2600:], 4, device)
model = RNNModel(NTOKENS, 32, 32, 2).to(device)
print("tied", model.decoder.weight is model.encoder.weight, len(list(model.parameters())))
torch.manual_seed(7)  # dropout's stream, on the device
for epoch in range(2):
    model.train()
    hidden = model.init_hidden(8)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, BPTT)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = F.nll_loss(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)
        if batch % 10 == 0:
            print("epoch", epoch, "batch", batch, "loss", loss.item().hex())
    print("epoch", epoch, "valid", evaluate(model, val_data).hex())
digest = hashlib.sha256()
for name, t in model.state_dict().items():
    digest.update(name.encode() + t.detach().cpu().numpy().tobytes())
print("weights", digest.hexdigest())
