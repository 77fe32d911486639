"""The processes of a rudra_zmq run, one module per role.

- ``ps``           the parameter server: holds the weights, applies the sync protocol's updates.
- ``tree_node``    a Rudra-adv PS tree node: sums its children's gradients, relays the sum
                   with its vector clock to its parent, serves its children cached weights.
- ``learner``      a learner: pulls weights, computes gradients on minibatches, pushes them.
- ``data_server``  the data server: serves each learner its disjoint, deterministic minibatches.
- ``stats_server`` the statistics server: records metrics, evaluates test error off the
                   training path, writes ``metrics.jsonl``, ``summary.csv`` and plots.
- ``stats_client`` what every role reports to the statistics server with (never blocks).
- ``broadcast``, ``broadcast_link``  Rudra-adv*: weight versions down a tree of learners.

Each role module has a ``serve(...)``-style entry point used by the CLI (``rudra-zmq ROLE``).
"""
