"""Typer CLI: one module per command group."""
