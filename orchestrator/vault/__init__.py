"""The credential vault: secrets a key stores under a name, bound to hosts, kept encrypted at
rest (AES-GCM under the deployment's key), never put into a sandbox. A session asking for one
gets a placeholder; its egress proxy swaps it for the value in requests to the bound hosts,
terminating TLS for those hosts with the deployment's CA (docs/secrets.md).

`records.py` (the record, the refusals), `crypto.py` (the key and the sealing), `store.py` (the
async interface) with `sqlite_store.py` (one machine) and `redis_store.py` (a cluster), `ca.py`
(the deployment's CA and the bundle sandboxes trust), `files.py` (key and CA files written
whole), `public_suffixes.py` (no wildcard over a shared domain), `vault.py` (the service's
part).
"""
