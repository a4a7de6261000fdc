"""The volunteer's program: a training peer, its config, and the `murmur` command.

* ``config``    ``TrainConfig``: what every peer of a run agrees on; published as the run record
* ``model``     the model registry: a small byte-level GPT (``build_model``, ``MODELS``)
* ``data``      the Python standard library's own source as text, split by file; batches and eval sets
* ``workload``  what a peer trains: the built-in GPT or a researcher's model/batches by import path
* ``device``    ``--device``/``--precision``: CUDA or CPU, bf16/fp16 autocast, micro-batches that fit memory
* ``trainer``   ``Trainer``: the inner loop (mixed precision, accumulation), evaluation, compute-time accounting
* ``outer``     ``OuterOptimizer``: what a round offers, and the outer Nesterov step with consensus
* ``state``     state download on join: what a joiner takes (anchor, momentum, step counters) and ``StateSharing``
* ``tensorfile`` a nested state as one safetensors file: tensors by path, the rest as JSON metadata, a sha256,
  atomic writes
* ``checkpoint`` checkpoint files (``ckpt-<step>.safetensors``): labels, one-line errors, the writer thread,
  fallback, pruning only among files that verify; ``checkpoint_v1`` reads the ``.pt`` ones of older peers
* ``anchorfile`` the final model ``anchor.safetensors``: the anchor as the model's own state dict
* ``rundir``    whether a run folder holds an earlier run (refused without ``--resume``; simulate moves on)
* ``verdict``   ``RunVerdict``: when a peer stops with one line (non-finite rounds, no peer with its layout)
* ``rounds``    ``RoundEngine``: one peer's rounds as a state machine (appointment, steps, group plan, outcome,
  finish), no I/O and no clock of its own; ``replay`` checks a recorded trace against it
* ``runner``    ``VolunteerPeer``: the engine's wall-clock driver on the real network (DHT, P2P, heartbeat, report)
* ``journal``   ``Journal``: what a peer says of its rounds (metrics.jsonl, DHT metrics, progress line, report)
* ``api``       the Python API: ``Swarm`` (a run's bootstrap node) and ``Peer`` (any ``nn.Module``)
* ``metrics``   the per-round metrics log, ``PeerReport`` / ``SwarmReport``, the consensus distance
* ``sim/``      the simulators (``swarm``, ``virtual``, ``scale``, ``simulate``): many peers on one machine, the
  same engine and exchange
* ``ops/``      the operator's tools (``status``, ``report``, ``doctor``, ``progress``)
* ``flags``     every flag of the command line, range-checked, parsed without torch or hivemind
* ``cli``       the ``murmur`` entry point: parse, build, run, close
"""

from murmur.dht import lazy_hivemind

lazy_hivemind.install()  # before any of hivemind's modules (dht/lazy_hivemind.py)
