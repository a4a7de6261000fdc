"""Everything that moves an update between peers. Knows nothing of the training loop or the CLI.

* ``compression``  the codecs (signs, int8, dense fp16, low-rank power iteration: ``LowRankCompressor`` with
  compress / decompress / ratio, exact byte counts and warm starts, ``plan``) and explicit ``ErrorFeedback``
  state. Pure torch.
* ``wire``         the versioned msgpack message format: ``Kind``, ``Message``, ``encode``, ``decode`` with
  size caps, dtype/shape/finiteness checks. Never pickle.
* ``groups``       who averages with whom, and when: rounds on a shared clock (``Appointment``,
  ``next_appointment``), groups planned from the roster (``plan_groups``, ``group_of``), ``should_seal``. Pure.
* ``mixing``       the arithmetic of a group average: ``GroupRound`` (every member's own codes, all-gathered,
  give one exact mean; PowerSGD/PowerGossip over a group for low-rank slots), ``local_round``. Pure torch
* ``group``        the group exchange: ``GroupAverager`` joins a leader or leads (JOIN / ROSTER), returns a
  ``GroupResult`` or None
* ``exchange``     one sealed group's exchange: ``SealedExchange`` (pair streams, HAVE / PROCEED / COMMIT),
  ``Messenger`` (typed, bounded messages), the errors
* ``parts``        a payload streamed as bounded frames: ``plan_parts`` (the cut, from the layout alone),
  ``Frames`` (each part encoded as it is sent), ``Assembler`` (checks each part and fills tensors allocated once)
* ``lazy``         ``Lazy``: a mapping whose values are computed when read (offers, contributions, projections)
* ``memory``       ``allocate``: tensors that live together (a payload, the residuals) carved from one block, made
  before the temporaries that come and go around them, so the heap is not left in holes
* ``transport``    framed byte streams: ``P2PTransport`` over hivemind's libp2p daemon, and the
  ``InMemoryNetwork`` twin with fault hooks for tests; ``Admission``/``Gate``: inbound streams capped per remote and
  in all before a byte is read, barred remotes turned away, and what is turned away held a while (a tarpit)
* ``state_transfer``  the state-download protocol for a late joiner: ``TransferConfig`` (sizes, bounds that scale
  with the state), ``Manifest``, the messages, and ``StateDonor``, which serves a pinned ``StateSnapshot`` in
  hashed chunks (at most ``max_uploads`` joiners at once)
* ``state_download``  the joiner's side: ``StateDownloader`` takes chunks from several donors that agree on the
  payload, pipelined, with work stealing, into one buffer; a donor that dies, stalls or lies is dropped and its
  chunks fetched elsewhere; verified chunks survive for the next try
* ``aggregation``  robust aggregation: ``RobustAggregator`` clips each member's contribution (against ours, or
  the group's median) and leaves out absurd ones (too large, sign-flipped, non-finite) before anything is applied
* ``access``       private runs: ``AccessPolicy`` (a shared secret proven by HMAC, an allowlist of peer ids),
  checked before any model data moves; ``load_policy`` reads the CLI flags
* ``cooldown``     ``Cooldown``: a peer that keeps sending bad messages is neither asked nor answered for a while
  (its streams are turned away at the transport's gate, unread)
* ``standing``     ``Standing``: whose announcements plan our groups: proven by an exchange, or past a probation, and
  not barred by faults (declines, refusals, no-shows) counted per id and per announced host, in bounded memory. Pure
"""

from murmur.dht import lazy_hivemind

lazy_hivemind.install()  # before any of hivemind's modules (dht/lazy_hivemind.py)
