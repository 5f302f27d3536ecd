"""Model and synthetic data of cifar_style.py (its ``models`` module)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


class SyntheticImages(Dataset):
    """3x8x8 images in 4 classes given by a fixed random teacher; items: (image, label, id)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        teacher = torch.randn(3 * 8 * 8, 4, generator=torch.Generator().manual_seed(123))
        self.y = (self.x.flatten(1) @ teacher).argmax(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 1)
        return self.fc(x.flatten(1))
