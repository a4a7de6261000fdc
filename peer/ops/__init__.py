"""The operator's tools: what a run looks like from outside a peer.

* ``status``    ``murmur status``: a run's config and live peers (step, loss, last seen) read from the DHT
* ``report``    ``murmur report``: a peer's or a simulation's metrics logs plotted to one PNG
* ``doctor``    ``murmur doctor``: p2pd, the port, torch/CUDA and reachability, one verdict and fix per check
* ``progress``  the live progress line of a joined peer (``render_progress`` is pure), the state download's bar
"""
