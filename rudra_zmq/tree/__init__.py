"""tree."""
