"""The parameter server: its serve loop (``ps.py``), the request path it shares with the tree
node (``serving.py``), its state and what changes it (``state.py``, ``parts.py``,
``update.py``, ``versions.py``), how it hands out weights (``weights.py``), where its state
comes from (``start.py``, ``initial_weights.py``), whom it stops waiting for
(``liveness.py``), its checkpoints (``checkpoint.py``, ``checkpointing.py``), what it reports
(``report.py``, ``arrival_log.py``) and the files it leaves (``end_files.py``)."""
