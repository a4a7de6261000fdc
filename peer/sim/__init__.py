"""The researcher's simulators: many peers on one machine, running what real peers run.

* ``swarm``     ``VirtualSwarm``: the round engine's driver on a virtual clock, behind both in-process simulators
* ``virtual``   many peers in one process in virtual time: ddp, DiLoCo and gossip on one budget (benchmarks)
* ``scale``     thousands of digits-MLP peers in virtual time: churn, consumer links, spread (simulate_scale)
* ``simulate``  ``murmur simulate``: a bootstrap node and N peer processes on loopback, then a report
"""
