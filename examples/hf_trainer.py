"""A tiny causal LM trained with the Hugging Face Trainer, plain (hf_trainer.py) and elastic.

examples/hf_trainer.py is an ordinary Trainer script: a 2-layer Llama of width 32 built
from a config (no download) on synthetic token data drawn from a seeded generator per
sample. examples/hf_trainer_elastic.py is the same script under elasticd (exactly-once data
order at any world size, a constant global batch, drain with a fenced checkpoint, resume
from elasticd's newest checkpoint); the diff is in docs/integrations/transformers.md.
Run: ``torchrun --nproc-per-node 2 examples/hf_trainer.py`` or
``elasticd run --standalone --nproc-per-node 2 examples/hf_trainer_elastic.py``.
"""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, SEQ_LEN = 64, 16


class SyntheticTokens(Dataset):
    """Token sequences; sample i is drawn from a generator seeded with i (no download)."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(VOCAB, (SEQ_LEN,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def main(epochs: int, dataset_size: int, output_dir: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, num_train_epochs=epochs,
                             learning_rate=1e-3, logging_steps=8, save_strategy="no", report_to="none",
                             seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(dataset_size))
    trainer.train()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a tiny causal LM under the Hugging Face Trainer")
    parser.add_argument("--epochs", default=2, type=int, help="epochs to train (default: 2)")
    parser.add_argument("--dataset-size", default=128, type=int, help="synthetic sequences (default: 128)")
    parser.add_argument("--output-dir", default="hf_trainer_out", help="the Trainer's output_dir")
    cli = parser.parse_args()
    main(cli.epochs, cli.dataset_size, cli.output_dir)
