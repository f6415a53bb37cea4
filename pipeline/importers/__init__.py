"""Importers of models trained elsewhere."""
