"""The learner: the torch loop (``learner.py``), how it trades gradients for weights
(``exchange.py``, with one carrier per server's range, ``carriers.py``, over its links to
the servers of the cluster's shape, ``links.py``) and its side of the data server
(``data_client.py``)."""
