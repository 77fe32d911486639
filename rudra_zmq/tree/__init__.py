"""Rudra-adv's PS tree node: its serve loop (``node.py``), its state (``state.py``; the relay
clock it owns is ``sync/relay_clock.py``), how it answers its children (``weights.py``) and a
leaf's shared memory with its learners (``leaf_shm.py``)."""
