"""An FSDP2 training script, plain (fsdp_tutorial.py) and elastic (fsdp_tutorial_elastic.py).

The shape of PyTorch's FSDP2 examples (and of torchtitan's ``parallelize``): a function
shards the model on a device mesh with ``fully_shard``, the optimizer is built on the
sharded parameters, a DistributedSampler feeds each rank. With gloo on CPU when there is
no GPU, so it runs anywhere. examples/fsdp_tutorial_elastic.py is the same script made
elastic (the diff is in docs/worker-api.md): after any resize the new processes build the
mesh at the new world size, ``parallelize`` shards the model on it, and ``loop.resume()``
loads the sharded checkpoint resharded to the new mesh (model, optimizer, sampler, RNG).
Run: ``torchrun --nproc-per-node 2 examples/fsdp_tutorial.py 4`` or
``elasticd run --standalone --nnodes 1 --nproc-per-node 2 examples/fsdp_tutorial_elastic.py 4``.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, get_world_size, init_process_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from elasticd.worker import ElasticDistributedSampler as DistributedSampler
from elasticd.worker import ElasticLoop


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(20, 32), torch.nn.Linear(32, 32)])
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def parallelize(model, mesh):
    """Shard each layer, then the root (what torchtitan's parallelize does for FSDP)."""
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (get_world_size(),))


def train(total_epochs: int, batch_size: int, dataset_size: int):
    mesh = setup()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = parallelize(Model().to(device), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = MyTrainDataset(dataset_size)
    sampler = DistributedSampler(dataset)
    train_data = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=sampler)
    loop = ElasticLoop({"model": model, "optimizer": optimizer}, sampler)
    first_epoch = loop.resume()  # resharded to this run's mesh: model, optimizer, sampler, RNG
    for epoch in range(first_epoch, total_epochs):
        sampler.set_epoch(epoch)
        for source, targets in loop.batches(train_data):
            optimizer.zero_grad()
            loss = F.mse_loss(model(source.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
        if int(os.environ["RANK"]) == 0:
            print(f"Epoch {epoch} | loss {loss.item():.5f}")
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="FSDP2 training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--dataset_size", default=2048, type=int, help="Samples in the synthetic dataset")
    args = parser.parse_args()
    train(args.total_epochs, args.batch_size, args.dataset_size)
