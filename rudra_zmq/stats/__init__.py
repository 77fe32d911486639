"""The statistics server (``server.py``) and what every role reports to it with
(``client.py``): the metrics file, the test-error evaluation, the progress lines,
TensorBoard, the join of a sharded run's EVALs and the end of a run."""
