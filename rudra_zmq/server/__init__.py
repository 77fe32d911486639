"""The parameter server: its serve loop and the pieces of its state."""
