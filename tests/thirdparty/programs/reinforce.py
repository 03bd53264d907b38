"""REINFORCE as pytorch/examples writes it: a policy with dropout samples actions with
Categorical, each episode's log-probabilities are kept and its loss backwarded at the episode's
end. The environment is a small deterministic one of our own (no gym). It exits 3, a status the
recording must pass through unchanged."""

import hashlib
import random
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.distributions import Categorical


class Walk:
    """Keep a point near zero: push left or right against a seeded drift; 40 steps at most."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def reset(self):
        self.x, self.v, self.t = self.rng.uniform(-1, 1), 0.0, 0
        return np.array([self.x, self.v, 0.0, 1.0], dtype=np.float32)

    def step(self, action):
        self.v += (0.1 if action == 1 else -0.1) + self.rng.uniform(-0.05, 0.05)
        self.x += self.v
        self.t += 1
        done = abs(self.x) > 2.0 or self.t >= 40
        state = np.array([self.x, self.v, self.t / 40, 1.0], dtype=np.float32)
        return state, 1.0, done


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(32, 2)
        self.saved_log_probs, self.rewards = [], []

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=1)


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(543)
env = Walk(543)
policy = Policy().to(device)
optimizer = optim.Adam(policy.parameters(), lr=1e-2)
torch.manual_seed(7)  # dropout's and sampling's stream, on the device (not the CPU's, after init)
eps = np.finfo(np.float32).eps.item()


def select_action(state):
    state = torch.from_numpy(state).float().unsqueeze(0).to(device)
    m = Categorical(policy(state))
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode():
    R, returns = 0.0, []
    for r in policy.rewards[::-1]:
        R = r + 0.99 * R
        returns.insert(0, R)
    returns = torch.tensor(returns, device=device)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    policy_loss = [-lp * R for lp, R in zip(policy.saved_log_probs, returns)]
    optimizer.zero_grad()
    loss = torch.cat(policy_loss).sum()
    loss.backward()
    optimizer.step()
    del policy.rewards[:], policy.saved_log_probs[:]
    return loss.item()


running_reward = 10.0
for i_episode in range(12):
    state, ep_reward = env.reset(), 0.0
    for t in range(1, 100):  # noqa: B007 (t is read after the loop, as in the example)
        state, reward, done = env.step(select_action(state))
        policy.rewards.append(reward)
        ep_reward += reward
        if done:
            break
    running_reward = 0.05 * ep_reward + 0.95 * running_reward
    print("episode", i_episode, "length", t, "loss", finish_episode().hex())
digest = hashlib.sha256()
for name, t in policy.state_dict().items():
    digest.update(name.encode() + t.detach().cpu().numpy().tobytes())
print("weights", digest.hexdigest(), "running", running_reward.hex())
sys.exit(3 if running_reward < 40 else 0)  # "not solved": a failing status on purpose
