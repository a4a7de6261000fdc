"""Everything that moves an update between peers. Knows nothing of the training loop or the CLI.

* ``compression``  low-rank power iteration (``LowRankCompressor``: compress / decompress / ratio, exact
  byte counts), the two-party round ``PairRound``, and explicit ``ErrorFeedback`` state. Pure torch.
* ``wire``         the versioned msgpack message format: ``Kind``, ``Message``, ``encode``, ``decode`` with
  size caps, dtype/shape/finiteness checks. Never pickle.
* ``protocol``     the pairwise exchange as a bounded, abortable sequence of messages: ``GossipAverager``
  finds a ready partner within a window and returns an ``ExchangeResult`` or None
* ``transport``    framed byte streams: ``P2PTransport`` over hivemind's libp2p daemon, and the
  ``InMemoryNetwork`` twin with fault hooks for tests
* ``state_transfer``  a live peer's state for a late joiner: ``StateDonor`` serves a pinned ``StateSnapshot``
  in hashed chunks (at most ``max_uploads`` at once), ``StateDownloader`` fetches and verifies it, moving on to
  another donor when one dies, stalls or declines
* ``partners``     who may be asked: ``DHTPartners`` (ready peers from the run's announcements) and
  ``StaticPartners``
* ``aggregation``  robust aggregation: ``RobustAggregator`` clips a partner's contribution against ours and
  rejects absurd ones (too large, sign-flipped, non-finite) before anything is applied
* ``access``       private runs: ``AccessPolicy`` (a shared secret proven by HMAC, an allowlist of peer ids),
  checked before any model data moves; ``load_policy`` reads the CLI flags
* ``cooldown``     ``Cooldown``: a peer that keeps sending bad messages is neither asked nor answered for a while
"""
