"""Security: CurveZMQ on every socket and the run token (``auth.py``), and the key
directories with ``rudra-zmq keys`` (``keys.py``). docs/security.md."""
