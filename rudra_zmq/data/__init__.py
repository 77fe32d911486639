"""Training data: datasets, their decoded cache, image decoding, the sample order, user-supplied data."""
