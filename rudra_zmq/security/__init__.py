"""security."""
