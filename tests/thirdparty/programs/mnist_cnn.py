"""The MNIST CNN as pytorch/examples trains it, on synthetic 28x28 digits: a DataLoader with
two worker processes and pinned memory, dropout, Adadelta with a StepLR schedule, and a test
pass counting correct answers. The loaders have generators of their own: a loader without one
draws its workers' base seed from the default (CPU) generator at every epoch, which on the CPU
path is also dropout's and on the CUDA path is not (dropout draws from the device's), so a CPU
and a CUDA run would differ from the second epoch on."""

import hashlib

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def digits(n, gen):
    """Class k: a bar at row 2k+4, with noise."""
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = torch.rand(n, 1, 28, 28, generator=gen) * 0.3
    for i, k in enumerate(labels.tolist()):
        images[i, 0, 2 * k + 4 : 2 * k + 6, 4:24] += 1.0
    return TensorDataset((images - 0.1307) / 0.3081, labels)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(1)
    train_set, test_set = digits(256, gen), digits(128, gen)
    kwargs = {"num_workers": 2, "pin_memory": True}
    train_loader = DataLoader(
        train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(2), **kwargs
    )
    test_loader = DataLoader(
        test_set, batch_size=128, generator=torch.Generator().manual_seed(3), **kwargs
    )
    torch.manual_seed(1)
    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    torch.manual_seed(2)  # dropout's stream, on the device (not the CPU's, after the init)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    for epoch in range(1, 3):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            print("epoch", epoch, "batch", batch_idx, "loss", loss.item().hex())
        model.eval()
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.argmax(dim=1, keepdim=True)
                correct += pred.eq(target.view_as(pred)).sum().item()
        print("epoch", epoch, "test loss", test_loss.hex(), "correct", correct)
        scheduler.step()
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode() + t.detach().cpu().numpy().tobytes())
    print("weights", digest.hexdigest())
