"""Integrations: elasticd's guarantees for training frameworks that own the training loop."""
