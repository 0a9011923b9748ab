"""The HTTP API's routers, one per resource."""
