"""A plain Lightning script (examples/lightning_plain.py) and the same script under elasticd.

A tiny regression model on synthetic data (no download), trained with DDP on CPU (gloo) or
GPU. examples/lightning_plain.py is the plain form, run by torchrun;
examples/lightning_elastic.py is the same script with elasticd's Lightning integration
(exactly-once data order at any world size, a constant global batch, drain at a step
boundary with a fenced checkpoint, resume): the diff is in docs/integrations/lightning.md.
Run: ``torchrun --nproc-per-node 2 examples/lightning_plain.py`` or
``elasticd run --standalone --nproc-per-node 2 examples/lightning_elastic.py``.
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from elasticd.integrations.lightning import ElasticCallback


class SyntheticDataset(Dataset):
    """y = x @ w + noise, generated once from a fixed seed."""

    def __init__(self, size: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 16, generator=g)
        self.y = self.x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class Regressor(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)}


def main():
    parser = argparse.ArgumentParser(description="a tiny Lightning DDP job on synthetic data")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="per device")
    parser.add_argument("--devices", type=int, default=2, help="processes per node (--nproc-per-node)")
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    L.seed_everything(0)
    dataset = SyntheticDataset(args.dataset_size)
    elastic = ElasticCallback(global_batch_size=args.batch_size * args.devices, max_micro_batch=args.batch_size)
    loader = DataLoader(dataset, batch_sampler=elastic.batch_sampler(dataset))
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="auto",
        devices=args.devices,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[elastic], plugins=[elastic.environment()], use_distributed_sampler=False,
    )
    trainer.fit(Regressor(args.lr), loader)


if __name__ == "__main__":
    main()
