"""The `ray` backend: sessions as Ray actors spread over a cluster's nodes (docs/cluster.md).

backend.py (RayBackend: placement, attach, nodes), config.py (its configuration),
session_actor.py (the actor on a node), session_start.py (an actor asked for and started),
ray_sandbox.py (its proxy in a replica), warm_pool.py (warm pools per node),
availability.py (whether Ray is installed, asked without importing it),
node_processes.py / remote_process.py (processes), node_tool_relay.py (host tools),
loopback.py (one-machine clusters on 127.0.0.1). Importing this package imports no Ray.
"""
