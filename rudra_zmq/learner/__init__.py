"""The learner: the torch loop (``learner.py``), how it trades gradients for weights
(``exchange.py``; with sharded servers ``shards.py``) and its side of the data server
(``data_client.py``)."""
