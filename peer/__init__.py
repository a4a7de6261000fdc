"""The volunteer's program: a training peer, its config, and the `murmur` command.

* ``config``    ``TrainConfig``: what every peer of a run agrees on; published as the run record
* ``model``     the model registry: a small byte-level GPT (``build_model``, ``MODELS``)
* ``data``      the Python standard library's own source as text, split by file; batches and eval sets
* ``trainer``   ``Trainer``: the inner AdamW loop, evaluation, and compute-time accounting
* ``outer``     ``OuterOptimizer``: what a round offers, and the outer Nesterov step with consensus
* ``state``     state download on join: what a joiner takes (anchor, momentum, step counters) and ``StateSharing``
* ``checkpoint`` checkpoint files: atomic writes, a header with a sha256, weights-only loads, fallback
* ``runner``    ``VolunteerPeer``: a peer on the real network (DHT node, P2P, heartbeat, rounds, report)
* ``metrics``   the per-round metrics log, ``PeerReport`` / ``SwarmReport``, the consensus distance
* ``simulate``  ``murmur simulate``: a bootstrap node and N peer processes on loopback, then a report
* ``status``    ``murmur status``: a run's config and live peers (step, loss, last seen) read from the DHT
* ``report``    ``murmur report``: a peer's or a simulation's metrics logs plotted to one PNG
* ``cli``       the ``murmur`` entry point: parse, build, run, close
"""
