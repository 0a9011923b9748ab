"""Cluster mode (docs/cluster.md): stateless service replicas over a shared store.

Sessions of the `ray` backend live in Ray actors any replica can attach to; their records live
in Redis (orchestrator/state_store/redis_store.py), and so do the caps, the claims that make
each end happen once and the tombstones that say why (coordination_store.py). A replica keeps
only a cache of attached sessions.

Nothing here imports Ray or Redis until cluster mode is asked for (`store_url`): both are the
`[cluster]` extra, which a single-machine install does not have.
"""
