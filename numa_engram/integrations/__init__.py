"""Integrations with serving engines (imported only by the engines' plugin
loaders; nothing here is imported by the rest of the package)."""
