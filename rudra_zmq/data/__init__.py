"""Training data: datasets, their decoded cache, image decoding, the sample order, user-supplied data, and the data server that serves each learner its minibatches (``server.py``)."""
