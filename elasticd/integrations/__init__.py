"""Integrations of elasticd with the training frameworks users already run (issue 50)."""
